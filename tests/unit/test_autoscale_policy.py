"""The autoscaler's policy on its own: which pool grows or shrinks, when, and why."""

from __future__ import annotations

import pytest

from controller.autoscale import AutoscaleConfig, Autoscaler, WorkerLoad
from worker_runtime.config import Role
from worker_runtime.membership import RouterReport

pytestmark = pytest.mark.unit

P, D = Role.PREFILL, Role.DECODE
CFG = AutoscaleConfig(min_prefill=1, max_prefill=3, min_decode=1, max_decode=3, up_after_s=10, down_after_s=60,
                      cooldown_s=30, min_samples=5)


def decode(kv=0.1, running=1, waiting=0, seqs=8) -> WorkerLoad:
    return WorkerLoad(kv, running, waiting, seqs, 0)


def prefill(tokens=0) -> WorkerLoad:
    return WorkerLoad(0.0, 0, 0, 8, tokens)


def run(a: Autoscaler, times, targets, workers, reports=(), starting=None):
    out = []
    for t in times:
        for d in a.step(t, targets, starting or {}, workers, list(reports)):
            out.append((t, d.role, d.before, d.after, d.reason))
            targets[d.role] = d.after
    return out


def test_a_full_kv_cache_grows_decode_after_the_hysteresis_then_waits_out_the_cooldown():
    a = Autoscaler(CFG)
    targets = {P: 1, D: 1}
    workers = {P: [prefill()], D: [decode(kv=0.9)]}
    out = run(a, range(0, 45, 2), targets, workers)
    assert [(t, r, b, n) for t, r, b, n, _ in out] == [(10, D, 1, 2), (40, D, 2, 3)]  # +1 at 10 s, next after 30 s
    assert out[0][4] == "KV usage 90% at or over 85% (busy 100% of the last 10 s)"
    assert run(a, range(46, 200, 2), targets, workers) == []  # at the max: stays


def test_sequences_waiting_in_the_engine_or_tpot_misses_grow_decode():
    assert run(Autoscaler(CFG), range(0, 12, 2), {P: 1, D: 1}, {D: [decode(waiting=4, running=8)]})[0][1:4] == (D, 1, 2)
    misses = [RouterReport(tpot_met=2, tpot_total=10, ttft_met=10, ttft_total=10)]
    out = run(Autoscaler(CFG), range(0, 12, 2), {P: 1, D: 1}, {D: [decode()]}, misses)
    assert out[0][1:4] == (D, 1, 2) and out[0][4].startswith("TPOT attainment 20% under 90%")


def test_a_router_queue_or_ttft_misses_grow_prefill_disaggregated_and_decode_colocated():
    queue = [RouterReport(waiting=12, oldest_wait_s=3.5)]
    out = run(Autoscaler(CFG), range(0, 12, 2), {P: 1, D: 1}, {P: [prefill()], D: [decode()]}, queue)
    assert [(r, b, n) for _, r, b, n, _ in out] == [(P, 1, 2)]
    assert out[0][4].startswith("12 requests waiting in the routers' queues (oldest 3.5 s)")
    colo = Autoscaler(AutoscaleConfig(min_prefill=0, max_prefill=0, up_after_s=10, min_samples=5), colocated=True)
    out = run(colo, range(0, 12, 2), {P: 0, D: 1}, {D: [decode()]}, queue)
    assert [(r, b, n) for _, r, b, n, _ in out] == [(D, 1, 2)]


def test_too_few_samples_say_nothing_about_attainment():
    few = [RouterReport(ttft_met=0, ttft_total=4, tpot_met=0, tpot_total=4)]
    assert run(Autoscaler(CFG), range(0, 30, 2), {P: 1, D: 1}, {P: [prefill()], D: [decode()]}, few) == []


def _flicker(a: Autoscaler, busy_ticks_of_5: int, until: int) -> list:
    """A queue that is there on `busy_ticks_of_5` of every 5 ticks (2 s apart)."""
    targets, out = {P: 1, D: 1}, []
    for t in range(0, until, 2):
        w = decode(waiting=3) if (t // 2) % 5 < busy_ticks_of_5 else decode(kv=0.5)
        out += run(a, [t], targets, {D: [w]})
    return out


def test_a_pool_busy_on_most_ticks_grows_though_its_queue_empties_now_and_then():
    assert run(Autoscaler(CFG), range(0, 8, 2), {P: 1, D: 1}, {D: [decode(kv=0.95)]}) == []  # under 10 s
    out = _flicker(Autoscaler(CFG), 3, 40)  # busy 60% of the time
    assert out and out[0][1:4] == (D, 1, 2) and "(busy 60% of the last 10 s)" in out[0][4]
    assert _flicker(Autoscaler(CFG), 2, 60) == []  # 40%: not enough


def test_idle_pools_shrink_after_down_after_s_to_their_minimum():
    a = Autoscaler(CFG)
    targets = {P: 3, D: 3}
    workers = {P: [prefill()] * 3, D: [decode(kv=0.0, running=0)] * 3}
    out = run(a, range(0, 200, 5), targets, workers)
    # the idle clock starts over after a change (at the next tick, 65 s)
    assert [(t, r, n) for t, r, _, n, _ in out] == [(60, P, 2), (60, D, 2), (125, P, 1), (125, D, 1)]
    assert out[0][4] == "idle for 60 s"


def test_no_decision_while_workers_are_starting_and_targets_return_within_bounds():
    a = Autoscaler(CFG)
    assert run(a, range(0, 30, 2), {P: 1, D: 1}, {D: [decode(kv=0.95)]}, starting={D: 1}) == []
    out = run(Autoscaler(CFG), [0], {P: 1, D: 5}, {D: [decode()]})
    assert [(r, b, n, why) for _, r, b, n, why in out] == [(D, 5, 3, "outside [1, 3]")]


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="--min-decode"):
        AutoscaleConfig(min_decode=0)
    with pytest.raises(ValueError, match="--min-prefill <= --max-prefill"):
        AutoscaleConfig(min_prefill=3, max_prefill=2)
