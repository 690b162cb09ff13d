"""The drift monitor: live traffic against the profile's workload, one distance per
dimension, 1.0 meaning outside what the profile was tuned for."""

from __future__ import annotations

import math

import numpy as np
import pytest

from router.drift import DriftMonitor, ProfileError, check_reference, percentile

pytestmark = pytest.mark.unit

CHAT = {"prompt_tokens": {"p50": 60, "p90": 90}, "output_tokens": {"p50": 32, "p90": 32}, "arrival_rate": 2.0,
        "prefix_hit_rate": 0.0, "batch_share": 0.0}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def feed(mon: DriftMonitor, clock: Clock, n: int, prompt: int, output: int = 32, cached: int = 0,
         batch: bool = False, every_s: float = 0.5) -> None:
    for _ in range(n):
        clock.t += every_s
        mon.record(prompt, output, cached, batch)


def test_percentile_is_numpys():
    vals = [5, 1, 9, 3, 3, 7, 100]
    for q in (0, 10, 50, 90, 100):
        assert percentile(vals, q) == pytest.approx(float(np.percentile(vals, q)))


def test_traffic_like_the_profile_is_within_it_and_documents_are_not():
    clock = Clock()
    mon = DriftMonitor(CHAT, window_s=60, min_requests=10, clock=clock)
    assert mon.snapshot()["drift"] is None  # nothing seen yet
    feed(mon, clock, 40, prompt=60)  # 2 requests/s of 60-token chats, like the profile
    d = mon.snapshot()["drift"]
    assert d["prompt_tokens"] == pytest.approx(abs(math.log2(60 / 90)))  # p90 is 60 against 90
    assert d["output_tokens"] == 0 and d["prefix_hit_rate"] == 0 and d["batch_share"] == 0
    assert d["arrival_rate"] < 0.3 and max(d.values()) < 1
    feed(mon, clock, 130, prompt=2000, batch=True)  # the 60 s window now holds only documents
    d = mon.snapshot()["drift"]
    assert d["prompt_tokens"] == pytest.approx(math.log2(2000 / 60))  # p50 2000 against 60: 5 doublings
    assert d["batch_share"] == pytest.approx(4.0)  # 100 points over 25
    assert d["output_tokens"] == 0


def test_without_a_profile_the_first_window_is_the_reference():
    clock = Clock()
    mon = DriftMonitor(None, window_s=30, min_requests=20, clock=clock)
    feed(mon, clock, 19, prompt=100, cached=50)
    assert mon.snapshot()["reference"] is None
    feed(mon, clock, 1, prompt=100, cached=50)
    snap = mon.snapshot()
    assert snap["reference_source"] == "first traffic" and snap["reference"]["prefix_hit_rate"] == 0.5
    assert max(snap["drift"].values()) == pytest.approx(0, abs=1e-9)
    feed(mon, clock, 80, prompt=100, cached=0)  # the cache stopped helping
    assert mon.snapshot()["drift"]["prefix_hit_rate"] == pytest.approx(2.0)


def test_an_old_window_is_forgotten():
    clock = Clock()
    mon = DriftMonitor(CHAT, window_s=10, min_requests=5, clock=clock)
    feed(mon, clock, 10, prompt=60)
    clock.t += 11
    assert mon.snapshot()["live"] is None and mon.snapshot()["drift"] is None


def test_a_malformed_workload_is_refused():
    with pytest.raises(ProfileError, match="batch_share: Field required"):
        check_reference({k: v for k, v in CHAT.items() if k != "batch_share"})
    with pytest.raises(ProfileError, match=r"output_tokens\.p50: Input should be greater than 0"):
        check_reference({**CHAT, "output_tokens": {"p50": 0, "p90": 1}})
    with pytest.raises(ProfileError, match="prompt_tokens: Input should be a valid dictionary"):
        check_reference({**CHAT, "prompt_tokens": 60})
    with pytest.raises(ProfileError, match="batch_share: Input should be less than or equal to 1"):
        check_reference({**CHAT, "batch_share": 2})


def test_a_busy_window_keeps_the_latest_requests_and_their_rate(monkeypatch):
    monkeypatch.setattr(DriftMonitor, "MAX_SAMPLES", 50)
    clock = Clock()
    mon = DriftMonitor(CHAT, window_s=600, min_requests=10, clock=clock)
    feed(mon, clock, 200, prompt=60, every_s=0.1)  # 10 requests/s, more than the 50 kept
    live = mon.snapshot()["live"]
    assert live["requests"] == 50 and live["arrival_rate"] == pytest.approx(10, rel=0.05)
