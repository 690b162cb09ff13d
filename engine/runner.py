"""ModelRunner: a plain step plan in, sampled tokens out.

The plan is policy's output (schedulers build it from plain data); `_prepare` is the
one place where it becomes tensors. A step mixes decode tokens and prefill chunks
(Sarathi-Serve), ordered decodes first:

    input_ids:  [d0 d1 ... d(Bd-1) | p0 chunk ......... | p1 chunk ... ]
    positions:  [ctx-1 per decode  | start .. start+n-1 | ...          ]
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from array import array
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from engine import envs
from engine.attention import AttentionBackend, AttentionMetadata, KeptRows, get_backend
from engine.config import CacheConfig, ConfigError, DeviceConfig, ModelConfig
from engine.cores import IdleHelpers, open_core_table
from engine.cpu_kernels import build
from engine.events import TokenLogprobs
from engine.graphs import DecodeGraphs, cuda_capture
from engine.kv_cache import KVCache, layout_for
from engine.memory import CudaMemory, KVSizing, MemorySnapshot, profile_plan, reuse_freed_memory
from engine.models.packed import can_pack, pack_linears, plain_kernel_ops, plain_linears
from engine.parallel.comm import RankLost
from engine.parallel.group import Call, Profile, Reply, Step, Stop, plan_for_ranks
from engine.plan import PENDING, SampleRow, SeqWork, StepPlan  # noqa: F401 (re-exported)
from engine.quantization.linear import use_cpu_kernels
from engine.sampler import DeviceSample, Sampler, SamplerOutput

log = logging.getLogger(__name__)


_PROMPT_LOGPROB_ROWS = 256  # prompt positions turned into log-softmax rows at a time


@dataclass
class StepResult:
    """Sampled tokens by seq_id (only for works that asked to sample). A speculative
    decode's emitted tokens are `accepted[seq_id] + [token_ids[seq_id]]`."""

    token_ids: dict[object, int]
    logprobs: dict[object, TokenLogprobs | None]
    forward_s: float
    num_tokens: int
    prompt_logprobs: dict = field(default_factory=dict)  # seq_id -> [TokenLogprobs] of this chunk's prompt tokens
    # speculative decodes: the draft tokens verification kept (before `token_ids`' token), and their logprobs
    accepted: dict = field(default_factory=dict)
    accepted_logprobs: dict = field(default_factory=dict)


@dataclass
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_index: torch.Tensor
    sample_ids: list[object]
    sample_rows: list[SampleRow]


