"""Idle cores lent between the workers of one small host.

When `tandem serve` runs both pools on one CPU machine, each worker owns a share of the
cores (router/pool.py `share_cores`). Disaggregated on two cores, the prefill worker
and the decode worker own one core each, so at full load each pool works at half the
machine while the other is idle: a burst of prompts is prefilled on one core while the
decode worker's core waits for KV, and the decode that follows runs on one core while
the prefill worker's core is idle (docs/performance.md).

The ledger is one byte per core in a small shared file (made by the pool, under
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
of its own (a Kubernetes pod, a GPU) has no ledger.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import uuid

log = logging.getLogger(__name__)

LEDGER_BYTES = 4096  # core ids below this


def create_ledger(prefix: str = "tandem-cores") -> str:
    """Make a zeroed ledger file; returns its path (the creator unlinks it)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    path = os.path.join(base, f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, LEDGER_BYTES)
    finally:
        os.close(fd)
    return path


class CoreLedger:
    """One worker's view of the ledger: its own cores and the shared set it may borrow from."""

    def __init__(self, path: str, own: tuple[int, ...], shared: tuple[int, ...]) -> None:
        if not own or max(own + shared) >= LEDGER_BYTES:
            raise ValueError(f"core ledger: cores {own} / {shared} out of range")
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


def open_ledger(path: str | None, own: tuple[int, ...] | None, shared: tuple[int, ...] | None) -> CoreLedger | None:
    """The worker's ledger, or None (no shared set, nothing to borrow, or the file is gone)."""
    if not path or not own or not shared or not set(shared) - set(own):
        return None
    try:
        return CoreLedger(path, tuple(own), tuple(shared))
    except (OSError, ValueError) as e:
        log.warning("cores are not lent: %s", e)
        return None
