"""FaultyTransport: a real transport with injected failures or delays, for failure
tests (the worker runtime builds one when TANDEM_FAULTS asks; see engine/envs.py). The
bytes still move through the wrapped transport; only what `poll` reports is changed."""

from __future__ import annotations

import time

from kv_transfer.base import PENDING, TransferHandle, TransferStatus, Transport


class FaultyTransport(Transport):
    def __init__(self, inner: Transport, transfer_delay_s: float = 0.0, fail_transfers: bool = False) -> None:
        self.inner = inner
        self.transfer_delay_s = transfer_delay_s
        self.fail_transfers = fail_transfers
        self.name = inner.name
        self._started: dict[int, float] = {}

    def write_blocks(self, peer, local_block_ids, remote_block_ids, layers=None, notify=None, after=(), ready=None,
                     heads=None):
        h = self.inner.write_blocks(peer, local_block_ids, remote_block_ids, layers=layers, notify=notify, after=after,
                                    ready=ready, heads=heads)
        self._started[h.id] = time.monotonic()
        return h

    def notify(self, peer, message: bytes) -> TransferHandle:
        return self.inner.notify(peer, message)

    def poll(self, handle: TransferHandle) -> TransferStatus:
        if self.fail_transfers:
            return TransferStatus.failed("injected transfer failure (TANDEM_FAULTS)")
        start = self._started.get(handle.id)
        if start is not None and time.monotonic() - start < self.transfer_delay_s:
            return PENDING
        return self.inner.poll(handle)

    def release(self, handle: TransferHandle) -> None:
        self._started.pop(handle.id, None)
        self.inner.release(handle)

    def register(self, kv):
        return self.inner.register(kv)

    def local_descriptor(self) -> bytes:
        return self.inner.local_descriptor()

    def add_peer(self, descriptor: bytes):
        return self.inner.add_peer(descriptor)

    def remove_peer(self, peer) -> None:
        self.inner.remove_peer(peer)

    def notifications(self):
        return self.inner.notifications()

    def close(self) -> None:
        self.inner.close()
