"""Decode scheduler: exact admission order, chunk sizes, budgets, victims, leases."""

import itertools

import pytest

from engine.block_pool import BlockPool
from engine.config import SchedulerConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import AdmissionError, NoCapacity, Scheduler
from engine.sequence import BATCH, INTERACTIVE, FinishReason, Sequence, Status
from kv_transfer.ledger import Ledger

pytestmark = pytest.mark.unit
BS = 4


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


_made: list[Scheduler] = []  # this test's schedulers, checked for leaks when it ends


def make(num_blocks=32, hand_off=False, **cfg):
    cfg = {"max_num_batched_tokens": 16, "max_num_seqs": 8, "max_model_len": 64, "watermark": 0.0, **cfg}
    s = Scheduler(SchedulerConfig(**cfg), BlockPool(num_blocks, BS), hand_off=hand_off)
    _made.append(s)
    return s


_bases = itertools.count(1000, 1000)


def seq(sid, n_prompt, max_tokens=8, priority=INTERACTIVE, arrival=0.0, first_tok=None, **params):
    """A sequence with its own prompt tokens (no accidental prefix sharing) unless
    `first_tok` is given."""
    base = next(_bases) if first_tok is None else first_tok
    prompt = [base + i for i in range(n_prompt)]
    return Sequence(
        sid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, **params), frozenset({2}), priority, arrival
    )


def step(s, token=7):
    """Schedule, pretend the forward sampled `token` for everyone, update."""
    out = s.schedule()
    sampled = {w.seq_id: token for w in out.plan.works() if w.sample is not None}
    s.update(out, sampled)
    s.check_integrity()
    return out


def shape(out):
    return [(w.seq_id, w.start_pos, len(w.token_ids), w.sample is not None) for w in out.plan.works()]


@pytest.fixture(autouse=True)
def _no_leaks():
    """After each test: the ref counts of every scheduler it made match its live
    sequences, and once those are aborted every block is free again (cached blocks
    stay in the prefix cache but hold no reference)."""
    _made.clear()
    yield
    for s in _made:
        s.check_integrity()
        for seq in s.live():
            s.finish(seq, FinishReason.ABORT)
        s.check_integrity()
        assert s.pool.num_free_blocks == s.pool.num_blocks, "blocks still held after every sequence ended"


def test_admission_fcfs_with_chunked_prefill_budget():
    s = make()
    for sid, n in (("a", 10), ("b", 9), ("c", 3)):
        s.add(seq(sid, n))
    out = step(s)
    # budget 16: a whole (10), b chunked to 6; c waits behind b (strict FCFS)
    assert shape(out) == [("a", 0, 10, True), ("b", 0, 6, False)]
    assert [x.seq_id for x in s.running] == ["a", "b"]
    assert list(s.cache.block_table(s.running[0].seq_id)) == [0, 1, 2]
    assert list(s.cache.block_table(s.running[1].seq_id)) == [3, 4]
    out = step(s)
    # a decodes first (1), b finishes its prompt (3), c is admitted (3)
    assert shape(out) == [("a", 10, 1, True), ("b", 6, 3, True), ("c", 0, 3, True)]
    out = step(s)
    assert shape(out) == [("a", 11, 1, True), ("b", 9, 1, True), ("c", 3, 1, True)]


def test_decodes_are_scheduled_before_prefill_chunks():
    s = make(max_num_batched_tokens=8)
    s.add(seq("a", 3))
    step(s)
    s.add(seq("long", 20))
    out = step(s)
    assert shape(out) == [("a", 3, 1, True), ("long", 0, 7, False)]
    out = step(s)
    assert shape(out) == [("a", 4, 1, True), ("long", 7, 7, False)]


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    s = make(max_num_batched_tokens=64, enable_chunked_prefill=False)
    s.add(seq("a", 40))
    s.add(seq("b", 30))
    out = step(s)
    assert shape(out) == [("a", 0, 40, True)]  # b (30) does not fit in the 24 left
    out = step(s)
    assert shape(out) == [("a", 40, 1, True), ("b", 0, 30, True)]


def test_max_num_seqs_caps_running():
    s = make(max_num_seqs=2)
    for sid in "abc":
        s.add(seq(sid, 2))
    out = step(s)
    assert [w.seq_id for w in out.plan.works()] == ["a", "b"]
    assert s.num_waiting == 1


def test_interactive_lane_before_batch_lane():
    s = make(max_num_batched_tokens=8)
    s.add(seq("batch1", 4, priority=BATCH, arrival=0))
    s.add(seq("inter1", 4, priority=INTERACTIVE, arrival=1))
    s.add(seq("inter2", 4, priority=INTERACTIVE, arrival=2))
    out = step(s)
    assert [w.seq_id for w in out.plan.works()] == ["inter1", "inter2"]
    out = step(s)
    assert [w.seq_id for w in out.plan.works()] == ["inter1", "inter2", "batch1"]


