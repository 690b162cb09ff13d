"""Prefixes pulled from a peer: a prefill worker that lacks the leading blocks of a prompt
which another worker holds (on its device or in a tier below, engine/kv_tiers.py) has
them written into its own cache over the KV transport instead of computing them.

    router -> P1  PrefillRequest(pull = Q, the blocks Q holds)      (router/policy.py)
    P1            reserves blocks for the part it lacks (a reservation of its own scheduler)
    P1 -> Q       PushBlocks(prefix, first block, P1's blocks, P1's transport)
    Q             holds the blocks (restoring host ones to its device), writes them into
                  P1's blocks (the handoff's transport and its bound, transfer_timeout_s),
                  lets go, answers with how many it wrote
    P1            names what landed in its prefix cache and frees the reservation (the
                  blocks stay cached); then admits the prompt, which hits them

A pull is made where the router saw another worker hold at least MIN_PULL_BLOCKS more
leading blocks than P1 does, and P1 has not measured pulls slower than its own prefill
(seconds a pulled block against block_size over its prompt tokens a second).

Where anything fails (Q gone, a refused descriptor, a write that failed or timed out, a
block Q no longer holds), P1 computes the prompt as it would have: the reservation is
quarantined for the handoff's quarantine (longer than any write may take, as for a
decode worker's reservation), then freed, so a late write cannot reach a reused block.
Tensor-parallel workers on either side: the holder's ranks each write the KV heads the
puller's ranks hold, as in a handoff (worker_runtime/tp_kv.py: rank 0 its own pairs, the
others theirs on a `Call` between steps, reporting them done), and the holder answers
once all are done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from engine.kv_tiers import FETCH_WAIT_S
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, Sequence, Status
from kv_transfer.base import XferState
from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc as pb_grpc
from worker_runtime.rpc import call_metadata, channel

log = logging.getLogger(__name__)

MIN_PULL_BLOCKS = 2  # fewer missing blocks than this: computed (a pull's round trips cost more)
_PARAMS = SamplingParams(max_tokens=1)


@dataclass
class PullStats:
    """Counts since start: blocks pulled in, pulls that fell back to compute, blocks pushed out."""

    pulled_blocks: int = 0
    pulls: int = 0
    failed: int = 0
    pushed_blocks: int = 0
    pushes: int = 0
    pull_s: float = 0.0


# ---- the holder (engine thread) ---------------------------------------------------------
def hold_for_push(engine, pull_id: str, prefix: list[int], first_block: int,
                  long_rope: bool = False) -> list[int] | None:
    """This worker's blocks for the prefix's blocks `first_block`.. that it holds in a run
    from the start (device, or host memory restored to the device), held until
    `release_push`; [] when it holds none of them; None while some are coming up from its
    disk tier (ask again)."""
    sched = engine.scheduler
    if sched.find(pull_id) is not None:
        raise ValueError(f"pull {pull_id!r} is already being served")
    if sched.cache.num_groups > 1:
        return []  # KV groups (engine/kv_groups.py): a push moves one table's blocks; not offered
    seq = Sequence(pull_id, list(prefix), _PARAMS, frozenset(), long_rope=long_rope)
    hit = sched.cache.match(seq, max_tokens=len(prefix))
    if hit.pending:
        if engine.tiers is not None:
            engine.tiers.move()  # start the reads
        sched.cache.forget(seq)
        return None
    if hit.num_blocks <= first_block or not sched.cache.can_fit(hit, 0):
        sched.cache.forget(seq)
        return []
    wait = getattr(engine, "wait_inflight", None)
    if wait is not None:
        wait()  # a step planned ahead may still write a block the pool gave back (decode_worker/llm_engine.py)
    sched.cache.allocate(seq, hit, 0)
    seq.num_computed = hit.num_blocks * sched.bs
    if engine.tiers is not None:
        engine.tiers.move()
    seq.status = Status.HANDOFF
    sched.handoff[pull_id] = seq
    return list(sched.cache.block_table(pull_id)[first_block:hit.num_blocks])


def release_push(engine, pull_id: str) -> None:
    engine.scheduler.end_handoff(pull_id, FinishReason.LENGTH)


# ---- the puller (engine thread) ------------------------------------------------------------
def reserve_pull(engine, pull_id: str, prefix: list[int], long_rope: bool = False) -> tuple[int, list[int]] | None:
    """Blocks for the prefix's blocks this worker lacks: (how many it has, the whole
    table), held as a reservation; None where fewer than MIN_PULL_BLOCKS are missing or
    there is no room now."""
    sched = engine.scheduler
    if sched.cache.num_groups > 1:
        return None  # KV groups: a pull would move one table's blocks (see hold_for_push)
    seq = Sequence(pull_id, list(prefix), _PARAMS, frozenset(), long_rope=long_rope)
    n = len(prefix) // sched.bs
    hit = sched.cache.match(seq, max_tokens=len(prefix), fetch=False)
    need = n - hit.num_blocks
    if need < MIN_PULL_BLOCKS or sched.find(pull_id) is not None or sched._slots_left() <= 0 \
            or not sched.cache.can_fit(hit, need):
        sched.cache.forget(seq)
        return None
    sched.cache.allocate(seq, hit, need)
    if engine.tiers is not None:
        engine.tiers.move()
    seq.num_computed = hit.num_blocks * sched.bs
    seq.status = Status.AWAITING_KV
    sched.awaiting_kv[pull_id] = seq
    return hit.num_blocks, list(sched.cache.block_table(pull_id))


def land_pull(engine, pull_id: str, num_blocks: int) -> None:
    """The first `num_blocks` blocks are in: named in the prefix cache, and the
    reservation freed (they stay there, cached, for the prompt's admission)."""
    sched = engine.scheduler
    seq = sched.awaiting_kv[pull_id]
    seq.num_computed = num_blocks * sched.bs
    sched.cache.commit_full_blocks(seq)
    sched.finish(seq, FinishReason.LENGTH)


def abandon_pull(engine, pull_id: str) -> None:
    """The pull failed: its blocks stay out of use until `release_pull` (a late write)."""
    engine.scheduler.quarantine(pull_id)


def release_pull(engine, pull_id: str) -> None:
    engine.scheduler.release_reservation(pull_id)


def _rank_push(runner, writes) -> None:
    """A rank other than 0: write its pairs of a push now, every layer at once."""
    writes.hook(runner)(writes.num_layers - 1)


# ---- the RPCs ------------------------------------------------------------------------------
class PullMixin:
    """PushBlocks for both worker services, and the pull a prefill worker makes. A
    service sets `config`, `epoch`, `kv` (WorkerKV), `transport`, `engine` and
    `engine_loop`, and `pull_stats`."""

    async def PushBlocks(self, request: pb.PushRequest, context):
        stats: PullStats = self.pull_stats
        bs = self.engine.scheduler.bs
        prefix = list(request.prompt_ids)
        if not prefix or len(prefix) % bs or request.first_block < 0 or \
                len(request.block_ids) != len(prefix) // bs - request.first_block:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a push takes whole blocks of {bs} tokens and "
                                "one target block for each from first_block on")
        try:  # each of our ranks to the puller's ranks whose KV heads it holds (worker_runtime/tp_kv.py)
            gpeer = await asyncio.to_thread(self.kv.add_peer, request.descriptor)
        except Exception as e:  # noqa: BLE001 - a refused or unreachable puller: its pull fails
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot connect to {request.worker_id}: {e}")
        pull_id = f"push:{request.worker_id}:{request.pull_id}"
        local = None
        for _ in range(int(FETCH_WAIT_S / 0.002)):  # blocks on disk: read into host memory first
            local = await self.engine_loop.call(hold_for_push, self.engine, pull_id, prefix, request.first_block,
                                                request.long_rope)
            if local is not None:
                break
            await asyncio.sleep(0.002)
            if self.engine.tiers is not None:
                await self.engine_loop.call(self.engine.tiers.poll)
        if not local:
            return pb.PushReply(num_blocks=0)
        handles: list = []
        try:
            remote = list(request.block_ids)[:len(local)]
            handles = await self.engine_loop.call(self._start_push, pull_id, gpeer, local, remote)
            deadline = time.monotonic() + self.config.handoff.transfer_s
            while True:
                done, reason = await self.engine_loop.call(self._push_state, pull_id, gpeer, handles)
                if done:
                    break
                if time.monotonic() > deadline:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the write did not finish in time")
                await asyncio.sleep(0.001)
            if reason is not None:
                await context.abort(grpc.StatusCode.ABORTED, f"the write failed: {reason}")
            stats.pushes += 1
            stats.pushed_blocks += len(local)
            return pb.PushReply(num_blocks=len(local),
                                num_bytes=len(local) * self.engine.runner.kv_cache.layout.block_bytes * self.kv.size)
        finally:
            for h in handles:
                self.engine_loop.post(self.transport.release, h)  # a pending write fails; a done one is kept
            self.engine_loop.post(self.kv.forget, pull_id)
            self.engine_loop.post(release_push, self.engine, pull_id)

    def _start_push(self, pull_id: str, gpeer, local: list[int], remote: list[int]) -> list:
        """Engine thread: rank 0's writes of the push, and the other ranks' (a `Call`
        ahead of the next step: each writes its pairs, and reports them done)."""
        group = self.kv.group_of(gpeer)
        ready = self.engine.runner.compute_marker()  # CUDA: the restores' copies are queued before it
        handles = [self.transport.write_blocks(group.rank_peers[p.dst], local, remote, heads=p.heads, ready=ready)
                   for p in group.mine(0)]
        writes = self.kv.rank_writes([(pull_id, gpeer, local, remote)], False,
                                     self.engine.runner.model_config.num_layers)
        if writes is not None:
            from engine.parallel.group import Call

            self.kv.group.send(Call(_rank_push, (writes,)))
        return handles

    def _push_state(self, pull_id: str, gpeer, handles: list) -> tuple[bool, str | None]:
        """Engine thread: (whether every rank's writes of the push finished, the first failure)."""
        states = [self.transport.poll(h) for h in handles]
        bad = next((s.reason for s in states if s.finished and s.state is not XferState.DONE), None)
        if bad is not None:
            return True, bad
        others, reason = self.kv.shards_done(pull_id, gpeer)
        if reason is not None:
            return True, reason
        return all(s.finished for s in states) and others, None

    async def pull_prefix(self, request_id: str, prompt: list[int], source: pb.PullSource) -> int:
        """Before a prefill: bring the prompt's leading blocks `source` holds into this
        worker's cache. Returns the blocks pulled (0: none, the prompt is computed)."""
        stats: PullStats = self.pull_stats
        bs = self.engine.scheduler.bs
        n = min(source.num_blocks, (len(prompt) - 1) // bs)  # the last token is computed here anyway
        if n < MIN_PULL_BLOCKS or source.worker_id == self.config.worker_id:
            return 0
        rate = getattr(getattr(self.engine, "rate", None), "value", 0.0)  # prompt tokens a second, measured
        if stats.pulled_blocks and rate > 0 and stats.pull_s / stats.pulled_blocks > bs / rate:
            return 0  # pulls measured slower than this worker computes a block: computed
        pull_id = f"pull:{request_id}"
        prefix = prompt[:n * bs]
        # LongRoPE: a long prompt's blocks are named apart, however short the prefix pulled
        long_rope = self.engine.scheduler.cache.long_prompt(len(prompt))
        try:
            got = await self.engine_loop.call(reserve_pull, self.engine, pull_id, prefix, long_rope)
        except asyncio.CancelledError:  # the prefill went away: nothing was asked of the holder yet
            self.engine_loop.post(release_pull, self.engine, pull_id)
            raise
        if got is None:
            return 0
        have, table = got
        t0 = time.monotonic()
        req = pb.PushRequest(pull_id=pull_id, prompt_ids=prefix, first_block=have, block_ids=table[have:],
                             worker_id=self.config.worker_id, epoch=self.epoch,
                             descriptor=self.kv.local_descriptor(), long_rope=long_rope)
        reply, why = None, "cancelled"
        try:
            async with channel(source.address) as ch:
                stub = (pb_grpc.DecodeWorkerStub if source.role == "decode" else pb_grpc.PrefillWorkerStub)(ch)
                reply = await stub.PushBlocks(req, timeout=self.config.handoff.transfer_s + 5.0,
                                              metadata=call_metadata(self.config.cluster_token))
        except (grpc.aio.AioRpcError, OSError) as e:
            why = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
        finally:
            if reply is None:  # failed, or the prefill was cancelled meanwhile: a late write may still come
                log.warning("pull of %s's prefix from %s failed (%s): computing it", request_id, source.worker_id,
                            why)
                stats.failed += 1
                self.engine_loop.post(abandon_pull, self.engine, pull_id)
                asyncio.get_running_loop().call_later(self.config.handoff.quarantine_s, self.engine_loop.post,
                                                      release_pull, self.engine, pull_id)
        if reply is None:
            return 0
        await self.engine_loop.call(land_pull, self.engine, pull_id, have + reply.num_blocks)
        if self.kv.size > 1:  # the holder's other ranks' writes carried shard notes: not a handoff's, dropped
            await self.engine_loop.call(self.kv.notifications)
        if reply.num_blocks:
            stats.pulls += 1
            stats.pulled_blocks += reply.num_blocks
            stats.pull_s += time.monotonic() - t0
        return reply.num_blocks