@dataclass
class Launched:
    """A step whose work is queued on the device (`ModelRunner.launch`): its sampled
    tokens come back with `collect`. On CUDA they are copied to pinned host memory behind
    the step, and `ready` (an event recorded after the copy) says when they are there;
    waiting on it waits for this step only, not for steps launched after it."""

    num_tokens: int
    sample_ids: list[object]
    rows: list[SampleRow]
    sample: DeviceSample  # its `tokens`, one per sample id, are what a step launched after reads
    host: list[torch.Tensor] | None  # pinned copies of the sample's tensors (CUDA)
    ready: object | None
    started: float

    def row_of(self) -> dict[object, int]:
        return {sid: i for i, sid in enumerate(self.sample_ids)}


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device_config: DeviceConfig,
        sampler_seed: int | None = None,
        step_limits: tuple[int, int, int] = (2048, 256, 2048),
        snapshot: MemorySnapshot | None = None,
        memory: CudaMemory | None = None,
        comm=None,
    ) -> None:
        """`step_limits` (max_num_batched_tokens, max_num_seqs, max_model_len): the largest
        step the scheduler may plan, run once to size the KV cache from the device's memory
        (CUDA, when the cache size is not given), and the decode graphs' bounds.
        `snapshot`: the device's memory before the weights were loaded (engine/memory.py).
        `memory`: the counters it is read from (default: torch.cuda's on CUDA, none on CPU).
        `comm`: under tensor parallelism, the ranks' Communicator (engine/parallel/comm.py):
        the model is this rank's shard, and every rank runs the same steps. Rank 0 sets
        `tp` (its TPGroup) once the others have joined, and from then on sends each step to
        them before running it; the others call `follow`."""
        self.device = torch.device(device_config.device)
        self.comm = comm
        self.tp = None  # engine.parallel.group.TPGroup: rank 0's sends its steps to the other ranks
        self.tp_ranks = None  # rank 0: what started the other ranks (engine/parallel/ranks.py), to stop them
        self.rank_parts: dict = {}  # a rank but 0: what the worker set up on it (`Call`s), closed when it exits
        if self.device.type == "cpu":
            reuse_freed_memory()  # a step's activations are reused, not faulted in again
        self.model = model
        # weights a step reads (the embedding: one row a token, unless it is also the head),
        # counted before packing takes the linear layers' weights out of the parameters
        self.weight_params = sum(p.numel() for p in model.parameters()) - (
            model.embed_tokens.weight.numel() if model.lm_head is not None else 0)
        if can_pack(model, self.device):
            pack_linears(model, model.embed_tokens.weight if model.lm_head is None else None,
                         small_batch=device_config.small_batch_linear)
        elif device_config.small_batch_linear and (plain_ops := plain_kernel_ops(model, self.device)) is not None:
            plain_linears(model, plain_ops, model.embed_tokens.weight if model.lm_head is None else None)
        if self.device.type == "cpu" and hasattr(model, "cpu_ops"):
            model.cpu_ops = fused_cpu_ops()
            use_cpu_kernels(model, model.cpu_ops)
        self.model_config = model_config
        # LongRoPE: a token's position becomes its row of the rotary tables (short or long)
        self._rope_row = model_config.rope_row if model_config.long_rope_from is not None else None
        self.block_size = cache_config.block_size
        self.num_kv_groups = len(model_config.kv_groups)  # engine/kv_groups.py: a table per group
        self.backend: AttentionBackend = get_backend(device_config.attention_backend, self.device)
        self.sampler = Sampler(self.device, sampler_seed)
        cpu = self.device.type == "cpu"
        # a step's threads: as configured (a worker's main thread keeps one: worker_runtime/rpc.py
        # setup_process), else as many as torch has now
        self.max_threads = (cpu and (device_config.num_threads or len(device_config.cpu_affinity or ()))
                            or torch.get_num_threads())
        self.serial_step_work = (device_config.serial_step_work or 0) if cpu else 0
        self.kept_rows = envs.kept_rows()  # the last layer computes the sampled rows only (_kept_rows)
        # whether each step sets its own team (_size_team)
        self.sized = cpu and bool(device_config.num_threads or device_config.cpu_affinity or self.serial_step_work)
        # CPU cores the worker owns: its steps' OpenMP threads are bound one to a core, from
        # the thread that runs the steps (bound on its first step; see threads.cpp)
        cores = device_config.cpu_affinity if cpu and envs.cpu_bind_threads() else None
        self.own_cores = tuple(cores[: self.max_threads]) if cores and len(cores) >= self.max_threads else None
        self.bind_cores = list(self.own_cores) if self.own_cores and self.max_threads > 1 else None
        # idle cores of other workers on this host, borrowed for a step (engine/cores.py); a
        # thread can run on a borrowed core only once bound to it, so lending needs binding
        self.ledger = (open_core_table(device_config.core_table, self.own_cores, device_config.shared_cores)
                       if self.own_cores else None)
        if self.ledger is not None:
            log.info("steps run on cores %s and borrow any of %s whose owners are idle", list(self.own_cores),
                     list(self.ledger.others))
        self.bound: tuple[int, tuple[int, ...]] | None = None  # (engine thread, cores of its bound team)
        self.lent_steps = 0  # steps that ran threads on borrowed cores
        self.borrowing = True  # False inside own_cores_only()
        # helpers of the bound team that a step does not use wait at SCHED_IDLE (engine/cores.py)
        self.helpers = IdleHelpers() if self.own_cores and envs.cpu_idle_helpers() and IdleHelpers.available() else None
        self.kv_sizing: KVSizing | None = None
        self.graphs: DecodeGraphs | None = None  # made last: the sizing step below runs eagerly
        self.graph_bytes = 0  # device memory the captured graphs took (CUDA)
        self.graph_stream = None  # the CUDA stream every capture runs on, sizing's and the real one
        self._collected_at = 0.0  # when `collect` last returned
        if memory is None and self.device.type == "cuda":
            memory = CudaMemory(self.device)
        graphs = self._wants_graphs(device_config.cuda_graphs)
        if graphs and comm is not None and comm.size > 1:
            # a capture would have to run on every rank at once, collectives inside it
            log.info("tensor parallel: decode steps run eagerly (no CUDA graphs across ranks yet)")
            graphs = False
        if graphs and self.num_kv_groups > 1:
            # the captured graphs hold one set of block tables
            log.info("KV groups: decode steps run eagerly (no CUDA graphs with a table per group yet)")
            graphs = False
        if memory is not None and cache_config.num_blocks is None and cache_config.kv_cache_memory_gb is None:
            blocks = self._blocks_from_device(memory, cache_config.gpu_memory_utilization, step_limits, snapshot,
                                              graphs)
            cache_config = dataclasses.replace(cache_config, num_blocks=blocks)
        self.kv_cache = KVCache(model_config, cache_config, self.device)
        if graphs:
            self._capture_graphs(memory, step_limits[1], step_limits[2])

    def _wants_graphs(self, setting: bool | None) -> bool:
        """Whether decode steps replay CUDA graphs: `setting` True requires them, False
        turns them off, None (the default) takes them wherever they can run."""
        possible = self.device.type == "cuda" and self.backend.name == "triton"
        if setting and not possible:
            raise ConfigError(f"--cuda-graphs needs a CUDA device and the triton attention backend (here: "
                              f"{self.device}, {self.backend.name})")
        return possible if setting is None else setting

    def _new_graphs(self, kv_layers, max_num_seqs: int, max_model_len: int) -> DecodeGraphs:
        """Decode graphs over `kv_layers`, captured on the stream of the previous capture
        (the first one makes it)."""
        graphs = DecodeGraphs(self.model, kv_layers, self.backend, max_num_seqs=max_num_seqs,
                              max_model_len=max_model_len, block_size=self.block_size, device=self.device,
                              capture=cuda_capture, stream=self.graph_stream)  # (a CPU test stands in for it)
        self.graph_stream = graphs.stream
        return graphs

    def _capture_graphs(self, memory: CudaMemory, max_num_seqs: int, max_model_len: int) -> None:
        before = memory.reserved()
        t0 = time.perf_counter()
        self.graphs = self._new_graphs(self.kv_cache.layers, max_num_seqs, max_model_len)
        memory.settle()  # the warm-up runs' blocks of the ordinary pool go back
        self.graph_bytes = memory.reserved() - before
        log.info("decode graphs for batch sizes %s captured in %.1f s, %.0f MiB of device memory%s",
                 ",".join(map(str, self.graphs.buckets)), time.perf_counter() - t0, self.graph_bytes / (1 << 20),
                 f" ({self.kv_sizing.decode_graphs / (1 << 20):.0f} MiB set aside at sizing)"
                 if self.kv_sizing is not None else "")

    def profile_graphs(self, memory: CudaMemory, max_num_seqs: int, max_model_len: int) -> int:
        """Device memory the decode graphs will hold: the same graphs captured once on a
        two-block scratch cache (the padded rows read block 0 and write nothing), and what
        the allocator still holds once they are made and its cache is emptied: their pool,
        static buffers and outputs, and the capture stream's cuBLAS workspace, which stays
        for the real capture on the same stream. Then they are dropped."""
        scratch = KVCache(self.model_config, CacheConfig(block_size=self.block_size, num_blocks=2), self.device)
        memory.settle()
        before = memory.reserved()
        trial = self._new_graphs(scratch.layers, max_num_seqs, max_model_len)
        memory.settle()
        used = memory.reserved() - before
        del trial, scratch
        memory.settle()
        return max(used, 0)

    def _blocks_from_device(self, memory: CudaMemory, utilization: float, step_limits: tuple[int, int, int],
                            snapshot: MemorySnapshot | None, graphs: bool = False) -> int:
        snapshot = snapshot or memory.snapshot()
        memory.settle()
        memory.reset_peak()
        weights = memory.allocated()
        scratch = self.profile_run(*step_limits)
        memory.settle()
        peak = memory.peak() - weights - scratch
        graph_bytes = self.profile_graphs(memory, step_limits[1], step_limits[2]) if graphs else 0
        growth = max(0, memory.snapshot().non_torch - snapshot.non_torch)
        self.kv_sizing = KVSizing(utilization, snapshot.total, snapshot.free, weights, peak, growth, graph_bytes)
        n = self.kv_sizing.num_blocks(layout_for(self.model_config, self.block_size).block_bytes)
        if self.comm is not None and self.comm.size > 1:  # one block table for every rank: the smallest cache
            n = self.comm.all_min(n)
        max_len = step_limits[2]
        log.info("KV cache from --gpu-memory-utilization %s: %d blocks of %d tokens, room for %.1f sequences of "
                 "max-model-len %d at once", self.kv_sizing, n, self.block_size, n * self.block_size / max_len,
                 max_len)
        return n

    def profile_run(self, num_tokens: int, max_num_seqs: int, max_model_len: int) -> int:
        """One step of the largest shape the scheduler may plan (engine/memory.py), on a
        scratch KV cache just big enough; returns the scratch cache's bytes."""
        if self._leading():
            self.tp.send(Profile((num_tokens, max_num_seqs, max_model_len)))
            with self._alone():
                return self.profile_run(num_tokens, max_num_seqs, max_model_len)
        plan, blocks = profile_plan(num_tokens, max_num_seqs, max_model_len, self.block_size)
        scratch = KVCache(self.model_config, CacheConfig(block_size=self.block_size, num_blocks=max(blocks, 2)),
                          self.device)
        kept, self.kv_cache = getattr(self, "kv_cache", None), scratch
        try:
            self.execute(plan)
        finally:
            self.kv_cache = kept
        return scratch.kv.numel() * scratch.kv.element_size()

    def execute(self, plan: StepPlan, on_layer_done: Callable[[int], None] | None = None) -> StepResult:
        """One step under inference mode. A caller already in it (an engine loop's thread,
        `LLM`) skips entering it again: the decorator's frames cost about 40 us a step on
        the cold cache a forward pass leaves behind (small, one token; docs/performance.md)."""
        if torch.is_inference_mode_enabled():
            return self._execute(plan, on_layer_done)
        with torch.inference_mode():
            return self._execute(plan, on_layer_done)

    def launch(self, plan: StepPlan, after: Launched | None = None) -> Launched:
        """Queue a step on the device and return without waiting for it: the forward pass
        and the sampling of every row. The caller checked the rows are `Sampler.deferrable`
        (LLMEngine._launchable; a step planned ahead inherits its rows' parameters). A decode whose
        input is `PENDING` reads the token that `after` (the step launched just before)
        samples for its sequence, on the device. On CPU, where operators run as they are
        called, the step has run when this returns; the tokens are still read by `collect`."""
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.launch(plan, after)
        t0 = time.perf_counter()
        if self.sized:
            self._size_team(plan.num_tokens)
        if self._leading():
            self._pin_ranks_thread()
            self._send_step(plan, after)
        b = self._prepare(plan, after)
        if len(b.logits_index) != len(b.sample_ids) or any(w.prompt_targets for w in plan.prefills):
            raise ValueError("a launched step samples one row per sequence: no drafts or prompt logprobs")
        hidden = self._forward(plan, b, None)
        greedy = Sampler.plain_greedy(b.sample_rows)
        sample = self.sampler.sample_on_device(self.model.compute_logits(hidden[b.logits_index], fp32=not greedy),
                                               b.sample_rows, greedy)
        host = ready = None
        if self.device.type == "cuda":
            host = []
            for t in sample.tensors():
                host.append(torch.empty(t.shape, dtype=t.dtype, pin_memory=True))
                host[-1].copy_(t, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return Launched(plan.num_tokens, b.sample_ids, b.sample_rows, sample, host, ready, t0)

    def collect(self, step: Launched) -> StepResult:
        """A launched step's tokens (and logprobs), once the device has them. `forward_s`
        counts from the later of its launch and the previous collect: the time the caller
        waited for it or spent launching it, not the time it overlapped with the step before."""
        self.wait(step)
        values = [t.tolist() for t in (step.host if step.host is not None else step.sample.tensors())]
        ids = values[0]
        lps = (Sampler.logprobs_of(step.sample.want, ids, *values[1:], step.rows) if step.sample.want
               else [None] * len(ids))
        now = time.perf_counter()
        forward_s = now - max(step.started, self._collected_at)
        self._collected_at = now
        return StepResult(dict(zip(step.sample_ids, ids)), dict(zip(step.sample_ids, lps)), forward_s,
                          step.num_tokens)

    @staticmethod
    def wait(step: Launched) -> None:
        """Return once the device has run `step` (at once on CPU)."""
        if step.ready is not None:
            step.ready.synchronize()

    def _forward(self, plan: StepPlan, b: _Batch, on_layer_done: Callable[[int], None] | None) -> torch.Tensor:
        if (self.graphs is not None and not plan.prefills and on_layer_done is None
                and plan.num_decode_rows == len(plan.decodes) and self.graphs.bucket(len(plan.decodes)) is not None):
            if self.before_layers is not None:
                self.before_layers()
            return self.graphs.run(b.input_ids, b.positions, b.meta)
        return self.model(b.input_ids, b.positions, self.kv_cache.layers, b.meta, self.backend, on_layer_done)

    @property
    def before_layers(self) -> Callable[[], None] | None:
        """Called on the engine thread once a forward pass, just before its layers (by the
        model; by the runner before a CUDA graph): the longest stretch of the step without
        the GIL. AsyncEngine hands the step before's events to its event loop there
        (worker_runtime/loop.py EngineLoop.hold_results). Kept on the model, so that a
        step sets nothing."""
        return self.model.before_layers

    @before_layers.setter
    def before_layers(self, hook: Callable[[], None] | None) -> None:
        self.model.before_layers = hook

    def rank_info(self) -> list[str]:
        """Rank 0: each rank's place, "rank R: DEVICE (pid P)", for operators (`tandem status`)."""
        devices = getattr(self, "tp_devices", None) or ()
        if self.tp is None or not devices:
            return []
        try:
            pids = [os.getpid(), *self.tp_ranks.pids()]
        except Exception:  # noqa: BLE001 - a rank that cannot say: its pid unknown
            pids = [os.getpid()] + [0] * (len(devices) - 1)
        return [f"rank {r}: {d.device if not d.cpu_affinity else 'cores ' + ','.join(map(str, d.cpu_affinity))}"
                f" (pid {pid})" for r, (d, pid) in enumerate(zip(devices, pids))]

    # ---- KV tiers (engine/kv_tiers.py decides, engine/kv_offload.py moves) ------------------
    kv_store = None  # this rank's KVTierStore, once opened

    def open_kv_tiers(self, num_slots: int, disk_dir: str | None) -> None:
        """Open this rank's host slots and disk directory (rank 0: every rank's)."""
        if self._leading():
            self.tp.call(_open_kv_tiers, num_slots, disk_dir)
        _open_kv_tiers(self, num_slots, disk_dir)

    def move_kv(self, moves: list[tuple]) -> None:
        """Run tier moves on every rank, before anything else touches those blocks (the
        next step, or a remote write into a reservation): sent ahead of the next step."""
        if self._leading():
            self.tp.send(Call(_move_kv, (moves,)))
        self.kv_store.apply(moves)

    def finished_kv_fetches(self) -> list[tuple[bytes, bool, float]]:
        """Rank 0: the disk fetches that ended since the last call, each (hash, ok, seconds):
        ok only where every rank read its own share of the block."""
        done = self.kv_store.completed() if self.kv_store is not None else []
        if done and self._leading():
            keys = [k for k, _, _ in done]
            for oks in self.tp.call(_kv_fetch_outcome, keys):
                done = [(k, ok and other, s) for (k, ok, s), other in zip(done, oks)]
        return done

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel worker (rank 0); nothing otherwise."""
        store, self.kv_store = self.kv_store, None
        if store is not None:
            store.close()
        tp, self.tp = self.tp, None
        if tp is not None:
            tp.close()
        ranks, self.tp_ranks = self.tp_ranks, None
        if ranks is not None:
            ranks.stop()

    def _leading(self) -> bool:
        """Rank 0 of a tensor-parallel worker whose steps the other ranks follow now."""
        return self.tp is not None and self.tp.leader and not self._solo

    _solo = False  # inside `_alone`: the other ranks run the same call themselves

    @contextlib.contextmanager
    def _alone(self):
        saved, self._solo = self._solo, True
        try:
            yield
        finally:
            self._solo = saved

    def _send_step(self, plan: StepPlan, after: Launched | None = None, writes=None) -> None:
        msg = Step(plan_for_ranks(plan), writes=writes)
        if after is not None and any(w.token_ids[0] == PENDING for w in plan.decodes):
            if self.device.type == "cuda":  # the tokens stay on the device: a broadcast right after this message
                msg.after_rows = list(after.sample_ids)
            else:
                msg.after_tokens = dict(zip(after.sample_ids, after.sample.tokens.tolist()))
        self.tp.send(msg)
        if msg.after_rows is not None:
            self.comm.broadcast(after.sample.tokens.to(torch.int64).contiguous(), 0)

    def follow(self) -> None:
        """A rank other than 0: run rank 0's steps on this shard until it stops or goes.
        Under inference mode for its whole life, as an engine thread."""
        try:
            self._follow()
        finally:
            for part in self.rank_parts.values():  # e.g. this rank's KV transport (worker_runtime/tp_kv.py)
                part.close()

    def _follow(self) -> None:
        with torch.inference_mode():
            while True:
                msg = self.tp.recv()
                if msg is None or isinstance(msg, Stop):
                    return
                if isinstance(msg, Step):
                    self._follow_step(msg)
                elif isinstance(msg, Profile):
                    self.profile_run(*msg.args)
                elif isinstance(msg, Call):
                    if not msg.reply:
                        msg.fn(self, *msg.args)
                        continue
                    try:
                        reply = Reply(self.tp.rank, msg.fn(self, *msg.args))
                    except Exception as e:  # noqa: BLE001 - rank 0 raises it
                        log.exception("rank %d: %s failed", self.tp.rank, getattr(msg.fn, "__name__", msg.fn))
                        reply = Reply(self.tp.rank, error=f"{type(e).__name__}: {e}")
                    self.tp.send_up(reply)
                else:
                    raise TypeError(f"unexpected message from rank 0: {msg!r}")

    def _pin_ranks_thread(self) -> None:
        """Tensor parallel: the thread running this rank's steps stays on the rank's own
        cores, even with one thread (an OpenMP team binds itself only when it has two or
        more). Ranks wait for each other at every all-reduce, spinning first: a rank 0
        left to float shared rank 1's core with it, and each all-reduce then waited out a
        time slice (1.7 ms a call on the 2-core Xeon, against microseconds pinned)."""
        me = threading.get_native_id()
        if self._pinned == me or not self.own_cores:
            return
        self._pinned = me
        try:
            os.sched_setaffinity(me, set(self.own_cores))
        except OSError as e:
            log.warning("could not pin the step thread to cores %s: %s", list(self.own_cores), e)

    _pinned = 0

    def _follow_step(self, msg) -> None:
        plan = msg.plan
        self._pin_ranks_thread()
        if self.sized:
            self._size_team(plan.num_tokens)
        after = None
        if msg.after_tokens is not None or msg.after_rows is not None:
            rows = list(msg.after_tokens) if msg.after_tokens is not None else msg.after_rows
            if msg.after_tokens is not None:
                tokens = torch.tensor(list(msg.after_tokens.values()), dtype=torch.int64, device=self.device)
            else:
                tokens = self.comm.broadcast(torch.empty(len(rows), dtype=torch.int64, device=self.device), 0)
            after = _Followed(rows, tokens)
        b = self._prepare(plan, after)
        hook = None if msg.writes is None else msg.writes.hook(self)
        hidden = self._forward(plan, b, hook)
        if self.model.vocab_comm is not None:  # rank 0 gathers the logits of every head shard, in this order
            if any(w.prompt_targets for w in plan.prefills):
                self._prompt_logprobs(plan, hidden)
            if b.sample_ids:
                self.model.compute_logits(hidden[b.logits_index])

    def _execute(self, plan: StepPlan, on_layer_done: Callable[[int], None] | None) -> StepResult:
        t0 = time.perf_counter()
        if self.sized:
            self._size_team(plan.num_tokens)
        if self._leading():
            self._pin_ranks_thread()
            self._send_step(plan, writes=getattr(on_layer_done, "rank_writes", None))
        b = self._prepare(plan)
        hidden = self._forward(plan, b, on_layer_done)
        prompt_lps = self._prompt_logprobs(plan, hidden) if any(w.prompt_targets for w in plan.prefills) else {}
        if not b.sample_ids:
            return StepResult({}, {}, time.perf_counter() - t0, plan.num_tokens, prompt_lps)
        plain = len(b.logits_index) == len(b.sample_ids)  # no speculative rows to verify
        greedy = plain and Sampler.plain_greedy(b.sample_rows)  # the head's own dtype will do
        logits = self.model.compute_logits(hidden[b.logits_index], fp32=not greedy)
        if logits is None:  # a rank other than 0 of a vocab-parallel head (profile_run): no sampling here
            return StepResult({}, {}, time.perf_counter() - t0, plan.num_tokens, prompt_lps)
        if plain:
            out: SamplerOutput = self.sampler(logits, b.sample_rows)
            return StepResult(
                dict(zip(b.sample_ids, out.token_ids)),
                dict(zip(b.sample_ids, out.logprobs)),
                time.perf_counter() - t0,
                plan.num_tokens,
                prompt_lps,
            )
        v = self.sampler.verify(logits, b.sample_rows)  # speculative decodes in the step
        return StepResult(
            {sid: toks[-1] for sid, toks in zip(b.sample_ids, v.token_ids)},
            {sid: lps[-1] for sid, lps in zip(b.sample_ids, v.logprobs)},
            time.perf_counter() - t0,
            plan.num_tokens,
            prompt_lps,
            accepted={sid: toks[:-1] for sid, toks, row in zip(b.sample_ids, v.token_ids, b.sample_rows) if row.draft},
            accepted_logprobs={sid: lps[:-1] for sid, lps, row in zip(b.sample_ids, v.logprobs, b.sample_rows)
                               if row.draft},
        )

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor) -> dict:
        """Each asked-for prompt token's logprob given the tokens before it, its rank and the
        top-k, from this chunk's hidden states (one log-softmax per chunk)."""
        out: dict = {}
        offset = len(plan.decodes)
        for w in plan.prefills:
            k = w.prompt_topk
            for s in range(0, len(w.prompt_targets), _PROMPT_LOGPROB_ROWS):  # bounded [rows, vocab] floats
                targets = list(w.prompt_targets[s: s + _PROMPT_LOGPROB_ROWS])
                rows = hidden[offset + s: offset + s + len(targets)]
                logits = self.model.compute_logits(rows)
                if logits is None:  # a rank other than 0 of a vocab-parallel head: its share only
                    continue
                lp = logits.float().log_softmax(dim=-1)
                chosen = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])
                rank = (lp > chosen).sum(dim=-1) + 1
                top_v, top_i = lp.topk(max(k, 1), dim=-1)
                out.setdefault(w.seq_id, []).extend(
                    TokenLogprobs(t, c, list(zip(ti[:k], tv[:k])), r) for t, c, r, ti, tv in zip(
                        targets, chosen[:, 0].tolist(), rank.tolist(), top_i.tolist(), top_v.tolist()))
            offset += len(w.token_ids)
        return out

    def compute_marker(self):
        """Something a KV transport can poll (`query()`) to know that the kernels launched
        so far have run: a CUDA event recorded now on the current stream. None on CPU,
        where a layer's KV is in memory when its call returns."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _size_team(self, num_tokens: int) -> None:
        """This step's OpenMP team: the worker's own cores plus the idle ones it may
        borrow, one thread bound to each; one thread for a small step (`serial_step_work`).
        Costs a few microseconds; rebinding (a parallel region) only when the cores change."""
        cores = self.bind_cores
        threads = self.max_threads
        if self.ledger is not None:
            self.ledger.busy()
            lent = self.ledger.borrowable() if self.borrowing else ()
            if lent:
                cores = [*self.own_cores, *lent]
                threads = len(cores)
                self.lent_steps += 1
        if self.serial_step_work and threads > 1 and num_tokens * self.weight_params <= self.serial_step_work:
            threads = 1
        if cores is not None and threads > 1:
            team = tuple(cores[:threads])
            me = threading.get_ident()
            if self.bound is None or self.bound[0] != me or self.bound[1][:threads] != team:
                self._bind_threads(me, team)
        if self.helpers is not None:
            self.helpers.use(threads - 1)
        torch.set_num_threads(threads)  # ~0.2 us

    @contextlib.contextmanager
    def own_cores_only(self):
        """Steps inside run on the worker's own cores, borrowing none: for a timing that
        must say what the worker can do by itself (a prefill worker's start-up rate, which
        the router divides its backlog by)."""
        saved, self.borrowing = self.borrowing, False
        try:
            yield
        finally:
            self.borrowing = saved

    def mark_idle(self) -> None:
        """The engine has no work: its cores may be lent (engine/cores.py) and its OpenMP
        helpers wait at SCHED_IDLE. On the engine thread, between steps. Rank 0 of a
        tensor-parallel worker also looks for a rank that is gone, and raises RankLost
        (the engine then fails as on any step error: the worker is replaced)."""
        if self.tp is not None and self.tp.leader and (lost := self.tp.check()) is not None:
            raise RankLost(lost)
        if self.ledger is not None:
            self.ledger.idle()
        if self.helpers is not None:
            self.helpers.use(0)

    def _bind_threads(self, me: int, team: tuple[int, ...]) -> None:
        self.bound = (me, team)
        ops = build.load_or_none()
        if ops is None:  # threads left floating
            return
        torch.set_num_threads(len(team))
        got = ops.bind_threads(list(team))
        if self.helpers is not None:
            self.helpers.rebound(list(ops.team_tids())[1:])
        log.log(logging.INFO if self.ledger is None else logging.DEBUG,
                "step threads bound to cores %s (each now on %s)", list(team), got)

    def _prepare(self, plan: StepPlan, after: Launched | None = None) -> _Batch:
        """Every tensor of the step, built here and nowhere else. `after`: the launched
        step whose sampled tokens are the inputs marked `PENDING`."""
        bs = self.block_size
        ids: list[int] = []
        pending_rows: list[int] = []  # rows of `ids` whose token is `after`'s, and where in `after` it is
        pending_from: list[int] = []
        after_rows = after.row_of() if after is not None else None
        positions: list[int] = []  # with LongRoPE, rows of the rotary tables (ModelConfig.rope_row)
        rope_row = self._rope_row
        slots: list[int] = []
        logits_index: list[int] = []
        sample_ids: list[object] = []
        rows: list[SampleRow] = []
        decode_lens: list[int] = []
        dec_tables: list[Sequence[int]] = []
        offset = 0  # rows so far; a work's sampled rows end at its last
        for w in plan.decodes:
            # a speculative decode is 1 + len(draft) decode rows, row i at position p + i
            # attending to p + i + 1 tokens: the step stores every row's K/V before any
            # attention reads, so each row sees the draft tokens before it (causal)
            sample = w.sample
            draft = sample.draft if sample is not None else ()
            p = w.start_pos
            table = w.block_table
            token = w.token_ids[0]
            if token == PENDING:
                if after_rows is None or w.seq_id not in after_rows:
                    raise ValueError(f"{w.seq_id}: its input is the previous step's token, and that step did not "
                                     f"sample for it")
                pending_rows.append(len(ids))
                pending_from.append(after_rows[w.seq_id])
                token = 0
            ids.append(token)
            if not draft:
                positions.append(p if rope_row is None else rope_row(p, w.long_rope))
                slots.append(table[p // bs] * bs + p % bs)
                decode_lens.append(p + 1)
                dec_tables.append(table)
                offset += 1
                if sample is not None:
                    logits_index.append(offset - 1)
                    sample_ids.append(w.seq_id)
                    rows.append(sample)
                continue
            ids.extend(draft)
            for q in range(p, p + 1 + len(draft)):
                positions.append(q if rope_row is None else rope_row(q, w.long_rope))
                slots.append(table[q // bs] * bs + q % bs)
                decode_lens.append(q + 1)
                dec_tables.append(table)
            offset += 1 + len(draft)
            logits_index.extend(range(offset - 1 - len(draft), offset))
            sample_ids.append(w.seq_id)
            rows.append(sample)
        for w in plan.prefills:
            ids.extend(w.token_ids)
            rng = range(w.start_pos, w.start_pos + len(w.token_ids))
            positions.extend(rng if rope_row is None else (rope_row(p, w.long_rope) for p in rng))
            table = w.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in rng)
            sample = w.sample
            offset += len(w.token_ids) + (len(sample.draft) if sample is not None else 0)
            if sample is not None:
                logits_index.extend(range(offset - 1 - len(sample.draft), offset))
                sample_ids.append(w.seq_id)
                rows.append(sample)
        q_lens = [len(w.token_ids) for w in plan.prefills]
        p_lens = [w.start_pos + len(w.token_ids) for w in plan.prefills]
        starts = None
        if self.backend.prefill_tensors and plan.prefills:
            starts = [0]
            for n in q_lens:
                starts.append(starts[-1] + n)
        kept_rows, kept_tables, kept_lens = self._kept_rows(plan, dec_tables, decode_lens, p_lens)
        if kept_rows is not None:  # the head then reads the last layer's K rows, not the step's T
            at = {r: i for i, r in enumerate(kept_rows)}
            logits_index = [at[r] for r in logits_index]
        dec_flat, dec_width = _table_rows(dec_tables)
        pre_flat, pre_width = _table_rows([w.block_table for w in plan.prefills])
        kept_flat, kept_width = _table_rows(kept_tables) if kept_tables is not None else (None, 0)
        pending = (pending_rows, pending_from) if pending_rows else (None, None)
        (input_ids, pos_t, slot_t, logits_t, kept_t, dst_t, src_t), (dec_t, dec_lens_t, pre_t, starts_t, p_lens_t,
                                                                      kept_tables_t, kept_lens_t) = self._to_device(
            [ids, positions, slots, logits_index, kept_rows, *pending],
            [dec_flat, decode_lens, pre_flat, starts, p_lens if starts is not None else None, kept_flat,
             kept_lens],
        )
        if dst_t is not None:  # queued behind `after`'s sampling on the same stream
            input_ids.index_copy_(0, dst_t, after.sample.tokens.index_select(0, src_t))
        meta = AttentionMetadata(
            slot_mapping=slot_t,
            num_decode_tokens=len(decode_lens),
            decode_block_tables=dec_t.view(len(dec_tables), dec_width),
            decode_seq_lens=dec_lens_t,
            decode_max_seq_len=max(decode_lens, default=0),
            prefill_block_tables=pre_t.view(len(plan.prefills), pre_width),
            prefill_query_lens=q_lens,
            prefill_seq_lens=p_lens,
            prefill_query_start_loc=starts_t,
            prefill_seq_lens_tensor=p_lens_t,
            kept=None if kept_rows is None else KeptRows(
                rows=kept_t,
                block_tables=kept_tables_t.view(len(kept_tables), kept_width),
                seq_lens=kept_lens_t,
                max_seq_len=max(kept_lens, default=0),
            ),
        )
        if self.num_kv_groups > 1:
            meta.groups = self._group_metas(plan, meta, kept_tables is not None)
        return _Batch(
            input_ids=input_ids,
            positions=pos_t,
            meta=meta,
            logits_index=logits_t,
            sample_ids=sample_ids,
            sample_rows=rows,
        )

    def _group_metas(self, plan: StepPlan, meta: AttentionMetadata, kept: bool) -> tuple[AttentionMetadata, ...]:
        """`meta` for each KV group (engine/kv_groups.py): the same rows, each group's own
        slots and block tables (SeqWork.group_tables; a work without them, such as the
        memory profile's, uses its first table)."""
        bs = self.block_size
        out = [meta]
        for g in range(self.num_kv_groups - 1):
            slots: list[int] = []
            dec: list[Sequence[int]] = []
            pre: list[Sequence[int]] = []
            for w in plan.decodes:
                table = w.group_tables[g] if w.group_tables else w.block_table
                draft = w.sample.draft if w.sample is not None else ()
                for q in range(w.start_pos, w.start_pos + 1 + len(draft)):
                    slots.append(table[q // bs] * bs + q % bs)
                    dec.append(table)
            for w in plan.prefills:
                table = w.group_tables[g] if w.group_tables else w.block_table
                slots.extend(table[p // bs] * bs + p % bs for p in range(w.start_pos, w.start_pos + len(w.token_ids)))
                pre.append(table)
            kept_tables = [*dec, *(t for w, t in zip(plan.prefills, pre) if w.sample is not None)] if kept else None
            dec_flat, dec_width = _table_rows(dec)
            pre_flat, pre_width = _table_rows(pre)
            kept_flat, kept_width = _table_rows(kept_tables) if kept else (None, 0)
            (slot_t,), (dec_t, pre_t, kept_t) = self._to_device([slots], [dec_flat, pre_flat, kept_flat])
            out.append(dataclasses.replace(
                meta, slot_mapping=slot_t, decode_block_tables=dec_t.view(len(dec), dec_width),
                prefill_block_tables=pre_t.view(len(pre), pre_width), groups=None,
                kept=None if meta.kept is None else dataclasses.replace(
                    meta.kept, block_tables=kept_t.view(len(kept_tables), kept_width))))
        return tuple(out)

    def _kept_rows(self, plan: StepPlan, dec_tables: list, decode_lens: list[int], p_lens: list[int]):
        """(rows, block tables, lengths) of the rows the last layer must compute in full
        (engine/attention KeptRows): every decode row, and the last row of each prefill
        chunk that samples. (None, None, None) where all rows are needed or nothing is
        saved: prompt logprobs read every prompt row's hidden state, a prefill with draft
        rows has more than its last row sampled, and a step of decodes alone keeps all
        its rows."""
        if not plan.prefills or not self.kept_rows or any(
                w.prompt_targets or (w.sample is not None and w.sample.draft) for w in plan.prefills):
            return None, None, None
        nd = len(decode_lens)
        rows, tables, lens = list(range(nd)), list(dec_tables), list(decode_lens)
        offset = nd
        for w, n in zip(plan.prefills, p_lens):
            offset += len(w.token_ids)
            if w.sample is not None:
                rows.append(offset - 1)
                tables.append(w.block_table)
                lens.append(n)
        return rows, tables, lens

    def _to_device(self, int64s: list, int32s: list):
        """Lists of ints (any may be None; an int32 one may be an `array('i')`, such as
        `_table_rows`' block tables) as tensors on the device, in the order given, one
        dimension each. On CPU each is a tensor over an array of its own (one C loop per
        list, where torch.tensor converts int by int). On CUDA the int64 ones go in one
        pinned host buffer and the int32 ones in another, each sent with one non-blocking
        copy (a copy from pageable memory would wait for the GPU to finish the step
        before) and cut into views on the device (`_packed`)."""
        if self.device.type != "cuda":
            return [_host_ints(x, "q") for x in int64s], [_host_ints(x, "i") for x in int32s]
        return _packed(int64s, "q", self.device, pin=True), _packed(int32s, "i", self.device, pin=True)


@dataclass
class _Followed:
    """What a rank other than 0 knows of the step launched before (asynchronous
    scheduling): the tokens it sampled, by sequence, in `sample.tokens`."""

    sample_ids: list
    tokens: torch.Tensor

    @property
    def sample(self):
        return self

    def row_of(self) -> dict[object, int]:
        return {sid: i for i, sid in enumerate(self.sample_ids)}


def _open_kv_tiers(runner: ModelRunner, num_slots: int, disk_dir: str | None) -> None:
    from engine.kv_offload import KVTierStore

    rank = runner.tp.rank if runner.tp is not None else 0
    runner.kv_store = KVTierStore(runner.kv_cache.kv, num_slots, disk_dir, rank)
    if rank:
        runner.rank_parts["kv_store"] = runner.kv_store  # closed when the rank exits


def _move_kv(runner: ModelRunner, moves: list[tuple]) -> None:
    runner.kv_store.apply(moves)


def _kv_fetch_outcome(runner: ModelRunner, keys: list[bytes]) -> list[bool]:
    return runner.kv_store.outcome(keys)


def fused_cpu_ops():
    """The compiled CPU kernels for the model's fused operators, or None (torch operators):
    when TANDEM_CPU_FUSED_OPS=0 or the kernels cannot be built here."""
    return build.load_or_none() if envs.cpu_fused_ops() else None


_INT_DTYPES = {"q": torch.int64, "i": torch.int32}


def _host_ints(x, code: str) -> torch.Tensor | None:
    """A host tensor of the ints in `x` (None stays None), over an array of its own."""
    if x is None:
        return None
    a = x if isinstance(x, array) and x.typecode == code else array(code, x)
    return torch.frombuffer(a, dtype=_INT_DTYPES[code]) if a else torch.empty(0, dtype=_INT_DTYPES[code])


def _packed(parts: list, code: str, device: torch.device, pin: bool) -> list:
    """`parts` (lists or arrays of ints, or None) laid out in one host buffer of
    `array(code)`'s type, sent to `device` in one copy (non-blocking: from pinned memory
    when `pin`), and cut there into one view per part (None stays None). Each view
    starts on a 16-byte boundary, as a tensor of its own would: Triton specializes its
    kernels on the alignment of their pointer arguments."""
    flat = array(code)
    align = 16 // flat.itemsize
    starts: list[int | None] = []
    for x in parts:
        if x is None:
            starts.append(None)
            continue
        if len(flat) % align:
            flat.frombytes(bytes(flat.itemsize * (align - len(flat) % align)))
        starts.append(len(flat))
        flat.extend(x)
    dtype = _INT_DTYPES[code]
    host = torch.frombuffer(flat, dtype=dtype) if flat else torch.empty(0, dtype=dtype)
    dev = (host.pin_memory() if pin else host).to(device, non_blocking=True)
    return [None if at is None else dev[at : at + len(x)] for at, x in zip(starts, parts)]


def _table_rows(tables: Sequence[Sequence[int]]) -> tuple[array, int]:
    """Block tables row after row in one int32 buffer, each padded with block 0 to the
    longest (padding is masked by sequence length), and that width. The scheduler's
    tables are `array('i')`s (engine/kv_cache_manager.py), so a row is one memcpy."""
    width = max(map(len, tables), default=0)
    flat = array("i")
    pad = array("i", bytes(4 * width))
    for t in tables:
        flat.extend(t)
        if len(t) < width:
            flat.extend(pad[: width - len(t)])
    return flat, width
