"""Drives one timed run: arrivals, the concurrency cap, warm-up, stop conditions.

Timing: offset 0 is the start of the timed run. A request is *scheduled* at its arrival
offset; with --max-concurrency it may wait for a free slot (FIFO) and is *sent* later;
TTFT / E2E are measured from `sent` (as vLLM does), the wait is reported as
`client_queue`. The run stops issuing requests at --num-requests or once --duration
seconds have passed (whichever first); requests in flight then are waited for (each
bounded by --request-timeout) and counted.
"""
from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone

from bench.arrivals import arrival_offsets
from bench.client import StreamClient
from bench.records import RequestRecord
from bench.workloads import RequestSpec

PREBUILT_SPECS_MAX = 20_000


@dataclass(frozen=True)
class RunConfig:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_requests: int | None = 200
    duration_s: float | None = None
    warmup: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give --num-requests or --duration (or both)")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("--num-requests must be >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("--duration must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        if self.warmup < 0:
            raise ValueError("--warmup must be >= 0")
        if (math.isinf(self.request_rate) and self.num_requests is None
                and self.max_concurrency is None):
            raise ValueError("rate inf with only --duration would send without bound: "
                             "add --max-concurrency or --num-requests")

    def prebuilt(self) -> int:
        """How many specs to build before the clock starts (the rest lazily)."""
        if self.num_requests is not None:
            return min(self.num_requests, PREBUILT_SPECS_MAX)
        if math.isinf(self.request_rate):
            return min(4 * (self.max_concurrency or 1), PREBUILT_SPECS_MAX)
        return min(int(self.request_rate * self.duration_s * 1.5) + 16, PREBUILT_SPECS_MAX)


@dataclass
class RunResult:
    request_rate: float
    records: list[RequestRecord]
    duration_s: float
    started_at: str
    warmup_failed: int = 0


OnDone = Callable[[RequestRecord], None]


async def warm_up(client: StreamClient, specs: Iterable[RequestSpec], n: int,
                  concurrency: int | None) -> list[RequestRecord]:
    """Send n requests (not timed, not counted), at most `concurrency` at a time."""
    if n <= 0:
        return []
    sem = asyncio.Semaphore(concurrency or n)
    t0 = time.perf_counter()

    async def one(i: int, spec: RequestSpec) -> RequestRecord:
        async with sem:
            return await client.send(spec, RequestRecord(index=i, category="warmup"), t0)

    return list(await asyncio.gather(
        *(one(i, s) for i, s in enumerate(itertools.islice(specs, n)))))


async def timed_run(client: StreamClient, cfg: RunConfig, specs: Iterator[RequestSpec],
                    on_done: OnDone | None = None) -> RunResult:
    specs = itertools.chain(list(itertools.islice(specs, cfg.prebuilt())), specs)
    arrivals = arrival_offsets(cfg.request_rate, cfg.burstiness, cfg.seed)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    tasks: list[asyncio.Task] = []
    for index, spec in enumerate(specs):
        offset = spec.arrival if spec.arrival is not None else next(arrivals)
        if _should_stop(cfg, index, offset, 0.0):
            break
        await _sleep_until(t0 + offset)
        if sem is not None:
            await sem.acquire()
        if _should_stop(cfg, index, offset, time.perf_counter() - t0):
            if sem is not None:
                sem.release()
            break
        rec = RequestRecord(index=index, category=spec.category, scheduled=offset)
        tasks.append(asyncio.create_task(_one(client, spec, rec, t0, sem, on_done)))
    records = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - t0
    return RunResult(cfg.request_rate, records, duration, started_at)


def _should_stop(cfg: RunConfig, index: int, offset: float, elapsed: float) -> bool:
    if cfg.num_requests is not None and index >= cfg.num_requests:
        return True
    if cfg.duration_s is not None and max(offset, elapsed) >= cfg.duration_s:
        return True
    return False


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def _one(client: StreamClient, spec: RequestSpec, rec: RequestRecord, t0: float,
               sem: asyncio.Semaphore | None, on_done: OnDone | None) -> RequestRecord:
    try:
        await client.send(spec, rec, t0)
    finally:
        if sem is not None:
            sem.release()
    if on_done is not None:
        on_done(rec)
    return rec
