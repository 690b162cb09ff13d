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

Both overload answers carry Retry-After, from the measured drain rate: slots given back
over the last minute per second of it that anything ran (so a router idle until a burst
judges the burst by its own releases, not by the quiet minute before it). A 429 (the
queue is full) says when the queue will have room for this request: its weight over the
rate; a 503 (it waited out `timeout_s`) says when it would have been admitted: the
queue ahead plus its weight, over the rate. Never less than `retry_after_s`; the queue
timeout when nothing was given back lately (nothing to go on).

Invariant: `running` and `waiting` equal the weights of admitted and queued requests;
`release` is called once per admission.
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
        self._freed: deque[tuple[float, int]] = deque()  # (when, weight) of recent releases
        self._freed_weight = 0
        self._busy: deque[tuple[float, float]] = deque()  # recent (start, end) spans with something running
        self._busy_since: float | None = None  # the current span's start

    def drain_rate(self) -> float:
        """Slots given back over the last minute, per second of it that anything ran (0
        when none were given back)."""
        now = self._clock()
        self._forget(now)
        if not self._freed_weight:
            return 0.0
        since = now - self.RATE_WINDOW_S
        busy = sum(end - max(start, since) for start, end in self._busy)
        if self._busy_since is not None:
            busy += now - max(self._busy_since, since)
        return self._freed_weight / max(1.0, busy)

    def retry_after(self, weight: int, behind_queue: bool = True) -> float:
        """Seconds until `weight` slots would likely be free: behind everyone queued now
        (a 503's wait), or only the next `weight` of the queue's drain (a 429's room)."""
        rate = self.drain_rate()
        if not rate:
            return max(self.retry_after_s, self.timeout_s)
        need = (self.waiting + weight) if behind_queue else weight
        return min(self.MAX_RETRY_AFTER_S, max(self.retry_after_s, need / rate))

    def _forget(self, now: float) -> None:
        while self._freed and self._freed[0][0] < now - self.RATE_WINDOW_S:
            self._freed_weight -= self._freed.popleft()[1]
        while self._busy and self._busy[0][1] < now - self.RATE_WINDOW_S:
            self._busy.popleft()

    def _take(self, weight: int) -> None:
        if self.running == 0 and self._busy_since is None:
            self._busy_since = self._clock()
        self.running += weight

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

    def refuse_if_full(self) -> None:
        """The 429 `acquire` would answer even the smallest request, raised before the
        request is parsed or tokenized: under a burst, refusals go out at once instead of
        after every queued request's parsing ahead of them."""
        if self.running >= self.max_running and self.waiting + 1 > self.max_waiting:
            raise ApiError.overloaded(429, "the server is busy: too many requests queued",
                                      self.retry_after(1, behind_queue=False))

    async def acquire(self, weight: int, cls: int = INTERACTIVE) -> int:
        """Wait for `weight` slots for a request of class `cls`; returns the weight to
        pass to `release`."""
        weight = max(1, min(weight, self.max_running))  # a huge request runs alone
        cls = BATCH if cls == BATCH else INTERACTIVE
        now = self._clock()
        place = self._place(cls, now)
        head = self._head()
        if (head is None or (place, now) < (head.place, head.arrival)) and self.running + weight <= self.max_running:
            self._take(weight)
            return weight
        if self.waiting + weight > self.max_waiting:
            raise ApiError.overloaded(429, "the server is busy: too many requests queued",
                                      self.retry_after(weight, behind_queue=False))
        entry = _Waiter(weight, cls, place, now, asyncio.get_running_loop().create_future())
        self._queues[cls].append(entry)
        self._count(entry, +1)
        try:
            await asyncio.wait_for(entry.fut, self.timeout_s)
        except BaseException as e:
            self._abandon(entry)
            if isinstance(e, asyncio.TimeoutError):
                raise ApiError.overloaded(
                    503, f"the server is busy: no capacity within {self.timeout_s:g} s (--queue-timeout-s)",
                    self.retry_after(weight)) from None
            raise
        return weight

    def release(self, weight: int) -> None:
        self.running -= weight
        now = self._clock()
        self._freed.append((now, weight))
        self._freed_weight += weight
        self._forget(now)
        self._wake()
        if self.running == 0 and self._busy_since is not None:  # nothing runs: the busy span ends
            self._busy.append((self._busy_since, now))
            self._busy_since = None

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
            self._take(head.weight)
            head.fut.set_result(None)
