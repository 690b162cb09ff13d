"""Idle cores lent between the workers of one small host.

When `tandem serve` runs both pools on one CPU machine, each worker owns a share of the
cores (router/pool.py `share_cores`). Disaggregated on two cores, the prefill worker
and the decode worker own one core each, so at full load each pool works at half the
machine while the other is idle: a burst of prompts is prefilled on one core while the
decode worker's core waits for KV, and the decode that follows runs on one core while
the prefill worker's core is idle (docs/performance.md).

The core table is one byte per core in a small shared file (made by the pool, under
/dev/shm where there is one): 1 while the core's owner has work, 0 while it is idle or
has no owner. A worker marks its own cores busy when a step starts and idle when its
engine loop goes to sleep, and before each step adds the idle cores of the shared set to
its OpenMP team, one thread bound to each (engine/runner.py). An owner that wakes up
takes its core back at the borrower's next step: the two share it for at most one of
the borrower's steps. Two borrowers may pick the same idle core in the same instant;
they then share it for a step. A step's thread count already changed from step to step
(`serial_step_work`); greedy tokens are the same lent or not, and equal transformers'
(tests/model/test_core_lending.py).

Only workers pinned by the pool to cores of a shared set take part; a worker on a host
of its own (a Kubernetes pod, a GPU) has no core table.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import threading
import uuid

log = logging.getLogger(__name__)

LEDGER_BYTES = 4096  # core ids below this


def create_core_table(prefix: str = "tandem-cores") -> str:
    """Make a zeroed core-table file; returns its path (the creator unlinks it)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    path = os.path.join(base, f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, LEDGER_BYTES)
    finally:
        os.close(fd)
    return path


class CoreTable:
    """One worker's view of the core table: its own cores and the shared set it may borrow from."""

    def __init__(self, path: str, own: tuple[int, ...], shared: tuple[int, ...]) -> None:
        if not own or max(own + shared) >= LEDGER_BYTES:
            raise ValueError(f"core table: cores {own} / {shared} out of range")
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, LEDGER_BYTES)
        finally:
            os.close(fd)
        self.own = tuple(own)
        self.others = tuple(c for c in shared if c not in own)
        self._busy = False

    def busy(self) -> None:
        """Written at every step, not only when the worker wakes: where the pool gives a core
        to two workers (more workers than cores), one going idle clears the byte the other
        set, and the busy one sets it again at its next step."""
        self._busy = True
        for c in self.own:
            self._mm[c] = 1

    def idle(self) -> None:
        if self._busy:
            self._busy = False
            for c in self.own:
                self._mm[c] = 0

    def borrowable(self) -> tuple[int, ...]:
        """The shared cores whose owners are idle now."""
        mm = self._mm
        return tuple(c for c in self.others if mm[c] == 0)

    def close(self) -> None:
        self.idle()
        self._mm.close()


def open_core_table(path: str | None, own: tuple[int, ...] | None, shared: tuple[int, ...] | None) -> CoreTable | None:
    """The worker's core table, or None (no shared set, nothing to borrow, or the file is gone)."""
    if not path or not own or not shared or not set(shared) - set(own):
        return None
    try:
        return CoreTable(path, tuple(own), tuple(shared))
    except (OSError, ValueError) as e:
        log.warning("cores are not lent: %s", e)
        return None


class IdleHelpers:
    """A bound team's OpenMP helper threads, held at SCHED_IDLE while no step uses them.

    libgomp keeps a finished region's helper threads spinning before they sleep (its
    GOMP_SPINCOUNT: about 7 ms on the 2-core Zen 5 development machine), and offers no
    call to put them to sleep sooner. After a prefill on two threads, then, a worker's
    helper spins on the other core for 7 ms while that core's real work (the router, the
    client, the other worker's engine, a one-thread decode step) waits its turn; an idle
    prefill worker did so after every prompt. A shorter spin for every region
    (GOMP_SPINCOUNT=30000) made one-stream tiny disaggregated faster but the small model's
    disaggregated throughput at rate inf 10% slower (docs/performance.md), so the spin
    stays and a helper that the next step will not use runs at SCHED_IDLE instead: it
    still spins, but only on a core nobody else wants. `use(n)` keeps the first n helpers
    at SCHED_OTHER (a team of n + 1 threads reuses them in that order) and idles the rest;
    a change costs one sched_setscheduler call a helper, none when nothing changes.

    An unprivileged thread may not leave SCHED_IDLE where RLIMIT_NICE is 0 (the default),
    so `available()` first tries the round trip on a thread of its own; where it fails,
    helpers are never idled. TANDEM_CPU_IDLE_HELPERS=0 turns this off."""

    def __init__(self) -> None:
        self.tids: list[int] = []
        self._idle: list[bool] = []

    @staticmethod
    def available() -> bool:
        """Whether a thread here can go to SCHED_IDLE and come back (Linux only)."""
        if not hasattr(os, "SCHED_IDLE"):
            return False
        ok: list[bool] = []

        def probe() -> None:
            try:
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
                ok.append(True)
            except OSError as e:
                log.info("OpenMP helpers are not idled between steps: %s", e)

        t = threading.Thread(target=probe, name="sched-idle-probe", daemon=True)
        t.start()
        t.join(5.0)
        return bool(ok)

    def rebound(self, tids: list[int]) -> None:
        """A new team's helpers (thread 0, the caller, excluded): all back to SCHED_OTHER,
        since libgomp may have reused threads that were idled."""
        self.tids = list(tids)
        self._idle = [True] * len(self.tids)
        self.use(len(self.tids))

    def use(self, n: int) -> None:
        """The next step runs n helpers: those at SCHED_OTHER, the rest at SCHED_IDLE."""
        for i, tid in enumerate(self.tids):
            idle = i >= n
            if idle != self._idle[i]:
                try:
                    os.sched_setscheduler(tid, os.SCHED_IDLE if idle else os.SCHED_OTHER, os.sched_param(0))
                except OSError as e:  # the thread is gone, or (unexpectedly) not allowed: stop
                    log.warning("OpenMP helper %d: scheduling policy not changed (%s); helpers are no "
                                "longer idled", tid, e)
                    self.tids, self._idle = [], []
                    return
                self._idle[i] = idle
