"""The KV transport contract: one ABC (backends are made in kv_transfer/registry.py).

A transport writes whole blocks (every (layer, k|v) region of a block, for all
layers or a layer range) from the local KV tensor into a peer's tensor, at
different block ids, and tells the peer once the bytes have landed (layout in
kv_transfer/layout.py). Calls are made from one thread (the worker's event
loop); `poll` never blocks, `wait` blocks for a bounded time.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

from kv_transfer.handles import (  # noqa: F401  (re-exported)
    DONE,
    PENDING,
    HandleBook,
    PendingWrite,
    TransferHandle,
    TransferStatus,
    XferState,
    await_ready,
    resolve_write,
)
from kv_transfer.layout import (  # noqa: F401  (re-exported)
    HeadSlice,
    KVLayout,
    LayoutMismatch,
    PeerDescriptor,
    PeerId,
    PeerRejected,
    TransferError,
    new_epoch,
)

if TYPE_CHECKING:
    import torch

    from kv_transfer.tls import ClusterTLS

logger = logging.getLogger("tandem.kv_transfer")


class Notification(NamedTuple):
    """A message a peer attached to a write; delivered only after the bytes landed."""

    peer: PeerId
    message: bytes


@dataclass(frozen=True)
class TransportConfig:
    """Settings shared by every backend.

    worker_name: stable name of this worker ("decode-0"); the epoch tells incarnations apart.
    bind_host / port: where the TCP receiver listens (port 0 = any free port).
    advertise_host: the address peers are given to reach it (None: bind_host; needed
      when binding 0.0.0.0).
    token: shared cluster secret; TCP peers without it are refused. None = no check.
    connect_timeout_s / io_timeout_s: bounds on connecting and on any single socket read/write.
    xfer_timeout_s: a write still pending after this long is FAILED.
    nixl_progress_delay_us: the longest the NIXL UCX progress thread sleeps in poll()
      between wake-ups that no event asked for (0 makes it busy-spin a core). It wakes
      on the UCX event fd anyway; the timed wake-up only covers UCX's missed-wake-up bug
      (NIXL's ucx_thread_engine.cpp). At 1 ms it woke 1,000 times a second, each time on
      a core an engine thread was using: 20 ms bought small at rate inf 4-7% colocated
      and 3.5% disaggregated (docs/performance.md, eleventh round).
    tls: the cluster's mutual TLS (kv_transfer/tls.py): the TCP transport's receiver
      and senders both present certificates and check the other's. NIXL ignores it.
    wait_for_ready: honour `write_blocks(ready=...)`. False only to show, in a stress
      test, the race that the wait prevents (a layer's KV sent before it is computed).
    """

    worker_name: str
    epoch: str = dataclasses.field(default_factory=new_epoch)
    bind_host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    token: str | None = None
    connect_timeout_s: float = 5.0
    io_timeout_s: float = 30.0
    xfer_timeout_s: float = 60.0
    nixl_progress_delay_us: int = 20000
    wait_for_ready: bool = True
    tls: "ClusterTLS | None" = None  # mutual TLS on the TCP transport's connections (kv_transfer/tls.py)

    def __post_init__(self) -> None:
        if not self.worker_name or "@" in self.worker_name:
            raise ValueError(
                f"TransportConfig.worker_name {self.worker_name!r} must be non-empty, no '@'"
            )
        for f in ("connect_timeout_s", "io_timeout_s", "xfer_timeout_s"):
            if getattr(self, f) <= 0:
                raise ValueError(f"TransportConfig.{f} must be > 0 (a bound on every wait)")


class Transport(abc.ABC):
    """Moves whole KV blocks from our registered tensor into peers' tensors."""

    name: str = "abstract"

    @abc.abstractmethod
    def register(self, kv: "torch.Tensor") -> KVLayout:
        """Register the worker's KV tensor once; returns its layout.

        `kv` is `[L, 2, N, block_size, kv_heads, head_dim]`, contiguous, and must
        stay alive (not reallocated) for the life of the transport.
        """

    @abc.abstractmethod
    def local_descriptor(self) -> bytes:
        """Serialized `PeerDescriptor` a peer passes to `add_peer` to write into us."""

    @abc.abstractmethod
    def add_peer(self, descriptor: bytes) -> PeerId:
        """Connect to the peer a descriptor names; idempotent.

        The same name with a NEW epoch replaces the old peer: its pending writes
        FAIL and a fresh connection is made. Raises LayoutMismatch when the peer's
        blocks differ from ours, PeerRejected when it refuses us.
        """

    @abc.abstractmethod
    def remove_peer(self, peer: PeerId) -> None:
        """Forget a peer; its pending writes FAIL. No-op for an unknown peer."""

    @abc.abstractmethod
    def write_blocks(
        self,
        peer: PeerId,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        layers: range | None = None,
        notify: bytes | None = None,
        after: Sequence[TransferHandle] = (),
        ready: Any = None,
        heads: HeadSlice | None = None,
    ) -> TransferHandle:
        """Start writing local blocks into the peer's blocks (pairwise); never blocks.

        `heads`: only these KV heads of each block (tensor-parallel ranks whose blocks
        hold different heads); None moves whole blocks, the same heads on both sides.

        `ready`: something with `query() -> bool`, true once the blocks' KV has been
        computed (a CUDA event recorded after the kernels that write it); the
        transport's thread reads the blocks only after that, within the write's
        deadline (`await_ready`). None: the KV is already in memory (CPU).

        `layers` restricts the write to a contiguous layer range (layer-by-layer
        push); None writes all layers. `notify` reaches the peer's
        `notifications()` only after this write AND the earlier writes in `after`
        (same peer; e.g. the request's previous layers) have landed; if any of
        them fails (or was released), this write fails too and nothing is
        delivered. `after` only matters together with `notify`. Raises
        TransferError for bad arguments (length mismatch, block id or layer out
        of range, duplicate remote ids); runtime failures (peer gone, stale or
        unknown peer, timeout) show up as FAILED(reason) in `poll`.
        """

    @abc.abstractmethod
    def notify(self, peer: PeerId, message: bytes) -> TransferHandle:
        """Send `message` to the peer's `notifications()` with no data; never blocks.

        For telling a peer that no write of ours is coming (a prefill that ended before
        it wrote anything). TCP sends it on the connection the writes use, after them;
        NIXL sends it at once, so the caller must not rely on it following a write in
        flight. DONE once sent (TCP: once the peer acknowledged it); a peer that is not
        connected makes it FAILED.
        """

    @abc.abstractmethod
    def poll(self, handle: TransferHandle) -> TransferStatus:
        """Non-blocking state of a write: PENDING, DONE or FAILED(reason).

        A write pending longer than `xfer_timeout_s` becomes FAILED. Terminal
        states are sticky.
        """

    @abc.abstractmethod
    def release(self, handle: TransferHandle) -> None:
        """Abandon a write: a PENDING one becomes FAILED("released") and frees
        what it holds (its bytes may still land at the peer; NIXL tries to
        cancel). A finished one is untouched. Statuses stay answerable for the
        last few thousand writes, then `poll` says "unknown handle"."""

    @abc.abstractmethod
    def notifications(self) -> list[Notification]:
        """Receiving side: messages whose data has landed, since the last call."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop threads, drop peers, deregister memory; idempotent."""

    def describe(self) -> str:
        """One line for logs: the backend and where it listens or what it runs on."""
        return self.name

    def wait(self, handle: TransferHandle, timeout: float) -> TransferStatus:
        """Block up to `timeout` seconds for a write to finish; PENDING if it has not."""
        deadline = time.monotonic() + timeout
        pause = 20e-6
        while True:
            status = self.poll(handle)
            if status.finished or time.monotonic() >= deadline:
                return status
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
