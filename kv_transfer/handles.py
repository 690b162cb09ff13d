"""Bookkeeping shared by the backends: write statuses, handles, argument checks."""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kv_transfer.layout import KVLayout, PeerId, TransferError


class XferState(enum.Enum):
    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"


@dataclass(frozen=True)
class TransferStatus:
    """The state of a write; `reason` says why it FAILED (never empty then)."""

    state: XferState
    reason: str = ""

    @property
    def finished(self) -> bool:
        return self.state is not XferState.PENDING

    @classmethod
    def failed(cls, reason: str) -> "TransferStatus":
        return cls(XferState.FAILED, reason)


DONE = TransferStatus(XferState.DONE)
PENDING = TransferStatus(XferState.PENDING)


@dataclass(frozen=True)
class TransferHandle:
    """Opaque ticket for one `write_blocks` call."""

    id: int
    peer: PeerId
    nbytes: int


def resolve_write(
    ours: KVLayout,
    theirs: KVLayout,
    peer: PeerId,
    local_block_ids: Sequence[int],
    remote_block_ids: Sequence[int],
    layers: range | None,
    heads=None,
) -> tuple[np.ndarray, np.ndarray, range]:
    """Check a write's arguments; returns (local ids, remote ids, layer range).
    `heads` (a HeadSlice, or None for whole blocks of the same heads on both sides)
    must fall within both sides' heads.

    Raises TransferError naming the bad argument: a caller bug, not a runtime failure.
    """
    local = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
    remote = np.asarray(remote_block_ids, dtype=np.int64).reshape(-1)
    if len(local) != len(remote) or len(local) == 0:
        raise TransferError(
            f"write to {peer}: need as many local as remote block ids (>0), "
            f"got {len(local)} and {len(remote)}"
        )
    _check_ids(local, ours.num_blocks, "local", peer)
    _check_ids(remote, theirs.num_blocks, "remote", peer)
    if len(np.unique(remote)) != len(remote):
        raise TransferError(f"write to {peer}: duplicate remote block ids")
    layers = range(ours.num_layers) if layers is None else layers
    if layers.step != 1 or not 0 <= layers.start < layers.stop <= ours.num_layers:
        raise TransferError(
            f"write to {peer}: layers {layers} must be a non-empty step-1 range "
            f"within [0, {ours.num_layers})"
        )
    if heads is None:
        if ours.num_kv_heads != theirs.num_kv_heads:
            raise TransferError(
                f"write to {peer}: its blocks hold {theirs.num_kv_heads} KV heads, ours {ours.num_kv_heads}: "
                "name the heads to move (a HeadSlice)"
            )
    elif heads.count < 1 or heads.src < 0 or heads.dst < 0 or heads.src + heads.count > ours.num_kv_heads \
            or heads.dst + heads.count > theirs.num_kv_heads:
        raise TransferError(
            f"write to {peer}: heads {tuple(heads)} (src, dst, count) outside our {ours.num_kv_heads} or its "
            f"{theirs.num_kv_heads} KV heads"
        )
    return local, remote, layers


def _check_ids(ids: np.ndarray, num_blocks: int, side: str, peer: PeerId) -> None:
    bad = ids[(ids < 0) | (ids >= num_blocks)]
    if len(bad):
        raise TransferError(
            f"write to {peer}: {side} block id {int(bad[0])} out of range [0, {num_blocks})"
        )


@dataclass
class PendingWrite:
    """Bookkeeping of one write in flight; `extra` is the backend's own state."""

    handle: TransferHandle
    deadline: float
    after: tuple[int, ...] = ()
    extra: Any = None
    ready: Any = None  # see await_ready
    awaiting_ready: bool = False  # a transport thread is waiting for `ready` (the timeout says so)


_NOT_COMPUTED = "timed out waiting for the KV it carries to be computed"


