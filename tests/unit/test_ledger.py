"""The handoff ledger: every transition, leases, exactly-once frees, dead peers."""

from __future__ import annotations

import itertools

import pytest

from kv_transfer.ledger import (
    ALLOWED,
    Entry,
    HandoffState,
    IllegalTransition,
    Ledger,
    LedgerError,
    UnknownRequest,
)

pytestmark = pytest.mark.unit

S = HandoffState


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def freed() -> list[Entry]:
    return []


@pytest.fixture
def ledger(clock: Clock, freed: list[Entry]) -> Ledger:
    return Ledger(on_free=freed.append, default_lease_s=10.0, clock=clock)


# How to drive a fresh entry into each state, and each transition by target.
PATHS = {
    S.RESERVED: [],
    S.WRITING: ["start_writing"],
    S.READY: ["start_writing", "mark_ready"],
    S.RUNNING: ["mark_ready", "start_running"],
}
MOVES = {
    S.WRITING: lambda lg, rid: lg.start_writing(rid),
    S.READY: lambda lg, rid: lg.mark_ready(rid),
    S.RUNNING: lambda lg, rid: lg.start_running(rid),
    S.DONE: lambda lg, rid: lg.finish(rid),
    S.FAILED: lambda lg, rid: lg.fail(rid, "boom"),
}


def reach(lg: Ledger, rid: str, state: HandoffState, blocks=(1, 2)) -> Entry:
    lg.reserve(rid, blocks, peer="p@1")
    for step in PATHS[state]:
        getattr(lg, step)(rid)
    entry = lg.get(rid)
    assert entry is not None and entry.state is state
    return entry


@pytest.mark.parametrize("src,dst", [(a, b) for a in PATHS for b in MOVES], ids=lambda s: s.name)
def test_every_transition_is_allowed_or_named(ledger: Ledger, freed: list[Entry], src, dst) -> None:
    reach(ledger, "r1", src)
    if dst in ALLOWED[src]:
        entry = MOVES[dst](ledger, "r1")
        assert entry.state is dst
        assert freed == ([entry] if dst.terminal else [])
    else:
        with pytest.raises(IllegalTransition, match=rf"'r1': {src.name} -> {dst.name}"):
            MOVES[dst](ledger, "r1")
        assert ledger.get("r1").state is src
    ledger.check_integrity()


def test_happy_paths_of_both_sides(ledger: Ledger, freed: list[Entry]) -> None:
    ledger.reserve("decode", [3, 4], peer="prefill-0@a")  # receiver never sees WRITING
    ledger.mark_ready("decode")
    ledger.start_running("decode")
    ledger.finish("decode")
    ledger.reserve("prefill", [7], peer="decode-0@b")
    ledger.start_writing("prefill")
    ledger.mark_ready("prefill")
    ledger.finish("prefill")
    assert [(e.request_id, e.blocks, e.state) for e in freed] == [
        ("decode", (3, 4), S.DONE),
        ("prefill", (7,), S.DONE),
    ]
    assert len(ledger) == 0
    ledger.check_integrity()


def test_terminal_sequences_free_exactly_once(clock: Clock) -> None:
    ops = {
        "finish": lambda lg: lg.finish("r"),
        "fail": lambda lg: lg.fail("r", "x"),
        "release": lambda lg: lg.release("r"),
        "expire": lambda lg: lg.sweep(clock.t + 1000),
        "drop": lambda lg: lg.drop_peer("p@1"),
    }
    for seq in itertools.permutations(ops, 3):
        freed: list[Entry] = []
        lg = Ledger(on_free=freed.append, default_lease_s=10.0, clock=clock)
        reach(lg, "r", S.READY)
        for name in seq:
            ops[name](lg)
        assert len(freed) == 1, seq
        first = {"finish": S.DONE, "expire": S.EXPIRED}.get(seq[0], S.FAILED)
        assert lg.get("r").state is first, seq
        lg.check_integrity()


