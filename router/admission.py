"""Admission control in the router: a weighted limit on engine requests, with a queue
ordered by traffic class.

An HTTP request asks for `weight` slots (its prompts x n engine requests) at once, so
a request never holds part of what it needs while waiting for the rest:

    running + weight <= max_running   -> admitted now (if nobody waits ahead of it)
    waiting + weight <= max_waiting   -> queued, for at most `timeout_s` (then 503)
    otherwise                         -> 429 at once

Who is ahead: each class (INTERACTIVE = 0, BATCH = 1, from the request's `priority`)
has a FIFO queue of its own. In `priority` order (the default) a waiter's place is its
arrival time plus `aging_s` for batch work, so interactive requests go first, but a
batch request is served before any interactive one that arrived more than `aging_s`
after it: batch work is never starved, however much interactive work keeps coming.
`fifo` order is arrival order across classes. The queue head is served whole or not
at all (no smaller request overtakes it), so a large request cannot starve either.

Both overload answers carry Retry-After: an estimate of when the slots would be free,
from how fast slots were given back over the last minute (the queue ahead plus this
request, over that rate), never less than `retry_after_s`; the queue timeout when none
were given back lately (nothing to go on). Invariant: `running` and `waiting` equal the
weights of admitted and queued requests; `release` is called once per admission.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from engine.sequence import BATCH, INTERACTIVE  # the traffic classes are the engine's lanes
from router.errors import ApiError

ORDERS = ("priority", "fifo")


@dataclass(eq=False)
class _Waiter:
    weight: int
    cls: int
    place: float  # arrival, plus the aging allowance for batch work in priority order
    arrival: float
    fut: asyncio.Future


class Admission:
    RATE_WINDOW_S = 60.0
    MAX_RETRY_AFTER_S = 3600.0

    def __init__(self, max_running: int, max_waiting: int, timeout_s: float, retry_after_s: float,
                 clock: Callable[[], float] = time.monotonic, order: str = "priority",
                 aging_s: float = 10.0) -> None:
        if order not in ORDERS:
            raise ValueError(f"admission order must be one of {', '.join(ORDERS)}, got {order!r}")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.order = order
        self.aging_s = aging_s
        self.running = 0
        self.waiting = 0
        self.waiting_by_class = [0, 0]
        self._queues: tuple[deque[_Waiter], deque[_Waiter]] = (deque(), deque())
        self._clock = clock
        self._born = clock()
        self._freed: deque[tuple[float, int]] = deque()  # (when, weight) of recent releases
        self._freed_weight = 0

    def retry_after(self, weight: int) -> float:
        """Seconds until `weight` slots behind everyone queued now would likely be free."""
        now = self._clock()
        self._forget(now)
        if not self._freed_weight:
            return max(self.retry_after_s, self.timeout_s)
        rate = self._freed_weight / max(1.0, min(self.RATE_WINDOW_S, now - self._born))
        return min(self.MAX_RETRY_AFTER_S, max(self.retry_after_s, (self.waiting + weight) / rate))

    def _forget(self, now: float) -> None:
        while self._freed and self._freed[0][0] < now - self.RATE_WINDOW_S:
            self._freed_weight -= self._freed.popleft()[1]

    def _place(self, cls: int, now: float) -> float:
        return now + self.aging_s if cls == BATCH and self.order == "priority" else now

    def oldest_wait_s(self) -> float:
        """How long the longest-waiting request has been queued (0 when none is)."""
        arrivals = [q[0].arrival for q in self._queues if q]
        return self._clock() - min(arrivals) if arrivals else 0.0

    def _head(self) -> _Waiter | None:
        """The waiter served next: the earliest place among the classes' heads."""
        heads = [q[0] for q in self._queues if q]
        return min(heads, key=lambda w: (w.place, w.arrival)) if heads else None

    async def acquire(self, weight: int, cls: int = INTERACTIVE) -> int:
        """Wait for `weight` slots for a request of class `cls`; returns the weight to
        pass to `release`."""
        weight = max(1, min(weight, self.max_running))  # a huge request runs alone
        cls = BATCH if cls == BATCH else INTERACTIVE
        now = self._clock()
        place = self._place(cls, now)
        head = self._head()
        if (head is None or (place, now) < (head.place, head.arrival)) and self.running + weight <= self.max_running:
            self.running += weight
            return weight
        if self.waiting + weight > self.max_waiting:
            raise ApiError.overloaded(429, "the server is busy: too many requests queued", self.retry_after(weight))
        entry = _Waiter(weight, cls, place, now, asyncio.get_running_loop().create_future())
        self._queues[cls].append(entry)
        self._count(entry, +1)
        try:
            await asyncio.wait_for(entry.fut, self.timeout_s)
        except BaseException as e:
            self._abandon(entry)
            if isinstance(e, asyncio.TimeoutError):
                raise ApiError.overloaded(
                    503, f"the server is busy: no capacity within {self.timeout_s:g} s", self.retry_after(weight)
                ) from None
            raise
        return weight

    def release(self, weight: int) -> None:
        self.running -= weight
        now = self._clock()
        self._freed.append((now, weight))
        self._freed_weight += weight
        self._forget(now)
        self._wake()

    def _count(self, w: _Waiter, sign: int) -> None:
        self.waiting += sign * w.weight
        self.waiting_by_class[w.cls] += sign * w.weight

    def _abandon(self, entry: _Waiter) -> None:
        """A waiter gave up (timeout or cancelled): undo whatever state it is in."""
        if entry.fut.done() and not entry.fut.cancelled():
            self.release(entry.weight)  # it was admitted just before giving up
        elif entry in self._queues[entry.cls]:
            self._queues[entry.cls].remove(entry)
            self._count(entry, -1)
            self._wake()

    def _wake(self) -> None:
        while (head := self._head()) is not None:
            if head.fut.done():  # cancelled while queued; _abandon removes it
                self._queues[head.cls].popleft()
                self._count(head, -1)
                continue
            if self.running + head.weight > self.max_running:
                return
            self._queues[head.cls].popleft()
            self._count(head, -1)
            self.running += head.weight
            head.fut.set_result(None)
