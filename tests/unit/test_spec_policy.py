"""The adaptive speculation policy (engine/spec_policy.py): the measured on/off choice
per batch size, and each request's draft depth from its acceptance."""

from __future__ import annotations

import pytest

from engine.spec_policy import AdaptivePolicy, ModeChooser

pytestmark = pytest.mark.unit


def _feed(c: ModeChooser, batch: int, on_rate: float, off_rate: float, steps: int) -> list[bool]:
    """Run `steps` steps at `batch` whose speed is on_rate or off_rate tokens/s."""
    seen = []
    for _ in range(steps):
        spec = c.choose(batch)
        c.observe(int(on_rate if spec else off_rate), 1.0)
        seen.append(spec)
    return seen


def test_the_chooser_tries_both_then_keeps_the_faster_and_keeps_checking():
    c = ModeChooser()
    n = c.MIN_PAIRS
    seen = _feed(c, 1, on_rate=900, off_rate=300, steps=n + 1)
    assert seen == [True, False] * (n // 2) + [True] and c.choice(1) is True  # alternating: n pairs
    later = _feed(c, 1, on_rate=900, off_rate=300, steps=4 * c.EXPLORE_EVERY)
    assert later.count(False) == 4  # one step in EXPLORE_EVERY runs the other choice
    # the other way round in another bucket, decided on its own
    _feed(c, 64, on_rate=3000, off_rate=4000, steps=n + 10)
    assert c.choice(64) is False and c.choice(40) is False and c.choice(1) is True
    # when the text changes and speculating starts to pay, the exploration finds it
    _feed(c, 64, on_rate=6000, off_rate=4000, steps=8 * c.EXPLORE_EVERY)
    assert c.choice(64) is True


def test_pairs_are_immune_to_drift():
    # every step gets 1% slower, whatever the mode; speculating is 5% faster than not
    c = ModeChooser()
    speed = 1000.0
    for _ in range(400):
        spec = c.choose(16)
        c.observe(int(speed * (1.05 if spec else 1.0)), 1.0)
        speed *= 0.99
    assert c.choice(16) is True


def test_steps_that_are_not_plain_decodes_teach_nothing():
    p = AdaptivePolicy(4)
    p.lengths([4], [0.9])
    p.observe_step(5, 1.0, decode_only=False)
    assert p.chooser.buckets[1] == [0.0, 0, None]


def test_depth_follows_acceptance_and_caps():
    p = AdaptivePolicy(4)
    assert p.lengths([4, 4, 4, 2], [0.9, 0.5, p.ALPHA_FLOOR, 0.9]) == [4, 2, 1, 2]
    assert AdaptivePolicy(4, adaptive=False).lengths([4, 3], [0.2, 0.2]) == [4, 3]


def test_a_bucket_that_chose_off_drafts_nothing():
    p = AdaptivePolicy(4)
    _feed(p.chooser, 8, on_rate=100, off_rate=200, steps=20)  # the next step is not an exploring one
    assert p.lengths([4] * 8, [0.9] * 8) == [0] * 8


def test_acceptance_is_smoothed_toward_the_engine_and_floored():
    p = AdaptivePolicy(4)
    assert abs(p.alpha - p.prior_alpha) < 1e-9  # nothing verified yet
    p.observe_accept(100, 80)
    assert 0.75 < p.alpha < 0.8
    assert p.seq_alpha(0, 0) == p.alpha  # a new request starts at the engine's rate
    assert p.seq_alpha(20, 0) == p.ALPHA_FLOOR  # failing drafts: the floor, never 0
    assert 0.9 < p.seq_alpha(40, 40) < 1.0