def test_failure_reasons_are_recorded(ledger: Ledger) -> None:
    reach(ledger, "a", S.WRITING)
    ledger.fail("a", "prefill worker died")
    assert ledger.get("a").reason == "prefill worker died"
    reach(ledger, "b", S.RESERVED, blocks=[9])
    assert ledger.release("b", "client disconnected").reason == "released: client disconnected"
    ledger.finish("b")  # no-op, the first reason stays
    assert ledger.get("b").state is S.FAILED
    reach(ledger, "c", S.RESERVED, blocks=[10])
    with pytest.raises(ValueError, match="needs a reason"):
        ledger.fail("c", "")


def test_lease_expiry_and_renewal(ledger: Ledger, clock: Clock, freed: list[Entry]) -> None:
    reach(ledger, "slow", S.RESERVED, blocks=[1])
    ledger.reserve("short", [2], lease_s=2.0)
    clock.t += 5
    ledger.start_writing("slow")  # every leased transition renews the lease
    expired = ledger.sweep()
    assert [e.request_id for e in expired] == ["short"]
    assert expired[0].state is S.EXPIRED and "2 s ran out in state RESERVED" in expired[0].reason
    clock.t += 9.9
    assert ledger.sweep() == []
    ledger.extend("slow", lease_s=1.0)
    assert ledger.sweep(clock.t + 1.0)[0].request_id == "slow"
    assert [e.request_id for e in freed] == ["short", "slow"]
    ledger.check_integrity()


def test_running_holds_no_lease(ledger: Ledger, clock: Clock) -> None:
    reach(ledger, "r", S.RUNNING)
    assert ledger.get("r").deadline is None
    assert ledger.sweep(clock.t + 1e6) == []
    with pytest.raises(IllegalTransition, match="extend a lease in state RUNNING"):
        ledger.extend("r")


def test_late_notification_after_expiry_is_illegal(ledger: Ledger, clock: Clock) -> None:
    reach(ledger, "r", S.RESERVED)
    ledger.sweep(clock.t + 11)
    with pytest.raises(IllegalTransition, match=r"'r': EXPIRED -> READY .*ran out"):
        ledger.mark_ready("r")


def test_drop_peer_fails_only_that_incarnation(ledger: Ledger, freed: list[Entry]) -> None:
    ledger.reserve("a", [1], peer="p@old")
    ledger.reserve("b", [2], peer="p@old")
    ledger.mark_ready("b")
    ledger.reserve("c", [3], peer="p@new")
    dropped = ledger.drop_peer("p@old")
    assert sorted(e.request_id for e in dropped) == ["a", "b"]
    assert all(e.state is S.FAILED and "p@old" in e.reason for e in dropped)
    assert ledger.get("c").state is S.RESERVED and ledger.drop_peer("p@old") == []
    assert len(freed) == 2
    ledger.check_integrity()


def test_blocks_are_exclusive_and_reusable(ledger: Ledger) -> None:
    ledger.reserve("a", [1, 2])
    with pytest.raises(LedgerError, match="block 2 is held by request 'a'"):
        ledger.reserve("b", [2, 3])
    ledger.release("a")
    ledger.reserve("b", [2, 3])
    ledger.check_integrity()
    shared = Ledger(on_free=lambda e: None, exclusive_blocks=False)
    shared.reserve("x", [5])
    shared.reserve("y", [5])  # prefix-cached source blocks may be shared
    shared.check_integrity()


def test_retry_reuses_a_finished_request_id(ledger: Ledger, freed: list[Entry]) -> None:
    reach(ledger, "r", S.WRITING)
    ledger.fail("r", "transfer failed")
    ledger.reserve("x", [8])
    with pytest.raises(LedgerError, match="already live"):
        ledger.reserve("x", [9])
    entry = ledger.reserve("r", [5])
    assert entry.state is S.RESERVED and ledger.get("r") is entry
    ledger.check_integrity()


def test_unknown_request(ledger: Ledger) -> None:
    with pytest.raises(UnknownRequest, match="'nope' is not in the ledger"):
        ledger.finish("nope")