def await_ready(write: PendingWrite) -> TransferStatus | None:
    """Wait until the KV a write reads has been computed: `write.ready.query()` is true
    (a CUDA event recorded after the kernels that produce it; None: nothing to wait
    for). Bounded by the write's deadline. Returns None when ready, else FAILED.

    A device runs kernels after the call that launched them returns, so without this
    a transport's thread could read (and send) a layer's KV before it is written."""
    ready = write.ready
    if ready is None:
        return None
    pause = 10e-6
    write.awaiting_ready = True
    try:
        while not ready.query():
            if time.monotonic() > write.deadline:
                return TransferStatus.failed(_NOT_COMPUTED)
            time.sleep(pause)
            pause = min(pause * 2, 200e-6)
    finally:
        write.awaiting_ready = False
    return None


class HandleBook:
    """Handle ids -> writes in flight. Terminal statuses are sticky (the first one
    wins) and kept for the last `history` writes, so a late poll (or a write that
    names it in `after`) still gets the answer. Thread-safe: a backend's I/O
    thread may finish writes."""

    def __init__(self, timeout_s: float, history: int = 8192) -> None:
        self._timeout_s = timeout_s
        self._history = history
        self._lock = threading.Lock()
        self._next_id = 0
        self._live: dict[int, PendingWrite] = {}
        self._done: OrderedDict[int, TransferStatus] = OrderedDict()

    def open(self, peer: PeerId, nbytes: int, after: Sequence[TransferHandle] = (), ready: Any = None) -> PendingWrite:
        for h in after:
            if h.peer != peer:
                raise TransferError(f"write to {peer}: `after` handle {h.id} targets {h.peer}")
        with self._lock:
            self._next_id += 1
            handle = TransferHandle(self._next_id, peer, nbytes)
            write = PendingWrite(
                handle, time.monotonic() + self._timeout_s, tuple(h.id for h in after), ready=ready
            )
            self._live[handle.id] = write
            return write

    def live(self, handle_id: int) -> PendingWrite | None:
        with self._lock:
            return self._live.get(handle_id)

    def live_for(self, peer: PeerId) -> list[PendingWrite]:
        with self._lock:
            return [w for w in self._live.values() if w.handle.peer == peer]

    def all_live(self) -> list[PendingWrite]:
        with self._lock:
            return list(self._live.values())

    def finish(self, handle_id: int, status: TransferStatus) -> PendingWrite | None:
        """Record a terminal status; returns the write if this call finished it."""
        assert status.finished and (status.state is XferState.DONE or status.reason)
        with self._lock:
            write = self._live.pop(handle_id, None)
            if write is None:
                return None
            self._done[handle_id] = status
            while len(self._done) > self._history:
                self._done.popitem(last=False)
            return write

    def status(self, handle_id: int) -> TransferStatus:
        """PENDING for a live write, else its sticky terminal status."""
        with self._lock:
            if handle_id in self._live:
                return PENDING
            return self._done.get(handle_id) or TransferStatus.failed(
                f"unknown transfer handle {handle_id} (never issued, or older than the history)"
            )

    def timed_out(self, write: PendingWrite) -> TransferStatus | None:
        """A FAILED status if `write` is past its deadline, else None."""
        if time.monotonic() <= write.deadline:
            return None
        # whoever sees the deadline first (a poller or the transport's thread) gives the same reason
        return TransferStatus.failed(_NOT_COMPUTED if write.awaiting_ready else
                                     f"timed out after {self._timeout_s:.1f} s")

    def poll(self, handle_id: int) -> TransferStatus:
        """`status`, failing the write first if it is past its deadline (the backend's
        I/O thread sees the write finished and stops working on it)."""
        write = self.live(handle_id)
        if write is not None:
            timeout = self.timed_out(write)
            if timeout is not None:
                self.finish(handle_id, timeout)
        return self.status(handle_id)

    def release(self, handle_id: int) -> None:
        self.finish(handle_id, TransferStatus.failed("released by its owner"))
