"""ClusterBackend: each request routed through the Ray worker pools over gRPC.

Per request: pick a decode worker with room (waiting, bounded, when none has room),
decide local vs remote prefill (router/policy.py), run the path
(router/worker_client.py). Failures:
- before the first token: retried on another decode worker (never the one that just
  failed, while another is ready);
- the decode worker dies mid-stream: migrated: the prompt plus the tokens already
  streamed are prefilled on another decode worker, which continues the output
  (exact for greedy; seeded sampling and penalties see the same history);
- the prefill fails: prefilled locally on the decode worker (worker_client).
Each attempt has its own request id (`<id>#<n>`) on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from typing import AsyncIterator

from engine.block_pool import LONG_ROPE_KEY, block_hashes
from protos import tandem_pb2 as pb
from protos.tokens import TokenBatch
from router.backend import Backend, BackendError, GenerateRequest
from router.cluster_metrics import ClusterMetrics
from router.policy import BELOW_COST, PULL_MIN_BLOCKS, RoutingConfig, WorkerView, choose_decode, plan
from router.view import ClusterView
from router.worker_client import disaggregated_stream, local_stream
from router.workers import Worker
from worker_runtime.config import WORKER_LOST, Role
from worker_runtime.membership import WorkerState

log = logging.getLogger(__name__)


class ClusterBackend(Backend):
    def __init__(
        self,
        view: ClusterView,
        routing: RoutingConfig,
        metrics: ClusterMetrics | None = None,
        capacity_wait_s: float = 30.0,
        max_attempts: int = 3,
    ) -> None:
        self.view = view
        self.routing = routing
        self.metrics = metrics or ClusterMetrics(view)
        self.capacity_wait_s = capacity_wait_s
        self.max_attempts = max_attempts
        self.lease_s = 30.0

    async def start(self) -> None:
        await self.view.start()
        # what the pools were made with: the controller's, whoever started it
        info = self.view.info
        self.routing = dataclasses.replace(self.routing, colocated=bool(info.get("colocated", False)))
        self.lease_s = float(info.get("lease_s", self.lease_s))

    async def stop(self) -> None:
        await self.view.stop()

    def ready(self) -> bool:
        return bool(self.view.ready(Role.DECODE))

    @property
    def max_model_len(self) -> int:
        lens = [w.stats.max_model_len for w in self.view.ready(Role.DECODE) if w.stats and w.stats.max_model_len]
        return min(lens) if lens else 0

    @property
    def block_size(self) -> int:
        sizes = [w.stats.block_size for w in self.view.workers.values() if w.stats and w.stats.block_size]
        return sizes[0] if sizes else 16

    def _hash_key(self, prompt_len: int) -> bytes:
        """The extra key the workers name a prompt's blocks with: LongRoPE's, for a prompt
        longer than its short factors' length (engine/kv_cache_manager.py), else none."""
        start = next((w.stats.long_rope_from for w in self.view.workers.values()
                      if w.stats and w.stats.long_rope_from), 0)
        return LONG_ROPE_KEY if start and prompt_len > start else b""

    # ---- one request ---------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenBatch]:
        emitted: list[int] = list(req.output_ids)
        hashes = block_hashes(req.prompt_ids, self.block_size, self._hash_key(len(req.prompt_ids)))
        failed: set[str] = set()  # decode workers this request saw fail: the retry goes elsewhere
        # A worker that refuses the request for room (its free blocks went to others since
        # the stats this router routed on) has not failed: the request waits for room again,
        # within the same bound as the first wait, without using an attempt or marking it.
        room_deadline = time.monotonic() + self.capacity_wait_s
        refusals = 0
        attempt = 0
        while attempt < self.max_attempts:
            if len(emitted) >= req.params.max_tokens:  # everything was streamed before the worker died
                yield TokenBatch(
                    len(emitted),
                    [],
                    finished=True,
                    finish_reason="length",
                    prompt_tokens=len(req.prompt_ids),
                    completion_tokens=len(emitted),
                )
                return
            # each try its own id on the workers: #0, #1, ... (refusals for room count too)
            this = dataclasses.replace(req, request_id=f"{req.request_id}#{attempt + refusals}",
                                       output_ids=list(emitted))
            d, p, reason = await self._route(this, hashes, exclude=failed)
            try:
                pull = self._pull_source(hashes, p) if p is not None and self.routing.prefix_pull else None
                async with contextlib.aclosing(self._run(this, d, p, reason, pull)) as run:
                    async for batch in run:
                        if batch.finished and batch.error and batch.error.startswith(WORKER_LOST):
                            if batch.token_ids:  # the worker failed, not the request: move it, what came kept
                                emitted.extend(batch.token_ids)
                                yield dataclasses.replace(batch, finished=False, finish_reason=None, error=None)
                            raise BackendError(f"decode worker {d.worker_id}: {batch.error}", 503, retry_after=1.0)
                        emitted.extend(batch.token_ids)
                        yield batch
                        if batch.finished:
                            return
                raise BackendError(f"decode worker {d.worker_id} ended the stream early", 503, retry_after=1.0)
            except BackendError as e:
                if e.full and time.monotonic() < room_deadline:
                    refusals += 1
                    self.metrics.retries.labels("full").inc()
                    log.info("request %s: %s; waiting for room", req.request_id, e)
                    await asyncio.sleep(min(0.05 * 2 ** min(refusals, 4), 0.5))
                    continue
                if e.status == 400 or attempt + 1 >= self.max_attempts:
                    raise
                self.view.suspect(d.worker_id)
                failed.add(d.worker_id)
                cause = "migrated" if len(emitted) > len(req.output_ids) else "decode_failed"
                self.metrics.retries.labels(cause).inc()
                log.warning(
                    "request %s on %s failed (%s); %s",
                    req.request_id,
                    d.worker_id,
                    e,
                    "migrating" if cause == "migrated" else "retrying",
                )
                await asyncio.sleep(0.05 * (attempt + 1))
                attempt += 1

    def _pull_source(self, hashes: list[bytes], p: Worker) -> pb.PullSource | None:
        """Another worker (either pool, draining ones too: they still hold their cache) that
        holds more of the prompt's leading blocks than prefill worker `p` does, by
        PULL_MIN_BLOCKS or more, per the prefix index (every tier of theirs): `p` pulls them
        instead of computing them (worker_runtime/kv_pull.py). The most blocks wins (those
        below the holder's device counting BELOW_COST less: they are copied back first); among
        equals a prefill worker (a push takes a decode worker's engine thread from its
        batch), then the one with the fewest requests in flight from this router."""
        mine = self.view.index.overlap_blocks(p.worker_id, hashes)
        best, key, most = None, None, 0
        for w in self.view.workers.values():
            if w.worker_id == p.worker_id or w.state != WorkerState.READY or w.client is None:
                continue
            n = self.view.index.overlap_blocks(w.worker_id, hashes)
            if n - mine < PULL_MIN_BLOCKS:
                continue
            k = (n - BELOW_COST * self.view.index.overlap_below(w.worker_id, hashes, n), w.role == Role.PREFILL,
                 -w.load.pending)
            if key is None or k > key:
                best, key, most = w, k, n
        if best is None:
            return None
        self.metrics.pull_hints.inc()
        return pb.PullSource(worker_id=best.worker_id, epoch=best.epoch, address=best.client.address,
                             role=best.role.value, num_blocks=most)

    async def _run(self, req: GenerateRequest, d: Worker, p: Worker | None, reason: str,
                   pull: pb.PullSource | None = None) -> AsyncIterator[TokenBatch]:
        need = math.ceil((len(req.prompt_ids) + len(req.output_ids) + 1) / self.block_size)
        # a local prefill is prompt tokens on the decode worker's queue (spill weighs them)
        claims = [d.load.claim(blocks=need, tokens=0 if p is not None else len(req.prompt_ids) + len(req.output_ids))]
        if p is not None:
            claims.append(p.load.claim(tokens=len(req.prompt_ids)))
            self.metrics.waiting_for_kv.inc()
        self.metrics.routed.labels("decode", d.worker_id).inc()
        if p is not None:
            self.metrics.routed.labels("prefill", p.worker_id).inc()
        cached = 0

        def on_prefill(outcome) -> None:
            nonlocal cached
            self.metrics.prefill_outcome(outcome)
            if outcome.reply is not None:
                cached = outcome.reply.num_cached_tokens

        def settle() -> None:
            """First token seen (or the attempt ended): the workers' own stats now show it.
            The claims settle together, once; later calls (one a batch) return at once."""
            if claims[0].settled:
                return
            if p is not None:
                self.metrics.waiting_for_kv.dec()
            for c in claims:
                c.settle()

        try:
            if p is None:
                self.metrics.decisions.labels("local", reason).inc()
                stream = local_stream(d.client, req)
            else:
                self.metrics.decisions.labels("remote", reason).inc()
                stream = disaggregated_stream(p.client, d.client, req, lease_s=self.lease_s, on_prefill=on_prefill,
                                              pull=pull)
            async with contextlib.aclosing(stream):
                async for batch in stream:
                    settle()
                    if batch.finished and p is not None:
                        batch.cached_tokens = cached  # prompt tokens the prefill skipped
                    yield batch
        finally:
            settle()
            for c in claims:
                c.end()

    # ---- routing -------------------------------------------------------------------------
    async def _route(
        self, req: GenerateRequest, hashes: list[bytes], exclude: set[str] = frozenset()
    ) -> tuple[Worker, Worker | None, str]:
        """Wait (bounded) for a decode worker with room, then plan the prefill. Workers
        in `exclude` are skipped while any other decode worker is ready."""
        prompt_len = len(req.prompt_ids) + len(req.output_ids)
        need = math.ceil((prompt_len + 1) / self.block_size)
        deadline = time.monotonic() + self.capacity_wait_s
        while True:
            decodes = self.view.ready(Role.DECODE)
            if exclude and any(w.worker_id not in exclude for w in decodes):
                decodes = [w for w in decodes if w.worker_id not in exclude]
            views = [self._view(w, hashes) for w in decodes]
            choice = choose_decode(views, need, self.routing, len(hashes))
            if choice is not None:
                best = choice.worker
                self.metrics.decode_decisions.labels(choice.reason).inc()
                d = self.view.get(best.worker_id)
                if req.output_ids:  # a migration: the decode worker prefills prompt + output itself
                    return d, None, "fallback"
                prefills = [self._view(w, hashes) for w in self.view.ready(Role.PREFILL)]
                route = plan(len(req.prompt_ids), best, prefills, self.routing, self.block_size,
                             local_only=req.params.prompt_logprobs is not None, lease_s=self.lease_s)
                return d, (self.view.get(route.prefill) if route.prefill else None), route.reason
            # none at all: a new request hears so after 5 s; a stream already under way
            # (moved off a worker that died) waits the whole bound while the controller
            # starts a replacement, which a worker of several ranks takes a while to become
            migrating = bool(req.output_ids) and self.view.starting(Role.DECODE)
            if not decodes and not migrating and time.monotonic() > deadline - self.capacity_wait_s + 5.0:
                raise BackendError("no decode worker is ready", 503, retry_after=2.0)
            if time.monotonic() >= deadline:
                self.metrics.retries.labels("no_capacity").inc()
                raise BackendError(
                    "no decode worker has room for this request; try again shortly", 503, retry_after=1.0
                )
            await asyncio.sleep(0.02)

    def _view(self, w: Worker, hashes: list[bytes]) -> WorkerView:
        s = w.stats
        return WorkerView(
            w.worker_id,
            free_blocks=s.num_free_blocks if s else 0,
            num_blocks=s.num_blocks if s else 0,
            running=(s.num_running + s.num_waiting + s.num_awaiting_kv) if s else 0,
            queued_tokens=s.queued_prefill_tokens if s else 0,
            in_flight=w.load.pending,
            in_flight_blocks=w.load.blocks,
            in_flight_tokens=w.load.tokens,
            max_num_seqs=s.max_num_seqs if s else 1,
            cached_blocks=(n := self.view.index.overlap_blocks(w.worker_id, hashes)),
            cached_below=self.view.index.overlap_below(w.worker_id, hashes, n),
            prefill_tokens_per_s=s.prefill_tokens_per_s if s else 0.0,
        )