def test_a_raising_free_callback_does_not_free_twice(clock: Clock) -> None:
    calls = []

    def on_free(entry: Entry) -> None:
        calls.append(entry.request_id)
        raise RuntimeError("pool is broken")

    lg = Ledger(on_free=on_free, clock=clock)
    lg.reserve("r", [1])
    with pytest.raises(RuntimeError, match="pool is broken"):
        lg.release("r")
    lg.fail("r", "again")
    lg.sweep(clock.t + 1e6)
    assert calls == ["r"]
    lg.check_integrity()


def test_history_is_bounded(clock: Clock) -> None:
    lg = Ledger(on_free=lambda e: None, clock=clock, history=3)
    for i in range(5):
        lg.reserve(f"r{i}", [i])
        lg.release(f"r{i}")
    assert lg.get("r0") is None and lg.get("r4").state is S.FAILED
    lg.check_integrity()


def test_check_integrity_catches_corruption(ledger: Ledger) -> None:
    entry = reach(ledger, "r", S.READY)
    entry.deadline = None
    with pytest.raises(LedgerError, match="in READY has deadline None"):
        ledger.check_integrity()


# ---- quarantine (the decode side) ------------------------------------------------------


def quarantining(clock: Clock, freed: list[Entry], quarantined: list[str]) -> Ledger:
    return Ledger(freed.append, default_lease_s=5.0, clock=clock, quarantine_s=30.0,
                  on_quarantine=lambda e: quarantined.append(e.request_id))


def test_a_failed_unlanded_reservation_is_quarantined_until_the_writer_is_done(clock, freed) -> None:
    quarantined: list[str] = []
    ledger = quarantining(clock, freed, quarantined)
    ledger.reserve("r", [1, 2])
    entry = ledger.fail("r", "aborted")
    assert entry.state is S.QUARANTINED and entry.reason == "aborted" and entry.deadline == 130.0
    assert quarantined == ["r"] and freed == []  # the request ended; the blocks did not
    assert ledger.fail("r", "again") is entry and quarantined == ["r"]  # idempotent
    assert ledger.count(S.RESERVED) == 0 and ledger.count(S.QUARANTINED) == 1
    ledger.check_integrity()
    ledger.writer_done("r")
    assert entry.state is S.FAILED and entry.reason == "aborted" and freed == [entry]
    ledger.writer_done("r")
    assert freed == [entry]
    ledger.check_integrity()


def test_an_expired_reservation_is_quarantined_then_freed_when_the_quarantine_ends(clock, freed) -> None:
    quarantined: list[str] = []
    ledger = quarantining(clock, freed, quarantined)
    ledger.reserve("r", [1])
    clock.t = 105.0
    [ended] = ledger.sweep()
    assert ended.state is S.QUARANTINED and "lease of 5 s ran out" in ended.reason and quarantined == ["r"]
    clock.t = 134.9
    assert ledger.sweep() == [] and freed == []
    clock.t = 135.0
    assert ledger.sweep() == []  # the quarantine's end is not a request's end
    assert freed == [ended] and ended.state is S.EXPIRED
    ledger.check_integrity()


def test_a_writer_that_gave_up_frees_at_once_and_a_landed_request_is_never_quarantined(clock, freed) -> None:
    quarantined: list[str] = []
    ledger = quarantining(clock, freed, quarantined)
    ledger.reserve("gave-up", [1])
    ledger.fail("gave-up", "prefill worker gave up", writer_done=True)
    ledger.reserve("landed", [2])
    ledger.mark_ready("landed")
    ledger.start_running("landed")
    ledger.fail("landed", "aborted")
    assert [e.request_id for e in freed] == ["gave-up", "landed"] and quarantined == []
    assert all(e.state is S.FAILED for e in freed)
    ledger.check_integrity()


def test_the_prefill_side_has_no_quarantine(clock, freed) -> None:
    ledger = Ledger(freed.append, default_lease_s=5.0, clock=clock)
    ledger.reserve("r", [1])
    ledger.start_writing("r")
    assert ledger.fail("r", "peer gone").state is S.FAILED and len(freed) == 1
