"""Rank 0's side of starting a tensor-parallel worker (engine/build.py calls it):
decide what every rank must agree on, start the other ranks, and, once rank 0's own
shard and runner are made, wait for them to join."""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import tempfile
import time
from dataclasses import dataclass

import torch

from engine.config import CacheConfig, ConfigError, EngineConfig
from engine.kv_cache import layout_for
from engine.parallel.comm import shm_slot_bytes
from engine.parallel.group import Rendezvous, TPGroup
from engine.parallel.ranks import RankSpec, default_launcher, make_comm, split_cores
from engine.parallel.shard import Shard, check_divisible, local_config

log = logging.getLogger(__name__)


@dataclass
class StartedRanks:
    spec: RankSpec
    rendezvous: Rendezvous
    launcher: object
    comm: object
    shard: Shard
    model_config: object
    cache: CacheConfig
    devices: tuple

    def join(self, runner) -> None:
        """Wait (bounded) for every other rank to load its shard and connect; then `runner`
        (rank 0's) sends them its steps. A rank that failed to start fails this."""
        t0 = time.monotonic()
        try:
            conns = self.rendezvous.accept(self.spec.size, self.spec.config.parallel.start_timeout_s,
                                           alive=self.launcher.failed)
        except Exception:
            self.comm.close()
            self.launcher.stop(0)
            raise
        if self.spec.comm[0] == "shm":  # every rank has it mapped now: its name can go, so that no
            try:                        # rank killed later leaves the file behind in /dev/shm
                os.unlink(self.spec.comm[1])
            except FileNotFoundError:
                pass
        runner.tp = TPGroup(0, self.spec.size, self.comm, conns)
        runner.tp_ranks = self.launcher
        runner.tp_devices = self.devices
        log.info("tensor parallel over %d ranks (%s all-reduce; each on %s); the others joined %.1f s after rank 0's "
                 "shard was ready", self.spec.size, self.spec.comm[0],
                 ", ".join(d.device if not d.cpu_affinity else f"cores {list(d.cpu_affinity)}" for d in self.devices),
                 time.monotonic() - t0)


def start_ranks(config: EngineConfig, ckpt, step_limits: tuple[int, int, int], launcher=None,
                name: str = "worker") -> StartedRanks:
    par = config.parallel
    size = par.tensor_parallel_size
    check_divisible(ckpt.config, size, par.enable_expert_parallel)
    shard = Shard(0, size, par.enable_expert_parallel)
    local = local_config(ckpt.config, shard)
    device = config.device
    launcher = launcher or default_launcher()
    devices = launcher.place(split_cores(device, size))
    cache = config.cache
    cuda = device.device.startswith("cuda")
    if not cuda:  # every rank's cache the same number of blocks, decided here
        if cache.num_blocks is None:
            if cache.kv_cache_memory_gb is None and cache.cpu_kv_fraction is not None:
                gb, _ = cache.cpu_kv_gb()
                cache = dataclasses.replace(cache, kv_cache_memory_gb=gb / size)  # the worker's share, split
            n = cache.resolve_num_blocks(layout_for(local, cache.block_size).block_bytes)
            cache = dataclasses.replace(cache, num_blocks=n)
    kind = par.comm
    if kind == "auto":
        kind = "torch" if cuda else "shm"
    if kind == "shm":
        if cuda:
            raise ConfigError("the shared-memory all-reduce is for CPU ranks; CUDA ranks use NCCL")
        itemsize = torch.tensor([], dtype=getattr(torch, ckpt.config.dtype)).element_size()
        path = f"/dev/shm/tandem-tp-{os.getpid()}-{secrets.token_hex(4)}"
        comm_spec = ("shm", path, shm_slot_bytes(step_limits[0], ckpt.config.hidden_size, itemsize,
                                                 row=-(-ckpt.config.vocab_size // size) * itemsize))
    else:
        store = tempfile.mkdtemp(prefix="tandem-tp-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        comm_spec = ("torch", f"file://{store}/store")
    rendezvous = Rendezvous()
    # the other ranks take rank 0's decision on KV groups (engine/build.py) with its cache
    cache = dataclasses.replace(cache, hybrid_kv=ckpt.config.kv_hybrid)
    resolved = dataclasses.replace(config, dtype=ckpt.config.dtype, cache=cache, model=str(ckpt.path))
    spec = RankSpec(resolved, size, rendezvous.address, rendezvous.secret, comm_spec, step_limits, devices,
                    par.rank_timeout_s, name)
    comm = make_comm(spec, 0, create=True) if kind == "shm" else None
    launcher.start(spec)
    if comm is None:  # torch.distributed: every rank joins at once
        comm = make_comm(spec, 0)
    return StartedRanks(spec, rendezvous, launcher, comm, shard, local, cache, devices)
