"""Admission's Retry-After: an estimate from the rate slots were given back, not a
constant (a client told "1 s" while the queue wait is 30 s retries thirty times)."""

from __future__ import annotations

import asyncio

import pytest

from router.admission import Admission
from router.errors import ApiError

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def test_retry_after_follows_the_rate_slots_are_freed():
    clock = Clock()
    adm = Admission(max_running=1, max_waiting=2, timeout_s=30, retry_after_s=1, clock=clock)
    with pytest.raises(ApiError):  # fill: 1 running, 2 queued, the 4th is refused
        await asyncio.gather(*(adm.acquire(1) for _ in range(4)))
    # nothing was given back yet: nothing to go on, so the queue timeout
    assert adm.retry_after(1) == 30
    for _ in range(2):  # a slot freed every 10 s: 0.1 slot/s
        clock.t += 10
        adm.release(1)
        await asyncio.sleep(0)
    assert adm.running == 1 and adm.waiting == 0
    waiters = [asyncio.ensure_future(adm.acquire(1)) for _ in range(2)]
    await asyncio.sleep(0)
    assert adm.waiting == 2
    with pytest.raises(ApiError) as full:
        await adm.acquire(1)
    # 2 queued ahead + this one, at 2 slots freed over the 20 s since start: 30 s
    assert full.value.status == 429 and full.value.headers["Retry-After"] == "30"
    clock.t += 5  # 2 slots over 25 s: 37.5 s
    assert adm.retry_after(1) == pytest.approx(37.5)
    for _ in range(3):  # a burst of releases: the estimate drops, never under retry_after_s
        adm.release(1)
        await asyncio.sleep(0)
    assert adm.retry_after(1) == pytest.approx(1 / (5 / 25))
    clock.t += 61  # the window forgets old releases
    assert adm.retry_after(1) == 30
    await asyncio.gather(*waiters)


async def test_503_after_the_queue_timeout_carries_the_estimate():
    clock = Clock()
    adm = Admission(max_running=2, max_waiting=4, timeout_s=0.05, retry_after_s=1, clock=clock)
    await adm.acquire(2)
    clock.t += 8
    adm.release(2)  # 2 slots over 8 s: 0.25 slot/s
    await adm.acquire(2)
    with pytest.raises(ApiError) as late:
        await adm.acquire(2)  # nobody gives back: times out; 2 slots at 0.25/s
    assert late.value.status == 503 and late.value.headers["Retry-After"] == "8"
    assert (adm.running, adm.waiting) == (2, 0)
