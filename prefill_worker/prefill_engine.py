"""PrefillEngine: batched, chunked prefill that pushes each prompt's KV into a decode
worker's reserved blocks. Runs on an EngineLoop thread; every method here is called
on that thread.

One step: poll in-flight writes -> schedule a token budget of prompt chunks ->
forward (with layer-wise push: as layer i of a finishing prompt lands in the cache,
its blocks are written; the last layer goes after sampling, carrying the KVLanded
notification with the first token) -> start the writes of prompts that finished.

Each handoff is a ledger entry (RESERVED -> WRITING -> READY -> DONE | FAILED |
EXPIRED) keyed to the decode worker's incarnation; freeing the entry ends the
sequence's handoff, which releases its blocks into the prefix cache.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from engine.events import TokenLogprobs
from engine.kv_offload import tier_driver
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence
from engine.structured import StructuredOutputs, attach_grammar
from kv_transfer.base import PeerId, TransferError, TransferHandle, Transport, XferState
from kv_transfer.ledger import Entry, Ledger
from protos.handoff import gave_up_message, landed_message, shard_message
from worker_runtime import envs
from worker_runtime.stats import RateMeter
from worker_runtime.tp_kv import Pair, WorkerKV, layer_writes

log = logging.getLogger(__name__)


class PrefillFailed(RuntimeError):
    """The prefill or its KV transfer failed; the message says which and why."""


@dataclass
class PrefillResult:
    first_token: int
    logprobs: TokenLogprobs | None
    num_cached_tokens: int
    num_blocks: int
    num_bytes: int
    queue_s: float
    prefill_s: float
    transfer_s: float


@dataclass
class PrefillJob:
    seq: Sequence
    peer: PeerId
    target_blocks: list[int]
    skip_blocks: int  # leading blocks the decode worker already has cached
    future: cf.Future
    arrival: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None
    computed_at: float | None = None
    handles: dict[int, list[TransferHandle]] = field(default_factory=dict)  # by decode rank: layer writes so far
    finals: list[TransferHandle] = field(default_factory=list)  # the last write to each decode rank
    logprobs: TokenLogprobs | None = None
    refused: str | None = None  # why the transport refused one of its writes (the request fails)


ENDED_KEPT = 4096  # ended jobs' ids kept: an abort arrives within moments of its job's end


class PrefillEngine:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        transport: Transport,
        eos_ids: frozenset[int],
        layerwise: bool = True,
        transfer_timeout_s: float = 15.0,
        structured: StructuredOutputs | None = None,
        kv: WorkerKV | None = None,
    ) -> None:
        """`kv`: this worker's ranks' transports and its decode peers by rank
        (worker_runtime/tp_kv.py); default: `transport` alone, peers of one rank."""
        self.runner = runner
        self.kv = kv or WorkerKV(transport, runner.model_config.num_kv_heads)
        self.structured = structured
        self.scheduler = scheduler
        self.transport = transport
        self.eos_ids = eos_ids
        # KV groups (engine/kv_groups.py): a block table per group; a layer's KV is one slot
        # of its group's blocks (`places`: each layer's group and slot; None: one group)
        groups = runner.model_config.kv_groups
        self.num_groups = len(groups)
        self.layerwise = layerwise
        self.num_layers = runner.model_config.num_layers
        self.places = [groups.place(n) for n in range(self.num_layers)] if groups.hybrid else None
        self.block_bytes = runner.kv_cache.layout.block_bytes
        self.jobs: dict[str, PrefillJob] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()  # ids of the last ENDED_KEPT jobs that ended
        # a handoff's lease in WRITING is the transfer timeout (worker_runtime/config.py)
        self.ledger = Ledger(self._on_free, default_lease_s=transfer_timeout_s, exclusive_blocks=False)
        self.metrics = None  # optional worker_runtime.metrics.WorkerMetrics
        self.faults = envs.faults()
        self.rate = RateMeter()  # prompt tokens per second of forward time (WorkerStats)
        self.tiers = tier_driver(runner, scheduler.cache)  # KV tiers below the device, or None

    # ---- requests (engine thread) ---------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int,
        peer: PeerId,
        target_blocks: list[int],
        num_cached_tokens: int,
        grammar=None,
    ) -> cf.Future:
        if request_id in self.jobs:
            raise ValueError(f"request id {request_id!r} is already in use")
        bs = self.scheduler.bs
        n_blocks = math.ceil(len(prompt_ids) / bs) * self.num_groups  # with KV groups, each group's table in turn
        if len(target_blocks) != n_blocks:
            raise ValueError(
                f"target has {len(target_blocks)} blocks; a {len(prompt_ids)}-token prompt needs {n_blocks}"
            )
        if num_cached_tokens % bs or not 0 <= num_cached_tokens < len(prompt_ids):
            raise ValueError(f"num_cached_tokens={num_cached_tokens} must be a multiple of {bs} below the prompt's "
                             f"{len(prompt_ids)} tokens (at least one block is written)")
        # original params: the first token is sampled exactly as a single process would
        # (seed index 0, EOS banned under min_tokens); the scheduler (hand_off) ends it after one token
        seq = Sequence(request_id, list(prompt_ids), params, self.eos_ids, priority)
        attach_grammar(self.structured, seq, grammar)  # the first token is masked as the decode side would
        self.scheduler.add(seq)
        job = PrefillJob(seq, peer, list(target_blocks), num_cached_tokens // bs, cf.Future())
        self.jobs[request_id] = job
        return job.future

    def abort(self, request_id: str, reason: str = "aborted", peer: PeerId | None = None) -> bool:
        """End `request_id`'s job. `peer`: the decode worker its RPC named; when no job of
        that id was ever submitted here (the handler was cancelled while its submit waited
        for the engine thread, which then skipped it), that worker is told nothing comes."""
        job = self.jobs.get(request_id)
        if job is None:
            if peer is not None and request_id not in self._ended:
                self._tell_nothing_comes(peer, request_id, reason)
            return False
        if request_id in self.ledger:
            self.ledger.fail(request_id, reason)  # frees via _on_free
        else:
            self.scheduler.abort(request_id)
            self._resolve(job, PrefillFailed(reason))
            if not any(job.handles.values()) and not job.finals:
                self._tell_nothing_comes(job.peer, request_id, reason)
        return True

    def _tell_nothing_comes(self, peer: PeerId, request_id: str, reason: str) -> None:
        """A prefill that ends before posting any write tells its decode worker so: the
        reservation there, quarantined once the router cancels it, would otherwise hold
        its blocks until the quarantine ends (30 s by default), since the decode worker
        cannot know that no late write will land. Never for a job that posted a write: its
        bytes may still land after it is released (Transport.release), and then the
        quarantine is what keeps those blocks from being reused."""
        try:
            self.transport.notify(peer, gave_up_message(request_id, reason))
        except TransferError as e:  # e.g. the transport is closing: the quarantine still ends it
            log.info("prefill of %s: could not tell the decode worker it was dropped: %s", request_id, e)

    def drop_peer(self, peer: PeerId, reason: str) -> None:
        """A decode worker went away (or restarted): fail every handoff to it."""
        self.ledger.drop_peer(peer, reason)
        for job in [j for j in self.jobs.values() if j.peer == peer]:
            self.abort(job.seq.seq_id, reason)

    def measure_rate(self, max_model_len: int, num_tokens: int = 512) -> None:
        """Engine thread, at start: time a prefill step of one `num_tokens` prompt on a
        scratch cache, twice (the first warms the kernels), and seed `rate` with the second.
        Both on the worker's own cores: at start the other workers of a shared host are
        idle, and a step that borrowed their cores read up to twice the rate the worker has
        once they are busy, so the router's spill and lease rules sent it prompts it could
        not finish within the lease (docs/performance.md, twenty-fourth round)."""
        n = max(1, min(num_tokens, self.scheduler.config.max_num_batched_tokens, max_model_len))
        with self.runner.own_cores_only():
            self.runner.profile_run(n, 1, n)
            t0 = time.perf_counter()
            self.runner.profile_run(n, 1, n)
            self.rate.add(n, time.perf_counter() - t0)

    # ---- one iteration (engine thread) ----------------------------------------------
    def step(self) -> list:
        self._poll_transfers()
        tiers = self.tiers
        if tiers is not None:
            tiers.poll()
        out = self.scheduler.schedule()
        if tiers is not None:
            tiers.move(idle=not out.plan)
        if not out.plan:
            return []
        if self.faults.prefill_step_delay_s:
            time.sleep(self.faults.prefill_step_delay_s)
        now = time.monotonic()
        finishing = [self.jobs[w.seq_id] for w in out.plan.works() if w.sample is not None]
        for seq, _ in out.scheduled:
            job = self.jobs[seq.seq_id]
            job.scheduled_at = job.scheduled_at or now
        hook = self._layer_hook(finishing) if finishing and (self.layerwise or self.kv.size > 1) else None
        result = self.runner.execute(out.plan, on_layer_done=hook)
        self.rate.add(result.num_tokens, result.forward_s)
        if tiers is not None:
            tiers.index.cost.observe_prefill(result.num_tokens, result.forward_s)
        if self.metrics is not None:
            self.metrics.on_step(result.num_tokens, result.forward_s)
        self.scheduler.update(out, result.token_ids)
        for job in finishing:
            job.logprobs = result.logprobs.get(job.seq.seq_id)
            self._start_final_write(job)
        return []

    def _layer_hook(self, jobs: list[PrefillJob]):
        """What runs as each layer's KV is in this rank's cache: this rank's layer writes.
        Under tensor parallelism it also carries (`rank_writes`) what the other ranks
        write of the same jobs, which the step sends them (engine/runner.py)."""
        pairs = {job.seq.seq_id: self._block_pairs(job) for job in jobs}

        def on_layer_done(layer: int) -> None:
            if layer == self.num_layers - 1 or not self.layerwise:
                return  # the last layer goes with the notification, after sampling
            ready = self.runner.compute_marker()  # the layer's kernels may still be queued (CUDA)
            for job in jobs:
                local, remote = pairs[job.seq.seq_id]
                if not local:
                    continue
                [(ours, theirs, layers)] = layer_writes(local, remote, self.places, layer, caught_up=True)
                for p in self.kv.group_of(job.peer).mine(0):
                    handle = self._write(job, p, ours, theirs, layers=layers, ready=ready)
                    if handle is not None:
                        job.handles.setdefault(p.dst, []).append(handle)

        on_layer_done.rank_writes = self.kv.rank_writes(
            [(job.seq.seq_id, job.peer, *pairs[job.seq.seq_id]) for job in jobs if pairs[job.seq.seq_id][0]],
            self.layerwise, self.num_layers, self.places)
        return on_layer_done

    def _block_pairs(self, job: PrefillJob) -> tuple[list[int], list[int]]:
        """(our blocks, the decode worker's) past the blocks it has cached; with KV groups,
        group after group (the target holds each group's table in turn, all as long)."""
        n = len(job.target_blocks) // self.num_groups
        skip = job.skip_blocks
        local: list[int] = []
        remote: list[int] = []
        for g, table in enumerate(self.scheduler.cache.block_tables(job.seq.seq_id)):
            local.extend(table[skip:n].tolist())
            remote.extend(job.target_blocks[g * n + skip:(g + 1) * n])
        return local, remote

    def _start_final_write(self, job: PrefillJob) -> None:
        seq = job.seq
        job.computed_at = time.monotonic()
        first = seq.output_ids[0]
        local, remote = self._block_pairs(job)
        self.ledger.reserve(seq.seq_id, self.scheduler.cache.block_table(seq.seq_id), peer=job.peer)
        self.ledger.start_writing(seq.seq_id)
        group = self.kv.group_of(job.peer)
        ready = self.runner.compute_marker()
        for p in group.mine(0):
            earlier = job.handles.get(p.dst, [])
            ours, theirs, layers = local, remote, None  # every layer, or the last alone after the others
            if self.layerwise and earlier:
                [(ours, theirs, layers)] = layer_writes(local, remote, self.places, self.num_layers - 1, True)
            note = (landed_message(seq.seq_id, first, job.logprobs, shards=group.shards) if p.dst == 0
                    else shard_message(seq.seq_id))
            final = self._write(job, p, ours, theirs, layers=layers, after=earlier, notify=note, ready=ready)
            if final is not None:
                job.finals.append(final)
        if job.refused is not None:  # a bad target (the transport checks it): this request fails, not the engine
            log.warning("prefill of %s: the KV write was refused: %s", seq.seq_id, job.refused)
            self.ledger.fail(seq.seq_id, f"the KV write to the decode worker was refused: {job.refused}")

    def _write(self, job: PrefillJob, pair: Pair, local: list[int], remote: list[int], **kw) -> TransferHandle | None:
        """One of `job`'s KV writes, to the decode rank of `pair`; None once the transport
        has refused one (`job.refused` says why: the request fails when computed, the step
        goes on)."""
        if job.refused is not None:
            return None
        try:
            peer = self.kv.group_of(job.peer).rank_peers[pair.dst]
            return self.transport.write_blocks(peer, local, remote, heads=pair.heads, **kw)
        except TransferError as e:
            job.refused = str(e)
            return None

    def _poll_transfers(self) -> None:
        self.ledger.sweep()
        for rid, job in list(self.jobs.items()):
            if not job.finals:
                continue
            states = [self.transport.poll(h) for h in job.finals]
            failed = next((s for s in states if s.finished and s.state is not XferState.DONE), None)
            if failed is not None:
                self.ledger.fail(rid, f"KV transfer to the decode worker failed: {failed.reason}")
                continue
            if not all(s.finished for s in states):
                continue
            others, reason = self.kv.shards_done(rid, job.peer)  # the other ranks' writes (tensor parallel)
            if reason is not None:
                self.ledger.fail(rid, f"KV transfer to the decode worker failed: {reason}")
            elif others:
                self.ledger.mark_ready(rid)
                self.ledger.finish(rid)

    # ---- endings ------------------------------------------------------------------
    def _on_free(self, entry: Entry) -> None:
        job = self.jobs.get(entry.request_id)
        self.scheduler.end_handoff(entry.request_id, FinishReason.LENGTH if entry.reason == "" else FinishReason.ERROR)
        if job is None:
            return
        self.kv.forget(entry.request_id)
        for h in [*(h for hs in job.handles.values() for h in hs), *job.finals]:
            self.transport.release(h)
        if entry.state.name == "DONE":
            self._resolve(job, self._result(job))
        else:
            self._resolve(job, PrefillFailed(entry.reason or entry.state.name.lower()))

    def _result(self, job: PrefillJob) -> PrefillResult:
        now = time.monotonic()
        n_blocks = len(job.target_blocks) - job.skip_blocks * self.num_groups
        scheduled = job.scheduled_at or job.arrival
        computed = job.computed_at or now
        return PrefillResult(
            job.seq.output_ids[0],
            job.logprobs,
            job.seq.num_cached_tokens,
            n_blocks,
            n_blocks * self.block_bytes,
            scheduled - job.arrival,
            computed - scheduled,
            now - computed,
        )

    def _resolve(self, job: PrefillJob, outcome) -> None:
        self.jobs.pop(job.seq.seq_id, None)
        self._ended[job.seq.seq_id] = None  # an abort that comes later must not say "nothing comes"
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        if job.future.done():
            return
        m = self.metrics
        if isinstance(outcome, Exception):
            if m is not None:
                m.transfer_failures.inc()
            job.future.set_exception(outcome)
        else:
            if m is not None:
                m.transfer_seconds.observe(outcome.transfer_s)
                m.transfer_bytes.inc(outcome.num_bytes)
            job.future.set_result(outcome)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        self.ledger.check_integrity()
        assert set(self.jobs) >= {e.request_id for e in self.ledger.live()}, "ledger entry without a job"
