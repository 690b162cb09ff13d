"""Admission's Retry-After: an estimate from the rate slots were given back, not a
constant (a client told "1 s" while the queue wait is 30 s retries thirty times)."""

from __future__ import annotations

import asyncio

import pytest

from router.admission import BATCH, INTERACTIVE, Admission
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
    # the queue is full: room for this one comes with the next slot given back, at 2 slots
    # over the 20 s something ran: 10 s (not the 30 s the whole queue ahead would take)
    assert full.value.status == 429 and full.value.headers["Retry-After"] == "10"
    clock.t += 5  # behind the 2 queued, at 2 slots over 25 s: 37.5 s
    assert adm.retry_after(1) == pytest.approx(37.5)
    for _ in range(3):  # a burst of releases: the estimate drops, never under retry_after_s
        adm.release(1)
        await asyncio.sleep(0)
    assert adm.retry_after(1) == pytest.approx(1 / (5 / 25))
    clock.t += 61  # the window forgets old releases
    assert adm.retry_after(1) == 30
    await asyncio.gather(*waiters)


async def test_a_burst_after_a_quiet_minute_is_judged_by_its_own_drain_rate():
    """An idle router does not dilute a burst's rate with the minutes nothing ran."""
    clock = Clock()
    adm = Admission(max_running=4, max_waiting=4, timeout_s=30, retry_after_s=1, clock=clock)
    clock.t += 600  # ten quiet minutes
    held = [await adm.acquire(1) for _ in range(4)]
    waiters = [asyncio.ensure_future(adm.acquire(1)) for _ in range(4)]
    await asyncio.sleep(0)
    for _ in range(4):  # 2 slots a second: one every 0.5 s
        clock.t += 0.5
        adm.release(1)
        await asyncio.sleep(0)
    assert adm.drain_rate() == pytest.approx(2.0)
    more = [asyncio.ensure_future(adm.acquire(1)) for _ in range(4)]
    await asyncio.sleep(0)
    with pytest.raises(ApiError) as full:
        await adm.acquire(1)
    assert full.value.status == 429 and full.value.headers["Retry-After"] == "1"  # 0.5 s, at least 1
    for _ in range(8):
        adm.release(1)
    await asyncio.gather(*waiters, *more)
    assert held == [1, 1, 1, 1]


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


# ---- traffic classes: interactive first, batch never starved -------------------------

async def _queue(adm: Admission, names_classes: list[tuple[str, int]], clock: Clock, order: list[str]):
    """Queue one waiter per (name, class), one second apart; each appends its name to
    `order` when admitted and gives its slot back."""
    async def one(name: str, cls: int) -> None:
        await adm.acquire(1, cls)
        order.append(name)

    tasks = []
    for name, cls in names_classes:
        tasks.append(asyncio.ensure_future(one(name, cls)))
        await asyncio.sleep(0)
        clock.t += 1
    return tasks


async def _drain(adm: Admission, tasks, order: list[str]) -> None:
    while not all(t.done() for t in tasks):
        before = len(order)
        adm.release(1)
        for _ in range(3):
            await asyncio.sleep(0)
        assert len(order) == before + 1  # exactly one admitted per slot given back
    await asyncio.gather(*tasks)


async def test_priority_order_serves_interactive_before_batch_that_came_first():
    clock = Clock()
    adm = Admission(max_running=1, max_waiting=10, timeout_s=30, retry_after_s=1, clock=clock, aging_s=10)
    await adm.acquire(1)  # the one slot is taken: everyone below queues
    order: list[str] = []
    tasks = await _queue(adm, [("b1", BATCH), ("b2", BATCH), ("i1", INTERACTIVE), ("i2", INTERACTIVE)], clock, order)
    assert adm.waiting_by_class == [2, 2] and adm.waiting == 4
    await _drain(adm, tasks, order)
    assert order == ["i1", "i2", "b1", "b2"]
    assert adm.waiting_by_class == [0, 0] and adm.running == 1


async def test_fifo_order_is_arrival_order_across_classes():
    clock = Clock()
    adm = Admission(max_running=1, max_waiting=10, timeout_s=30, retry_after_s=1, clock=clock, order="fifo")
    await adm.acquire(1)
    order: list[str] = []
    tasks = await _queue(adm, [("b1", BATCH), ("i1", INTERACTIVE), ("b2", BATCH), ("i2", INTERACTIVE)], clock, order)
    await _drain(adm, tasks, order)
    assert order == ["b1", "i1", "b2", "i2"]


