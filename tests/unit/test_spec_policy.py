"""The adaptive speculation policy (engine/spec_policy.py) on step costs of known shape."""

from __future__ import annotations

from engine.spec_policy import AdaptivePolicy, StepCost


def _policy(a: float, b: float, draft_cost: float = 0.0, alpha: float | None = None) -> AdaptivePolicy:
    p = AdaptivePolicy(4)
    for n in (1, 2, 4, 8, 16, 32, 64, 5, 9, 3) * 3:  # steps of varied size on the line a + b * n
        p.observe_step(n, a + b * n, draft_cost * 4, 4 if draft_cost else 0)
    if alpha is not None:
        p.observe_accept(100, int(alpha * 100))
    return p


def test_the_cost_model_recovers_a_line():
    c = StepCost()
    for n in (1, 3, 8, 20, 40, 64, 2, 7):
        c.observe(n, 0.002 + 0.0001 * n)
    assert c.model() is None  # one step of each size is not enough
    for n in (1, 3, 8, 20, 40, 64, 2, 7) * 2:
        c.observe(n, 0.002 + 0.0001 * n)
    a, b = c.model()
    assert abs(a - 0.002) < 1e-9 and abs(b - 0.0001) < 1e-9
    flat = StepCost()
    for _ in range(20):
        flat.observe(8, 0.01)  # one size only: no slope to see
    assert flat.model() is None
    # one slow step among many of one row does not make a slope
    one = StepCost()
    for _ in range(30):
        one.observe(1, 0.002)
    one.observe(5, 0.02)
    assert one.model() is None


def test_one_stream_with_fixed_cost_steps_speculates_fully():
    p = _policy(a=0.010, b=0.0001, alpha=0.6)
    assert p.lengths([4], [None]) == [4]
    assert p.lengths([4, 2], [0.7, 0.7]) == [4, 2]  # a cap (near max_tokens) is kept


def test_a_full_batch_of_token_bound_steps_does_not_speculate():
    p = _policy(a=0.002, b=0.001, alpha=0.6)
    assert p.lengths([4] * 64, [None] * 64) == [0] * 64
    # the same machine at one stream still speculates, if less deep
    assert 1 <= p.lengths([4], [None])[0] <= 4


def test_requests_with_poor_acceptance_drop_out_first():
    p = _policy(a=0.010, b=0.0004, alpha=0.5)
    ks = p.lengths([4] * 8, [0.95] * 4 + [0.05] * 4)
    assert all(k >= 3 for k in ks[:4]) and ks[4:] == [0] * 4


def test_draft_model_positions_cost_a_forward_each():
    cheap = _policy(a=0.010, b=0.0001, draft_cost=0.0005, alpha=0.5)
    dear = _policy(a=0.010, b=0.0001, draft_cost=0.008, alpha=0.5)
    assert cheap.lengths([4], [None])[0] > dear.lengths([4], [None])[0]


def test_not_adaptive_or_not_measured_means_k():
    assert AdaptivePolicy(4, adaptive=False).lengths([4, 3], [0.0, 0.0]) == [4, 3]
    assert AdaptivePolicy(4).lengths([4], [0.1]) == [4]  # no step measured yet
