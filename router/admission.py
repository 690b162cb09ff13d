"""Admission control in the router: a FIFO, weighted limit on engine requests.

An HTTP request asks for `weight` slots (its prompts x n engine requests) at once, so
a request never holds part of what it needs while waiting for the rest:

    running + weight <= max_running   -> admitted now (if nobody waits ahead of it)
    waiting + weight <= max_waiting   -> queued, FIFO, for at most `timeout_s` (then 503)
    otherwise                         -> 429 at once

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
from typing import Callable

from router.errors import ApiError


class Admission:
    RATE_WINDOW_S = 60.0
    MAX_RETRY_AFTER_S = 3600.0

    def __init__(self, max_running: int, max_waiting: int, timeout_s: float, retry_after_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.running = 0
        self.waiting = 0
        self._queue: deque[tuple[int, asyncio.Future]] = deque()
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

    async def acquire(self, weight: int) -> int:
        """Wait for `weight` slots; returns the weight to pass to `release`."""
        weight = max(1, min(weight, self.max_running))  # a huge request runs alone
        if not self._queue and self.running + weight <= self.max_running:
            self.running += weight
            return weight
        if self.waiting + weight > self.max_waiting:
            raise ApiError.overloaded(429, "the server is busy: too many requests queued", self.retry_after(weight))
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        entry = (weight, fut)
        self._queue.append(entry)
        self.waiting += weight
        try:
            await asyncio.wait_for(fut, self.timeout_s)
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

    def _abandon(self, entry: tuple[int, asyncio.Future]) -> None:
        """A waiter gave up (timeout or cancelled): undo whatever state it is in."""
        weight, fut = entry
        if fut.done() and not fut.cancelled():
            self.release(weight)  # it was admitted just before giving up
        elif entry in self._queue:
            self._queue.remove(entry)
            self.waiting -= weight
            self._wake()

    def _wake(self) -> None:
        while self._queue:
            weight, fut = self._queue[0]
            if fut.done():  # cancelled while queued; _abandon removes it
                self._queue.popleft()
                self.waiting -= weight
                continue
            if self.running + weight > self.max_running:
                return
            self._queue.popleft()
            self.waiting -= weight
            self.running += weight
            fut.set_result(None)
