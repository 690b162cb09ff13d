"""Starting a tensor-parallel worker's ranks 1..N-1 and running one.

Rank 0 (the worker's own process) makes a `RankSpec`: the engine config every rank
builds from (dtype and, on CPU, the KV block count already decided, so that the ranks
agree), the rendezvous address and secret, and how the collectives run. A launcher
starts a process per rank with it: `LocalRanks` (child processes: `python -m
engine.parallel.rank`, the spec on stdin) by default; under Ray the worker runtime
passes one that makes the ranks Ray actors in the worker's placement group
(worker_runtime/tp.py). `run_rank` is the body of every rank but 0, wherever it runs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass

from engine.config import DeviceConfig, EngineConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build its shard and join its group."""

    config: EngineConfig  # as rank 0 resolved it: dtype set; on CPU, the cache's num_blocks
    size: int
    address: str  # rank 0's rendezvous (engine/parallel/group.py)
    secret: str
    comm: tuple  # ("shm", path, slot_bytes) or ("torch", init_method)
    step_limits: tuple[int, int, int]
    devices: tuple[DeviceConfig, ...]  # each rank's device, threads and cores
    timeout_s: float = 60.0  # any one collective
    name: str = "worker"  # for log lines: the worker's id

    def device(self, rank: int) -> DeviceConfig:
        return self.devices[rank]


def split_cores(device: DeviceConfig, size: int) -> tuple[DeviceConfig, ...]:
    """Each rank's DeviceConfig. On CPU the worker's cores (its affinity, else the cores
    this process may use) are split into `size` equal runs, one per rank, each with as
    many threads; on CUDA rank r takes device index base + r, unless `one_device_each`
    (Ray gives each rank's actor its own, as cuda:0)."""
    if device.device.startswith("cuda"):
        base = int(device.device.partition(":")[2] or 0)
        return tuple(dataclasses.replace(device, device=f"cuda:{base + r}") for r in range(size))
    cores = tuple(device.cpu_affinity or sorted(os.sched_getaffinity(0)))
    per = max(1, len(cores) // size)
    out = []
    for r in range(size):
        mine = cores[r * per:(r + 1) * per] or cores[-per:]
        threads = max(1, device.num_threads // size) if device.num_threads else len(mine)
        # no borrowing of other workers' idle cores (engine/cores.py): a rank that ran ahead
        # on borrowed cores would only wait longer at the next all-reduce for the others
        out.append(dataclasses.replace(device, cpu_affinity=tuple(mine), num_threads=threads, core_table=None,
                                       shared_cores=None))
    return tuple(out)


_launcher_factory = None


def use_launcher(factory) -> None:
    """What starts this process's workers' other ranks from now on (a callable making a
    launcher; None: child processes). The worker runtime sets it in a Ray actor that
    sits in a placement group (worker_runtime/tp_ray.py)."""
    global _launcher_factory
    _launcher_factory = factory


def default_launcher():
    return _launcher_factory() if _launcher_factory is not None else LocalRanks()


class LocalRanks:
    """Ranks as child processes of rank 0 (`python -m engine.parallel.rank`). Each one
    exits when rank 0's socket closes; `stop` ends them for certain."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def place(self, devices: tuple[DeviceConfig, ...]) -> tuple[DeviceConfig, ...]:
        """Each rank's device as its own process sees it: here, as split."""
        return devices

    def start(self, spec: RankSpec) -> None:
        data = pickle.dumps(spec)
        for rank in range(1, spec.size):
            p = subprocess.Popen([sys.executable, "-m", "engine.parallel.rank", str(rank)], stdin=subprocess.PIPE,
                                 start_new_session=False)
            p.stdin.write(data)
            p.stdin.close()
            self.procs.append(p)

    def failed(self) -> str | None:
        """Why a rank is gone (its exit status), or None."""
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                return f"rank {rank} (pid {p.pid}) exited with status {p.returncode}"
        return None

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def make_comm(spec: RankSpec, rank: int, create: bool = False):
    from engine.parallel.comm import ShmComm, TorchComm

    kind = spec.comm[0]
    if kind == "shm":
        _, path, slot_bytes = spec.comm
        return ShmComm(path, rank, spec.size, slot_bytes, spec.timeout_s, create=create)
    import torch

    return TorchComm(spec.comm[1], rank, spec.size, torch.device(spec.device(rank).device), spec.timeout_s)


def run_rank(spec: RankSpec, rank: int) -> int:
    """Build rank `rank`'s shard and runner, join the group, follow rank 0's steps until
    it stops or goes. Returns the exit status."""
    import torch

    from engine.config import CacheConfig
    from engine.models.builtin import builtin_model_path
    from engine.models.checkpoint import load_checkpoint
    from engine.models.loader import build_model
    from engine.parallel.group import TPGroup, connect
    from engine.parallel.shard import Shard, local_config
    from engine.runner import ModelRunner

    device = spec.device(rank)
    if device.cpu_affinity:
        try:
            os.sched_setaffinity(0, set(device.cpu_affinity))
        except OSError as e:
            log.warning("rank %d: could not pin to cores %s: %s", rank, device.cpu_affinity, e)
    torch.set_num_threads(1 if device.device == "cpu" and device.cpu_affinity else device.num_threads or 1)
    cfg = spec.config
    comm = make_comm(spec, rank)
    group = None
    try:
        ckpt = load_checkpoint(cfg.model or builtin_model_path(), dtype=cfg.dtype, quantization=cfg.quantization,
                               kv_cache_dtype=cfg.cache.kv_cache_dtype)
        # KV groups as rank 0 decided them (engine/parallel/start.py): the same tables, the same cache layout
        ckpt = dataclasses.replace(ckpt, config=dataclasses.replace(ckpt.config, kv_hybrid=cfg.cache.hybrid_kv))
        shard = Shard(rank, spec.size, cfg.parallel.enable_expert_parallel)
        model = build_model(ckpt, device.device, shard)
        model.set_tensor_parallel(comm, cfg.parallel.vocab_parallel_head)
        cache: CacheConfig = cfg.cache
        runner = ModelRunner(model, local_config(ckpt.config, shard), cache, device, sampler_seed=cfg.seed,
                             step_limits=spec.step_limits, comm=comm)
        group = TPGroup(rank, spec.size, comm, [connect(spec.address, rank, spec.secret)])
        runner.tp = group
        log.info("%s rank %d/%d: shard loaded on %s, %d KV blocks; following rank 0", spec.name, rank, spec.size,
                 device.device if not device.cpu_affinity else f"cores {list(device.cpu_affinity)}",
                 runner.kv_cache.num_blocks)
        runner.follow()
        return 0
    except Exception as e:  # noqa: BLE001 - the rank's one way out: say why to rank 0, then exit
        log.exception("%s rank %d failed", spec.name, rank)
        if group is not None:
            group.report(f"{type(e).__name__}: {e}")
        return 1
    finally:
        if group is not None:
            group.close()
        else:
            comm.close()