async def test_a_batch_request_is_not_starved_by_a_stream_of_interactive_ones():
    """With aging 3 s, b (queued at t=0) goes before every interactive request that
    arrived after t=3, however many keep coming."""
    clock = Clock()
    adm = Admission(max_running=1, max_waiting=100, timeout_s=300, retry_after_s=1, clock=clock, aging_s=3)
    await adm.acquire(1)
    order: list[str] = []
    tasks = await _queue(adm, [("b", BATCH)] + [(f"i{k}", INTERACTIVE) for k in range(1, 8)], clock, order)
    await _drain(adm, tasks, order)
    # i1 came at t=1, i2 at t=2 (before b's place, 0 + 3), i3 at t=3 (a tie: b first)
    assert order == ["i1", "i2", "b", "i3", "i4", "i5", "i6", "i7"]


async def test_an_interactive_request_is_admitted_at_once_past_queued_batch_work():
    clock = Clock()
    adm = Admission(max_running=2, max_waiting=10, timeout_s=30, retry_after_s=1, clock=clock, aging_s=10)
    await adm.acquire(1)
    big = asyncio.ensure_future(adm.acquire(2, BATCH))  # needs both slots: waits
    await asyncio.sleep(0)
    assert adm.waiting_by_class == [0, 2]
    clock.t += 1
    await asyncio.wait_for(adm.acquire(1, INTERACTIVE), 1)  # fits, and its place is ahead of the batch head
    assert adm.running == 2
    clock.t += 20  # now the batch head is due: a later interactive request queues behind it
    late = asyncio.ensure_future(adm.acquire(1, INTERACTIVE))
    await asyncio.sleep(0)
    assert adm.waiting_by_class == [1, 2]
    adm.release(1)
    await asyncio.sleep(0)
    assert not big.done()  # one slot free, the head needs two: nobody overtakes it
    adm.release(1)
    await asyncio.wait_for(big, 1)
    assert not late.done()
    adm.release(2)
    await asyncio.wait_for(late, 1)
    assert adm.waiting == 0 and adm.waiting_by_class == [0, 0]


async def test_a_cancelled_waiter_leaves_its_class_queue_and_counts():
    clock = Clock()
    adm = Admission(max_running=1, max_waiting=10, timeout_s=30, retry_after_s=1, clock=clock)
    await adm.acquire(1)
    w = asyncio.ensure_future(adm.acquire(1, BATCH))
    await asyncio.sleep(0)
    assert adm.waiting_by_class == [0, 1]
    w.cancel()
    await asyncio.gather(w, return_exceptions=True)
    assert adm.waiting == 0 and adm.waiting_by_class == [0, 0]


def test_an_unknown_order_is_refused():
    with pytest.raises(ValueError, match="priority, fifo"):
        Admission(1, 1, 1, 1, order="lifo")


async def test_admission_queue_full_then_timeout():
    adm = Admission(max_running=2, max_waiting=2, timeout_s=0.2, retry_after_s=3)
    assert [await adm.acquire(1), await adm.acquire(1)] == [1, 1]
    waiter = asyncio.ensure_future(adm.acquire(2))
    await asyncio.sleep(0)
    assert (adm.running, adm.waiting) == (2, 2)
    with pytest.raises(ApiError) as full:
        await adm.acquire(1)
    assert full.value.status == 429 and full.value.headers["Retry-After"] == "3"
    with pytest.raises(ApiError) as late:
        await waiter
    assert late.value.status == 503 and (adm.running, adm.waiting) == (2, 0)
    waiter = asyncio.ensure_future(adm.acquire(5))  # more than max_running: runs alone
    await asyncio.sleep(0)
    adm.release(1)
    adm.release(1)
    assert await waiter == 2 and (adm.running, adm.waiting) == (2, 0)


async def test_a_full_queue_refuses_before_the_request_is_parsed():
    """`refuse_if_full` (called before the body is parsed or tokenized) answers the same
    429 as `acquire` once nothing could be queued, and nothing before that."""
    adm = Admission(max_running=1, max_waiting=1, timeout_s=30, retry_after_s=1)
    adm.refuse_if_full()  # empty
    await adm.acquire(1)
    adm.refuse_if_full()  # running full, the queue has room
    queued = asyncio.ensure_future(adm.acquire(1))
    await asyncio.sleep(0)
    with pytest.raises(ApiError) as early:
        adm.refuse_if_full()
    with pytest.raises(ApiError) as late:
        await adm.acquire(1)
    assert early.value.status == late.value.status == 429
    assert early.value.headers["Retry-After"] == late.value.headers["Retry-After"]
    adm.release(1)
    await queued
    adm.refuse_if_full()  # the queued one runs now: room in the queue again
