"""KV plane: moves KV blocks between workers (NIXL, or the TCP fallback).

Backends are imported lazily by `create_transport`; importing this package
loads neither torch nor NIXL.
"""

from kv_transfer.base import (
    DONE,
    PENDING,
    KVLayout,
    LayoutMismatch,
    Notification,
    PeerId,
    PeerRejected,
    TransferError,
    TransferHandle,
    TransferStatus,
    Transport,
    TransportConfig,
    XferState,
)
from kv_transfer.registry import TRANSPORTS, create_transport

__all__ = [
    "DONE",
    "PENDING",
    "KVLayout",
    "LayoutMismatch",
    "Notification",
    "PeerId",
    "PeerRejected",
    "TransferError",
    "TransferHandle",
    "TransferStatus",
    "Transport",
    "TransportConfig",
    "TRANSPORTS",
    "XferState",
    "create_transport",
]
