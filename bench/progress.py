"""Live progress bar of a run (rich): requests done / failed, elapsed, tokens/s."""
from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.records import RequestRecord


class LiveProgress:
    """Counts finished requests; the bar's total is the request count, or the duration
    (seconds) when the run is bounded by time only."""

    def __init__(self, console: Console, title: str, total_requests: int | None,
                 duration_s: float | None, disable: bool = False) -> None:
        self.by_time = total_requests is None
        self.total = duration_s if self.by_time else total_requests
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn() if not self.by_time else TextColumn(""),
                                 TextColumn("{task.fields[stats]}"), TimeElapsedColumn(),
                                 console=console, disable=disable, transient=False)
        self.title = title
        self.done = self.failed = self.out_tokens = 0
        self.t0 = 0.0
        self.task: Any = None

    def __enter__(self) -> LiveProgress:
        self.progress.start()
        self.t0 = time.perf_counter()
        self.task = self.progress.add_task(self.title, total=self.total, stats="")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def update(self, rec: RequestRecord) -> None:
        self.done += 1
        self.failed += 0 if rec.ok else 1
        self.out_tokens += rec.output_tokens if rec.ok else 0
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        stats = (f"done {self.done}  failed {self.failed}  "
                 f"out {self.out_tokens / elapsed:,.0f} tok/s")
        completed = min(elapsed, self.total) if self.by_time else self.done
        self.progress.update(self.task, completed=completed, stats=stats)
