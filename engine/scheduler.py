"""Iteration-level scheduler (Orca) with chunked prefill (Sarathi-Serve), preemption
by recompute, two priority lanes and reservations for KV written by a remote
prefill. Policy over plain data: no torch.

Two lifecycles, chosen at construction (`hand_off`):

    decode worker (hand_off False):
        WAITING -> RUNNING -> FINISHED            (or AWAITING_KV -> RUNNING for remote KV)
    prefill worker (hand_off True): a sequence ends its life here with its first token
        WAITING -> RUNNING (chunks) -> HANDOFF -> FINISHED
    HANDOFF keeps the blocks while the KV is written to the decode worker; `end_handoff`
    releases them (they stay in the prefix cache for later prompts).

One step, in order, all under `max_num_batched_tokens` and `max_num_seqs`:

  1. running decodes, one token each (interactive lane first, then arrival);
     a decode that cannot get a block preempts the lowest-priority, latest-arrived
     running sequence not yet scheduled this step (possibly itself);
  2. running prompts still being prefilled, chunked into what budget is left;
  3. waiting sequences, interactive lane before batch lane, FCFS within a lane,
     admitted while free blocks stay above the watermark (no admission in a step
     that preempted: the pool is short).

A preempted sequence frees its blocks and goes back to the head of its lane; on
resumption its prompt and generated tokens are prefilled again, less what the prefix
cache still holds, on the device or in the tiers below it (engine/kv_tiers.py: with a
swap budget its full blocks are kept there for it).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from operator import attrgetter

from engine.block_pool import BlockPool
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager, PrefixHit
from engine.plan import PENDING, SampleRow, SeqWork, StepPlan
from engine.sequence import BATCH, INTERACTIVE, FinishReason, Sequence, Status


class AdmissionError(RuntimeError):
    """A request can never be admitted (too long for the cache or the model)."""


class NoCapacity(RuntimeError):
    """No room now (blocks or sequence slots): the caller should retry later."""


@dataclass
class Reservation:
    seq_id: str
    block_ids: list[int]
    num_cached_tokens: int  # leading prompt tokens already in this worker's prefix cache


@dataclass
class SchedulerOutput:
    plan: StepPlan = field(default_factory=StepPlan)
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, new tokens)
    preempted: list[Sequence] = field(default_factory=list)


_PENDING_INPUT = (PENDING,)  # a decode's input in a step planned ahead
_RUN_ORDER = attrgetter("priority", "arrival")  # the running list's order: interactive lane first, then arrival


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, hand_off: bool = False) -> None:
        self.config = config
        self.pool = pool
        self.bs = pool.block_size
        self.lanes: dict[int, deque[Sequence]] = {INTERACTIVE: deque(), BATCH: deque()}
        self.running: list[Sequence] = []
        self.awaiting_kv: dict[str, Sequence] = {}
        # ended reservations whose blocks a late remote write may still reach: held,
        # but not requests (no slot, no drain); the handoff ledger says when to free
        self.quarantined: dict[str, Sequence] = {}
        # prefill only: sequences past their first token whose KV is being written out
        self.handoff: dict[str, Sequence] = {}
        # what a sampled token does to its sequence: chosen once, not tested per token
        self._on_token = self._to_handoff if hand_off else self._append_token
        self.watermark_blocks = math.ceil(config.watermark * pool.num_blocks)
        self.cache = KVCacheManager(pool, self.watermark_blocks, config.long_rope_from, config.kv_group_windows,
                                    whole_hits=hand_off)
        self.num_preemptions = 0
        # decode only: blocks a sliding window has passed go back as the sequence grows
        self.window = None if hand_off else config.free_outside_window
        # KV groups (engine/kv_groups.py): the windowed groups give back what their windows passed
        self.release_groups = not hand_off and bool(config.kv_group_windows)

    # ---- queries -------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.lanes.values())

    def has_work(self) -> bool:
        return bool(self.running or self.num_waiting)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt (or recompute) tokens admitted or waiting and not computed yet: the
        router's measure of a worker's prefill queue."""
        running = sum(s.num_to_compute for s in self.running if s.num_to_compute > 1 or not s.output_ids)
        return running + sum(s.num_tokens for q in self.lanes.values() for s in q)

    def _slots_left(self) -> int:
        return self.config.max_num_seqs - len(self.running) - len(self.awaiting_kv)

    # ---- requests in and out -------------------------------------------------
    def validate(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise AdmissionError if such a request could never run here."""
        limit = self.config.max_model_len
        if num_prompt_tokens < 1:
            raise AdmissionError("the prompt is empty")
        if num_prompt_tokens >= limit:
            raise AdmissionError(f"prompt has {num_prompt_tokens} tokens; this model allows fewer than {limit}")
        chunk = self.config.max_num_batched_tokens if self.config.enable_chunked_prefill else num_prompt_tokens
        need = self.cache.most_blocks(num_prompt_tokens + 1, chunk, released=self.release_groups)
        if need > self.pool.num_blocks - self.watermark_blocks:
            raise AdmissionError(f"prompt needs {need} KV blocks; the cache has {self.pool.num_blocks}")

    def add(self, seq: Sequence) -> None:
        self.validate(seq.num_tokens, seq.params.max_tokens)  # a migrated request brings its output
        seq.status = Status.WAITING
        self.lanes[seq.priority].append(seq)

    def find(self, seq_id: str) -> Sequence | None:
        return next((s for s in self.live() if s.seq_id == seq_id), None)

    def live(self) -> list[Sequence]:
        """Every sequence that may hold blocks or wait for them."""
        return [*self.running, *self.awaiting_kv.values(), *self.quarantined.values(), *self.handoff.values(),
                *(s for q in self.lanes.values() for s in q)]

    def abort(self, seq_id: str) -> Sequence | None:
        """Remove a request wherever it is and free its blocks. Unknown ids: None."""
        seq = self.find(seq_id)
        if seq is not None:
            self.finish(seq, FinishReason.ABORT)
        return seq

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.is_finished:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.AWAITING_KV:
            del self.awaiting_kv[seq.seq_id]
        elif seq.status is Status.QUARANTINED:
            del self.quarantined[seq.seq_id]
        elif seq.status is Status.WAITING:
            self.lanes[seq.priority].remove(seq)
        elif seq.status is Status.HANDOFF:
            del self.handoff[seq.seq_id]
        else:
            raise RuntimeError(f"{seq.seq_id}: unexpected status {seq.status}")
        self.cache.forget(seq)
        seq.num_computed = 0
        seq.status, seq.finish_reason = Status.FINISHED, reason

    # ---- reservations for remotely prefilled KV -------------------------------
    def reserve(self, seq: Sequence) -> Reservation:
        """Hold blocks for `seq`'s whole prompt; a remote prefill writes into the blocks
        past `num_cached_tokens`. Raises NoCapacity when there is no room now. The
        reservation's deadline is the handoff ledger's, not the scheduler's."""
        self.validate(len(seq.prompt_ids), seq.params.max_tokens)
        if self._slots_left() <= 0:
            raise NoCapacity("max_num_seqs reached")
        n_prompt = len(seq.prompt_ids)
        # the remote side samples token 0 and writes the blocks past the hit: at least the
        # last block is left to it (a whole-prompt hit would leave a write of no blocks,
        # which no transport carries), as a local prefill always computes the last token
        # (no wait for a prefix on disk: a reservation is answered now)
        hit = self.cache.match(seq, max_tokens=n_prompt - 1, fetch=False)
        need = math.ceil(n_prompt / self.bs) - hit.num_blocks
        if not self.cache.can_fit(hit, need):
            raise NoCapacity(f"{need} blocks needed, {self.pool.num_free_blocks} free")
        self.cache.record_query(n_prompt, hit.num_blocks * self.bs)  # counted as a local admission is
        self._take(seq, hit, need)
        seq.status = Status.AWAITING_KV
        self.awaiting_kv[seq.seq_id] = seq
        # with KV groups, every group's table, one after another (each as long as the first)
        return Reservation(seq.seq_id, [b for t in self.cache.block_tables(seq.seq_id) for b in t],
                           seq.num_cached_tokens)

    def mark_landed(self, seq_id: str, first_token: int) -> Sequence:
        """The prompt's KV is in the reserved blocks and the first token was sampled
        remotely: the sequence decodes from the next step. Only now are its blocks
        named in the prefix cache: before the KV landed, their content was not there."""
        seq = self.awaiting_kv.pop(seq_id)
        seq.num_computed = len(seq.prompt_ids)
        seq.status = Status.RUNNING
        self.running.append(seq)
        self.cache.commit_full_blocks(seq)
        self._on_token(seq, first_token)
        return seq

    def quarantine(self, seq_id: str) -> Sequence | None:
        """An unlanded reservation ended: keep its blocks out of use (a late write may
        still land in them) without counting it as a sequence. Unknown ids: None."""
        seq = self.awaiting_kv.pop(seq_id, None)
        if seq is not None:
            seq.status = Status.QUARANTINED
            self.quarantined[seq_id] = seq
        return seq

    def release_reservation(self, seq_id: str, reason: FinishReason = FinishReason.ABORT) -> Sequence | None:
        """Free a reservation's blocks, awaiting or quarantined. Idempotent."""
        seq = self.awaiting_kv.get(seq_id) or self.quarantined.get(seq_id)
        if seq is not None:
            self.finish(seq, reason)
        return seq

    # ---- one step ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=_RUN_ORDER)
        scheduled: set[int] = set()
        running = Status.RUNNING
        need_blocks = self.cache.num_blocks_needed
        for seq in list(self.running):  # 1. decodes (and the drafts they verify)
            if budget == 0:
                break
            # seq.num_to_compute, spelled out: this loop runs for every sequence every step
            if (seq.status is not running
                    or len(seq.prompt_ids) + len(seq.output_ids) - seq.num_computed != 1):
                continue
            draft = seq.draft_ids
            if draft and 1 + len(draft) > budget:
                seq.draft_ids = draft = []
            if self._crosses_long_rope(seq, seq.num_computed + len(draft)):
                self._recompute_long(seq, out)
                continue
            n = 1 + len(draft)
            need = need_blocks(seq, seq.num_computed + n)
            if not need or self._make_room(seq, need, scheduled, out):
                self._schedule(seq, n, scheduled, out, draft=draft)
                budget -= n
        for seq in (list(self.running) if len(scheduled) < len(self.running) else ()):  # 2. prompts being prefilled
            if budget == 0 or seq.status is not running or id(seq) in scheduled or seq.num_to_compute <= 1:
                continue
            n = self._chunk(seq, budget)
            if n and self._make_room(seq, self._blocks_needed(seq, n), scheduled, out):
                self._schedule(seq, n, scheduled, out)
                budget -= n
        if not out.preempted and (self.config.policy == "continuous" or not self.running):
            self._admit(budget, scheduled, out)
        return out

    def _admit(self, budget: int, scheduled: set[int], out: SchedulerOutput) -> None:
        for lane in (self.lanes[INTERACTIVE], self.lanes[BATCH]):
            while lane and budget > 0 and self._slots_left() > 0:
                seq = lane[0]
                if self._crosses_long_rope(seq, seq.num_tokens - 1):  # (re)computed whole: long throughout
                    self.cache.set_long_rope(seq)
                admission = self._admission(seq, budget)
                if admission is None:
                    return  # strict FCFS and lane order: nothing behind the head jumps it
                hit, n, need = admission
                lane.popleft()
                self.cache.record_query(seq.num_tokens, hit.num_blocks * self.bs)
                self._take(seq, hit, need)
                seq.status = Status.RUNNING
                self.running.append(seq)
                self._schedule(seq, n, scheduled, out)
                budget -= n

    def schedule_ahead(self, out: SchedulerOutput) -> SchedulerOutput | None:
        """The next step, planned while `out`'s step still runs (asynchronous scheduling, as
        vLLM's): each of its sequences decodes the token `out` samples for it, which only
        the device knows yet (`PENDING`). Sequences `out` certainly ends (max_tokens, the
        model's length) are left out; one that an EOS or stop id ends computes one token
        for nothing, dropped at `update`. Called before `update(out)`, every earlier
        step's update done, for an `out` that sampled one token for every sequence it ran
        (no middle prompt chunk, draft or prompt logprobs: the engine launches no other
        step, decode_worker/llm_engine.py `_launchable`, and a step planned here is one).

        None, and nothing changed, where the ordinary `schedule` must run instead:
        something other than `out`'s sequences waits for a turn (a sequence admitted or
        landed since, a waiting request the ordinary step would admit now: a slot and
        the blocks for its first chunk free), `out` preempted, or the blocks the next
        tokens need are not free (never a preemption here). A request that waits for blocks, as in a
        KV-bound queue, does not stop the steps ahead: it is admitted at the first step
        whose blocks allow it, planned the ordinary way."""
        if out.preempted:
            return None
        running = {id(s) for s in self.running}
        if len(running) != sum(1 for s, _ in out.scheduled if id(s) in running):
            return None
        bs, max_len, groups = self.bs, self.config.max_model_len, self.cache.num_groups
        block_table = self.cache.block_table
        nxt: list[tuple[Sequence, int, object, int]] = []
        need = 0
        for seq, n in out.scheduled:
            if id(seq) not in running:
                continue  # ended since (an abort)
            num_out = len(seq.output_ids)
            if num_out + 1 >= seq.params.max_tokens or len(seq.prompt_ids) + num_out + 1 >= max_len:
                continue  # `out`'s token ends it
            computed = seq.num_computed + n  # once `out` is updated; its token is then the one to compute
            if self._crosses_long_rope(seq, computed):
                return None  # the ordinary step recomputes it
            table = block_table(seq.seq_id)
            short = (-(-(computed + 1) // bs) - len(table)) * groups  # blocks to add for position `computed`
            if short > 0:
                need += short
            nxt.append((seq, computed, table, short))
        if need > self.pool.num_free_blocks or len(nxt) > self.config.max_num_batched_tokens:
            return None
        if self.num_waiting and self._waiting_head_admissible(self.config.max_num_batched_tokens - len(nxt), need):
            return None  # the ordinary step admits it now
        ahead = SchedulerOutput()
        decodes, scheduled = ahead.plan.decodes, ahead.scheduled
        for seq, computed, table, short in nxt:
            if short > 0:
                self.cache.grow(seq, short)
                table = block_table(seq.seq_id)
            params = seq.params
            # the pending token counts towards min_tokens
            banned = () if len(seq.output_ids) + 1 >= params.min_tokens else seq.banned_ids()
            decodes.append(SeqWork(seq.seq_id, _PENDING_INPUT, computed, table,
                                   SampleRow(params, _OutputAhead(seq.output_ids), seq.prompt_ids, banned, None, ()),
                                   long_rope=self.cache.long_rope(seq),
                                   group_tables=self.cache.other_tables(seq.seq_id)))
            scheduled.append((seq, 1))
        return ahead

    def _admission(self, seq: Sequence, budget: int, held: int = 0) -> tuple[PrefixHit, int, int] | None:
        """(prefix hit, tokens to compute now, new blocks) for admitting waiting `seq` in
        `budget` tokens with `held` blocks already spoken for, or None where it does not
        fit (the watermark kept free)."""
        # the last token is always computed here (its logits give the next token)
        hit = self.cache.match(seq, max_tokens=0 if seq.prompt_logprobs_left else seq.num_tokens - 1)
        if hit.pending:
            return None  # part of its prefix is coming up from disk: admitted once it is in host memory
        n = self._chunk(seq, budget, start=hit.num_blocks * self.bs)
        if not n:
            return None
        need = math.ceil((hit.num_blocks * self.bs + n) / self.bs) - hit.num_blocks
        if not self.cache.can_fit(hit, need, held):
            return None
        return hit, n, need

    def _waiting_head_admissible(self, budget: int, held: int) -> bool:
        """Whether `_admit`, in a step with `budget` tokens left and `held` blocks spoken
        for, would take the first waiting sequence (in lane order)."""
        if budget <= 0 or self._slots_left() <= 0 or self.config.policy != "continuous":
            return False
        head = next((lane[0] for lane in (self.lanes[INTERACTIVE], self.lanes[BATCH]) if lane), None)
        return head is not None and self._admission(head, budget, held) is not None

    def _chunk(self, seq: Sequence, budget: int, start: int | None = None) -> int:
        todo = seq.num_tokens - (seq.num_computed if start is None else start)
        if todo <= budget:
            return todo
        return budget if self.config.enable_chunked_prefill else 0

    def _schedule(self, seq: Sequence, n: int, scheduled: set[int], out: SchedulerOutput, draft=()) -> None:
        """`n` tokens of `seq` this step: its next `n - len(draft)` tokens, then the draft."""
        start, n = seq.num_computed, n - len(draft)
        last = start + n == seq.num_tokens
        params = seq.params
        if not last:
            sample = None
        elif not draft and seq.grammar is None and len(seq.output_ids) >= params.min_tokens:
            # nothing banned from here on (the output only grows): one row for every step
            sample = seq.plain_row
            if sample is None:
                sample = seq.plain_row = SampleRow(params, seq.output_ids, seq.prompt_ids)
        else:
            sample = SampleRow(params, seq.output_ids, seq.prompt_ids, seq.banned_ids(), seq.grammar,
                               tuple(draft) if draft else ())
        work = SeqWork(seq.seq_id, seq.token_slice(start, start + n), start, self.cache.block_table(seq.seq_id), sample,
                       long_rope=self.cache.long_rope(seq), group_tables=self.cache.other_tables(seq.seq_id))
        if params.prompt_logprobs is not None and seq.prompt_logprobs_left and start == len(seq.prompt_logprobs):
            work.prompt_targets = seq.prompt_ids[start + 1: min(start + n + 1, len(seq.prompt_ids))]
            work.prompt_topk = seq.params.prompt_logprobs
        out.plan.add(work)
        out.scheduled.append((seq, n))
        scheduled.add(id(seq))

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        return self.cache.num_blocks_needed(seq, seq.num_computed + n)

    def _make_room(self, seq: Sequence, need: int, scheduled: set[int], out: SchedulerOutput) -> bool:
        """Allocate `need` more blocks for `seq`, preempting from the tail of the running
        order (never a sequence already scheduled this step). False if `seq` itself
        had to go or no victim is left."""
        while self.pool.num_free_blocks < need:
            victim = next((s for s in reversed(self.running) if id(s) not in scheduled), None)
            if victim is None:
                return False
            self._preempt(victim, out)
            if victim is seq:
                return False
        if need:
            self.cache.grow(seq, need)
        return True

    @property
    def long_rope_from(self) -> int | None:
        """LongRoPE's threshold (SchedulerConfig.long_rope_from), as the cache names blocks by it."""
        return self.cache.long_rope_from

    def _crosses_long_rope(self, seq: Sequence, last: int) -> bool:
        """LongRoPE: whether computing positions up to `last` takes `seq` past the short
        factors' length while it is still short."""
        return self.long_rope_from is not None and last >= self.long_rope_from and not self.cache.long_rope(seq)

    def _recompute_long(self, seq: Sequence, out: SchedulerOutput) -> None:
        """LongRoPE: `seq` grew past the short factors' length. transformers (Phi-3's
        generation) drops its cache there and computes the whole sequence again with the
        long factors; so does this: back to the head of its lane, its blocks released
        (named under the short rotation, they stay cached for others), recomputed long."""
        self.running.remove(seq)
        self.cache.forget(seq)
        self.cache.set_long_rope(seq)
        seq.num_computed = 0
        seq.draft_ids = []
        seq.status = Status.WAITING
        seq.num_preemptions += 1  # usage keeps its first admission's cache hit
        self.lanes[seq.priority].appendleft(seq)
        out.preempted.append(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.cache.preempt(seq)  # swapped where the worker has a swap budget and that is cheaper
        seq.num_computed = 0
        seq.draft_ids = []
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.lanes[seq.priority].appendleft(seq)
        out.preempted.append(seq)

    # ---- after the forward ---------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int], prompt_logprobs: dict | None = None,
               accepted: dict[str, list[int]] | None = None) -> list[Sequence]:
        """Advance every scheduled sequence; append sampled tokens; retire finished
        ones at once. Returns the sequences that got a new token.

        `accepted`: a speculative decode's draft tokens that verification kept. Their KV
        was computed this step, so they count as computed; they are appended before the
        sampled token, and the blocks past what is left to compute (the rejected
        tokens' slots) go back to the pool."""
        got: list[Sequence] = []
        running, finished = Status.RUNNING, Status.FINISHED
        commit, append = self.cache.commit_full_blocks, self._on_token
        for seq, n in out.scheduled:
            if seq.status is not running:
                continue  # aborted while the step ran
            sid = seq.seq_id
            if prompt_logprobs and sid in prompt_logprobs:
                seq.prompt_logprobs.extend(prompt_logprobs[sid])
            seq.num_computed += n
            tok = sampled.get(sid)
            if tok is None:
                commit(seq)
                if self.release_groups:  # a prompt chunk: the next one's first query sees less far back
                    self.cache.release_outside_windows(seq)
                continue
            if accepted:
                for t in accepted.get(sid, ()):
                    append(seq, t)
                    seq.num_computed += 1
                    if seq.status is finished:
                        break
            if seq.status is not finished:
                commit(seq)
                if seq.draft_ids:
                    self.cache.trim(seq, seq.num_computed + 1)
                if self.window is not None:  # the next query (at num_computed) sees positions > it - window
                    self.cache.release_before(seq, seq.num_computed - self.window)
                elif self.release_groups:
                    self.cache.release_outside_windows(seq)
                append(seq, tok)
            got.append(seq)
        return got

    def _append_token(self, seq: Sequence, tok: int) -> None:
        reason = seq.append_token(tok)
        if reason is None and len(seq.prompt_ids) + len(seq.output_ids) >= self.config.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            self.finish(seq, reason)

    def _to_handoff(self, seq: Sequence, tok: int) -> None:
        """Prefill: the first token ends the sequence's compute; its blocks stay held."""
        seq.output_ids.append(tok)
        self.running.remove(seq)
        seq.status = Status.HANDOFF
        self.handoff[seq.seq_id] = seq

    def end_handoff(self, seq_id: str, reason: FinishReason = FinishReason.LENGTH) -> Sequence | None:
        """The KV was written (or the write failed): release the blocks. Idempotent."""
        seq = self.handoff.get(seq_id)
        if seq is not None:
            self.finish(seq, reason)
        return seq

    # ---- blocks --------------------------------------------------------------
    def _take(self, seq: Sequence, hit: PrefixHit, need_new: int) -> None:
        self.cache.allocate(seq, hit, need_new)
        seq.num_computed = hit.num_blocks * self.bs
        if not seq.num_preemptions:  # usage reports the first admission's hit
            seq.num_cached_tokens = seq.num_computed

    # ---- invariants ----------------------------------------------------------
    def check_integrity(self) -> None:
        """The pool's ref counts equal the blocks held by live sequences: no leak."""
        for q in self.lanes.values():
            assert all(s.status is Status.WAITING and not self.cache.block_table(s.seq_id) for s in q), (
                "waiting sequence holds blocks")
        assert all(s.status is Status.RUNNING for s in self.running)
        assert all(s.status is Status.AWAITING_KV for s in self.awaiting_kv.values())
        assert all(s.status is Status.QUARANTINED for s in self.quarantined.values())
        assert all(s.status is Status.HANDOFF for s in self.handoff.values())
        for s in self.running:
            covered = len(self.cache.block_table(s.seq_id)) * self.bs
            assert covered >= s.num_computed, f"{s.seq_id}: blocks do not cover computed tokens"
        self.cache.check_integrity({s.seq_id for s in self.live()})


class _OutputAhead(SequenceABC):
    """A sequence's generated tokens as a step planned ahead sees them: one more, the
    pending one, at the end (the sampler reads the length: a seeded draw's index)."""

    __slots__ = ("_ids",)

    def __init__(self, ids: list[int]) -> None:
        self._ids = ids

    def __len__(self) -> int:
        return len(self._ids) + 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [*self._ids, PENDING][i]
        n = len(self._ids)
        if i in (n, -1):
            return PENDING
        if not -n - 1 <= i < n:
            raise IndexError(i)
        return self._ids[i if i >= 0 else i + 1]