def test_preemption_victim_is_lowest_priority_then_latest_arrival():
    # 6 blocks of 4 tokens; three 8-token prompts use 2 blocks each
    s = make(num_blocks=6, max_num_batched_tokens=32)
    s.add(seq("old_batch", 8, priority=BATCH, arrival=0, max_tokens=20))
    s.add(seq("inter", 8, priority=INTERACTIVE, arrival=1, max_tokens=20))
    s.add(seq("new_batch", 8, priority=BATCH, arrival=2, max_tokens=20))
    step(s)  # prefill all three, 6 blocks used; each now has 9 tokens
    assert s.pool.num_free_blocks == 0
    out = step(s)  # each decode needs a 3rd block: the victim is new_batch (batch lane, latest)
    assert [p.seq_id for p in out.preempted] == ["new_batch"]
    assert shape(out) == [("inter", 8, 1, True), ("old_batch", 8, 1, True)]
    victim = s.lanes[BATCH][0]
    assert victim.seq_id == "new_batch" and victim.status is Status.WAITING
    assert not s.cache.block_table(victim.seq_id) and victim.num_computed == 0 and victim.num_preemptions == 1
    assert victim.output_ids == [7]  # its generated token survives for the recompute


def test_preempted_sequence_resumes_from_its_cached_prefix():
    s = make(num_blocks=5, max_num_batched_tokens=32)
    s.add(seq("a", 8, max_tokens=3, arrival=0))
    s.add(seq("b", 8, max_tokens=20, arrival=1))
    step(s)  # 4 blocks used, 1 free
    b = s.running[1]
    b_blocks = list(s.cache.block_table(b.seq_id))
    out = step(s)  # a takes the last free block; b needs one too and preempts itself
    assert [p.seq_id for p in out.preempted] == ["b"]
    assert shape(out) == [("a", 8, 1, True)]
    out = step(s)  # a samples its 3rd token and finishes; b does not fit yet
    assert shape(out) == [("a", 9, 1, True)] and s.running == []
    out = step(s)
    # b's two full prompt blocks are still cached: only its generated token is recomputed
    assert shape(out) == [("b", 8, 1, True)]
    assert list(s.cache.block_table(b.seq_id)[:2]) == b_blocks and b.output_ids == [7, 7] and b.num_computed == 9


def test_prefix_cache_hit_on_admission_caps_at_last_token():
    s = make()
    s.add(seq("a", 8, max_tokens=1, first_tok=100))
    step(s)  # a: prompt of 2 full blocks, then finished -> blocks cached-free
    assert s.running == []
    s.add(seq("b", 8, max_tokens=1, first_tok=100))
    out = step(s)
    # both blocks are cached, but the last token must be recomputed to sample:
    # hit capped to (8 - 1) // 4 = 1 block; the second block is recomputed
    assert shape(out) == [("b", 4, 4, True)]
    assert s.pool.hits == 4 and s.pool.queries == 16


def test_abort_frees_blocks_everywhere():
    s = make()
    s.add(seq("run", 6))
    step(s)
    s.add(seq("wait", 6))
    res = s.reserve(seq("kv", 9))
    assert len(res.block_ids) == 3
    for sid in ("run", "wait", "kv"):
        assert s.abort(sid).finish_reason is FinishReason.ABORT
    assert s.abort("nope") is None
    assert s.pool.num_free_blocks == s.pool.num_blocks
    s.check_integrity()


def test_reservation_lease_expiry_frees_blocks():
    # the handoff ledger owns the reservation's deadline; expiry frees the scheduler's blocks
    clock = Clock()
    s = make()
    ledger = Ledger(
        lambda e: s.release_reservation(e.request_id, FinishReason.ERROR),
        default_lease_s=5.0,
        clock=clock,
        exclusive_blocks=False,
    )
    r = seq("r", 10)
    res = s.reserve(r)
    entry = ledger.reserve("r", res.block_ids)
    assert res.block_ids == [0, 1, 2] and entry.deadline == 5.0
    clock.t = 4.9
    assert ledger.sweep() == []
    clock.t = 5.0
    [gone] = ledger.sweep()
    assert gone.request_id == "r" and r.finish_reason is FinishReason.ERROR
    assert s.pool.num_free_blocks == 32
    s.check_integrity()


def test_quarantined_reservation_holds_blocks_but_no_slot():
    s = make(max_num_seqs=1)
    res = s.reserve(seq("q", 10))
    with pytest.raises(NoCapacity):
        s.reserve(seq("x", 4))
    s.quarantine("q")
    assert s.awaiting_kv == {} and list(s.quarantined) == ["q"]
    assert s.pool.num_free_blocks == 32 - len(res.block_ids)
    s.reserve(seq("x", 4))  # the quarantined one holds no sequence slot
    s.check_integrity()
    assert s.release_reservation("q").finish_reason is FinishReason.ABORT
    assert s.pool.num_free_blocks == 31
    s.check_integrity()


def test_reservation_landing_makes_the_sequence_decode():
    s = make()
    s.reserve(seq("r", 6, max_tokens=4))
    assert step(s).plan.works() == []  # not runnable until landed
    s.mark_landed("r", 42)
    out = step(s)
    assert shape(out) == [("r", 6, 1, True)]  # decodes the remotely sampled token
    assert s.running[0].output_ids == [42, 7]


def test_reservation_reuses_cached_prefix_and_respects_capacity():
    s = make(num_blocks=4)
    s.add(seq("a", 8, max_tokens=1, first_tok=100))
    step(s)  # 2 full blocks cached-free
    queries, hits = s.pool.queries, s.pool.hits
    res = s.reserve(seq("b", 10, first_tok=100))
    assert res.num_cached_tokens == 8 and res.block_ids[:2] == [0, 1] and len(res.block_ids) == 3
    # the lookup counts in the prefix-cache metrics as a local admission's does
    assert (s.pool.queries - queries, s.pool.hits - hits) == (10, 8)
    with pytest.raises(NoCapacity):
        s.reserve(seq("c", 10, first_tok=500))
    assert (s.pool.queries - queries, s.pool.hits - hits) == (10, 8)  # a refused one is not counted
    s.check_integrity()


def test_release_reservation_is_idempotent():
    s = make()
    s.reserve(seq("r", 5))
    assert s.release_reservation("r") is not None
    assert s.release_reservation("r") is None
    s.check_integrity()


def test_stop_conditions_eos_min_tokens_and_length():
    s = make()
    s.add(seq("eos", 3, max_tokens=10))
    s.add(seq("min", 3, max_tokens=10, min_tokens=2))
    out = step(s, token=2)  # 2 is EOS
    eos = next(x for x, _ in out.scheduled if x.seq_id == "eos")
    assert eos.finish_reason is FinishReason.STOP
    mn = next(x for x, _ in out.scheduled if x.seq_id == "min")
    assert not mn.is_finished
    assert out.plan.works()[1].sample.banned_ids == (2,)  # EOS banned before min_tokens
    s.add(seq("len", 3, max_tokens=2, ignore_eos=True))
    step(s, token=2)
    step(s, token=2)
    assert s.running == []


def test_validation_errors():
    s = make(num_blocks=4)
    with pytest.raises(AdmissionError, match="fewer than 64"):
        s.add(seq("long", 64))
    with pytest.raises(AdmissionError, match="KV blocks"):
        s.add(seq("big", 20))
    with pytest.raises(AdmissionError, match="empty"):
        s.add(seq("empty", 0))


def test_static_policy_admits_only_when_idle():
    s = make(policy="static")
    s.add(seq("a", 3, max_tokens=3))
    step(s)
    s.add(seq("b", 3, max_tokens=1))
    out = step(s)
    assert [w.seq_id for w in out.plan.works()] == ["a"]  # b waits for the batch to drain
    step(s)  # a finishes
    out = step(s)
    assert [w.seq_id for w in out.plan.works()] == ["b"]


def test_a_plain_decode_keeps_one_sample_row_and_min_tokens_bans_eos_until_reached():
    s = make()
    a = seq("a", 3, max_tokens=10, min_tokens=3)  # EOS (2) banned for its first 3 tokens
    b = seq("b", 3, max_tokens=10)
    s.add(a)
    s.add(b)
    rows = {"a": [], "b": []}
    for _ in range(6):
        out = step(s, token=9)
        for w in out.plan.works():
            rows[w.seq_id].append(w.sample)
    # a: its first token and the next two steps ban EOS, each with a row of its own
    assert [r.banned_ids for r in rows["a"][:3]] == [(2,), (2,), (2,)]
    assert len({id(r) for r in rows["a"][:3]}) == 3
    # then nothing is banned: the same row every step, reading the live output
    assert all(r.banned_ids == () for r in rows["a"][3:]) and len({id(r) for r in rows["a"][3:]}) == 1
    assert rows["a"][-1].output_ids is a.output_ids and len(rows["a"][-1].output_ids) == 6
    assert len({id(r) for r in rows["b"][1:]}) == 1 and rows["b"][0].banned_ids == ()
    for x in (a, b):
        s.finish(x, FinishReason.ABORT)


def test_prefill_lifecycle_hands_off_after_the_first_token_and_holds_the_blocks():
    """hand_off=True (the prefill worker): WAITING -> RUNNING -> HANDOFF -> FINISHED;
    the blocks stay held while the KV is written out, then go back (cached)."""
    s = make(hand_off=True)
    a, b = seq("a", 10), seq("b", 6)
    s.add(a)
    s.add(b)
    step(s)
    assert a.status is b.status is Status.HANDOFF and a.output_ids == b.output_ids == [7]
    assert s.running == [] and set(s.handoff) == {"a", "b"}
    assert s.pool.num_used_blocks == 3 + 2  # 10 and 6 tokens in blocks of 4
    assert shape(s.schedule()) == []  # nothing left to compute
    assert s.end_handoff("a") is a and a.status is Status.FINISHED
    assert s.end_handoff("a") is None  # idempotent
    assert s.abort("b") is b and b.finish_reason is FinishReason.ABORT and s.handoff == {}
    s.check_integrity()
