"""NIXL (UCX) transport: one-sided WRITEs of KV regions straight into the peer's tensor.

Descriptor lists are prepared once: locally at `register` and per peer at
`add_peer`, one descriptor per (layer, k|v, block) region, indexed

    region(layer, kv, block) = (layer * 2 + kv) * num_blocks + block

so a request is just two index lists for `make_prepped_xfer` (NIXL merges
neighbouring regions that are contiguous on both sides into one operation).

Agent metadata travels inside our descriptor bytes (never NIXL's listener, which
binds 0.0.0.0). The agent is named `{worker}@{epoch}`, so a restarted worker is a
new agent and a notification's sender name carries its incarnation.

Threads: posting a request copies the bytes inside the call when UCX picks CMA
(host memory on one machine: ~40 ms for a 64 MiB request here), so requests are
posted and tracked by one "poster" thread; `write_blocks` only queues and `poll`
only reads the handle book. Every agent call, in any thread, holds `_lock`
(NIXL releases the GIL while it copies; the agent itself is not thread-safe).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from kv_transfer.base import (
    DONE,
    PENDING,
    HandleBook,
    KVLayout,
    Notification,
    PeerDescriptor,
    PeerId,
    PendingWrite,
    TransferError,
    TransferHandle,
    TransferStatus,
    Transport,
    TransportConfig,
    XferState,
    await_ready,
    resolve_write,
)
from kv_transfer.nixl_agent import (
    import_nixl,
    new_agent,
    region_indices,
    region_table,
    set_env_defaults,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("tandem.kv_transfer.nixl")

_LOCAL = "NIXL_INIT_AGENT"
_IDLE = object()  # the poster thread woke with nothing queued


@dataclass
class _Peer:
    id: PeerId
    agent_name: str
    layout: KVLayout
    dlist: Any  # prepared remote descriptor list


@dataclass
class _Xfer:
    """What the poster thread needs for one write; `request` is the posted NIXL
    request, owned (released) under the transport's lock."""

    peer: _Peer
    local_idx: np.ndarray
    remote_idx: np.ndarray
    notify: bytes | None
    request: Any = None
    held_notify: bytes | None = None  # sent once the writes in `after` are DONE


class NixlTransport(Transport):
    name = "nixl"

    def __init__(self, config: TransportConfig) -> None:
        set_env_defaults(config)
        self._api = import_nixl()
        self.config = config
        self.agent_name = f"{config.worker_name}@{config.epoch}"
        self._agent = new_agent(self._api, self.agent_name, config.nixl_progress_delay_us)
        self._lock = threading.Lock()
        self._book = HandleBook(config.xfer_timeout_s)
        self._peers: dict[str, _Peer] = {}
        self._queue: queue.Queue[PendingWrite | None] = queue.Queue()
        self._inflight: list[PendingWrite] = []
        self._poster = threading.Thread(
            target=self._post_loop, name=f"kv-nixl-{self.agent_name}", daemon=True
        )
        self._layout: KVLayout | None = None
        self._descriptor = b""
        self._closed = False

    def describe(self) -> str:
        return f"{self._api.__name__.split('.')[0]}, UCX backend, agent {self.agent_name}"

    # -- set-up (caller thread) ----------------------------------------------------

    def register(self, kv: "torch.Tensor") -> KVLayout:
        if self._layout is not None:
            raise TransferError("register() was already called: a transport serves one KV tensor")
        layout = KVLayout.of(kv)
        mem_type = "VRAM" if kv.is_cuda else "DRAM"
        device_id = (kv.device.index or 0) if kv.is_cuda else 0
        with self._lock:
            self._reg = self._agent.register_memory(kv)
            table = region_table(layout, kv.data_ptr(), device_id)
            self._local_dlist = self._agent.prep_xfer_dlist(_LOCAL, table, mem_type)
            metadata = self._agent.get_agent_metadata()
        self._kv, self._layout = kv, layout
        self._descriptor = PeerDescriptor(
            transport=self.name,
            name=self.config.worker_name,
            epoch=self.config.epoch,
            layout=layout,
            base_addr=kv.data_ptr(),
            device_id=device_id,
            mem_type=mem_type,
            blob=metadata,
        ).to_bytes()
        self._poster.start()
        return layout

    def local_descriptor(self) -> bytes:
        self._require_registered()
        return self._descriptor

    def add_peer(self, descriptor: bytes) -> PeerId:
        desc = PeerDescriptor.accept(descriptor, self.name, self._require_registered())
        old = self._peers.get(desc.name)
        if old is not None and old.id == desc.peer_id:
            return old.id
        if old is not None:
            self._drop(
                old, f"peer {desc.name} restarted: epoch {old.id.epoch} replaced by {desc.epoch}"
            )
        self._peers[desc.name] = self._connect(desc)
        return desc.peer_id

    def _connect(self, desc: PeerDescriptor) -> _Peer:
        table = region_table(desc.layout, desc.base_addr, desc.device_id)
        with self._lock:
            name = self._agent.add_remote_agent(desc.blob)
            name = name.decode() if isinstance(name, bytes) else name
            try:
                if name != str(desc.peer_id):
                    raise TransferError(
                        f"descriptor of {desc.peer_id} carries metadata of agent {name}"
                    )
                return _Peer(
                    desc.peer_id,
                    name,
                    desc.layout,
                    self._agent.prep_xfer_dlist(name, table, desc.mem_type),
                )
            except Exception:
                self._agent.remove_remote_agent(name)
                raise

    def remove_peer(self, peer: PeerId) -> None:
        current = self._peers.get(peer.name)
        if current is not None and current.id == peer:
            self._drop(current, f"peer {peer} was removed")

    def _drop(self, peer: _Peer, reason: str) -> None:
        """Fail the peer's writes, cancel what is in flight, forget the agent."""
        del self._peers[peer.id.name]
        with self._lock:
            for write in self._book.live_for(peer.id):
                self._fail(write, reason)
            _quietly(peer.dlist.release)
            _quietly(self._agent.remove_remote_agent, peer.agent_name)

    # -- writes (caller thread) ----------------------------------------------------------

    def write_blocks(
        self,
        peer: PeerId,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        layers: range | None = None,
        notify: bytes | None = None,
        after: Sequence[TransferHandle] = (),
        ready: Any = None,
        heads=None,
    ) -> TransferHandle:
        ours = self._require_registered()
        if heads is not None:
            raise TransferError(
                f"write to {peer}: the NIXL transport moves whole block regions, not some of their KV heads "
                "(prefill and decode ranks that hold different heads need --transport tcp)"
            )
        target = self._peers.get(peer.name)
        theirs = target.layout if target is not None else ours
        local, remote, layers = resolve_write(
            ours, theirs, peer, local_block_ids, remote_block_ids, layers
        )
        write = self._book.open(peer, len(local) * len(layers) * 2 * ours.region_bytes, after,
                                ready if self.config.wait_for_ready else None)
        if target is None or target.id != peer:
            reason = f"peer {peer} is not connected (never added, removed or replaced)"
            self._book.finish(write.handle.id, TransferStatus.failed(reason))
            return write.handle
        write.extra = _Xfer(
            target,
            region_indices(ours, local, layers),
            region_indices(theirs, remote, layers),
            notify,
        )
        self._queue.put(write)
        return write.handle

    def notify(self, peer: PeerId, message: bytes) -> TransferHandle:
        self._require_registered()
        write = self._book.open(peer, 0, (), None)
        target = self._peers.get(peer.name)
        if target is None or target.id != peer:
            status = TransferStatus.failed(f"peer {peer} is not connected (never added, removed or replaced)")
        else:
            try:
                with self._lock:
                    self._agent.send_notif(target.agent_name, message)
                status = DONE
            except Exception as e:  # noqa: BLE001 (nixl raises its own error types)
                status = TransferStatus.failed(f"notification to {peer} failed: {type(e).__name__}: {e}")
        self._book.finish(write.handle.id, status)
        return write.handle

    def poll(self, handle: TransferHandle) -> TransferStatus:
        return self._book.poll(handle.id)

    def release(self, handle: TransferHandle) -> None:
        self._book.release(handle.id)

    def notifications(self) -> list[Notification]:
        self._require_registered()
        with self._lock:
            notes = self._agent.get_new_notifs()
        out = []
        for agent_name, messages in notes.items():
            name, _, epoch = agent_name.rpartition("@")
            out.extend(Notification(PeerId(name, epoch), bytes(m)) for m in messages)
        return out

    # -- the poster thread ------------------------------------------------------------

    def _post_loop(self) -> None:
        while True:
            try:  # wake often only while something is in flight
                write = self._queue.get(timeout=2e-4 if self._inflight else 0.5)
            except queue.Empty:
                write = _IDLE
            if write is None:
                return
            # the KV must be computed before NIXL reads it; waited for outside the lock
            not_ready = None if write is _IDLE else await_ready(write)
            with self._lock:
                if not_ready is not None:
                    self._fail(write, not_ready.reason)
                elif write is not _IDLE:
                    self._post(write)
                self._inflight = [w for w in self._inflight if not self._progress(w)]

    def _post(self, write: PendingWrite) -> None:
        """Post a queued write (under the lock); it joins `_inflight` unless it ended."""
        xfer: _Xfer = write.extra
        if self._book.status(write.handle.id).finished:
            return  # released, timed out or its peer dropped while queued
        if xfer.notify is not None:
            earlier = self._earlier(write)
            if earlier.state is XferState.FAILED:
                return self._fail(
                    write, f"an earlier write it must follow failed: {earlier.reason}"
                )
            if earlier.state is XferState.PENDING:
                xfer.held_notify = xfer.notify  # send it once those have landed too
        try:
            xfer.request = self._agent.make_prepped_xfer(
                "WRITE",
                self._local_dlist,
                xfer.local_idx,
                xfer.peer.dlist,
                xfer.remote_idx,
                b"" if xfer.held_notify is not None or xfer.notify is None else xfer.notify,
            )
            if self._agent.transfer(xfer.request) == "ERR":
                return self._fail(write, f"posting the write to {write.handle.peer} failed")
        except Exception as e:  # NIXL raises typed errors, e.g. remote disconnect
            return self._fail(
                write, f"write to {write.handle.peer} failed: {type(e).__name__}: {e}"
            )
        self._inflight.append(write)

    def _progress(self, write: PendingWrite) -> bool:
        """Advance an in-flight write (under the lock); True once it has ended."""
        xfer: _Xfer = write.extra
        if self._book.status(write.handle.id).finished:  # released, timed out, peer dropped
            self._cancel(write)
            return True
        if xfer.request is not None:
            try:
                state = self._agent.check_xfer_state(xfer.request)
            except Exception as e:
                state = f"{type(e).__name__}: {e}"
            if state == "PROC":
                return self._check_deadline(write)
            if state != "DONE":
                self._fail(write, f"write to {write.handle.peer} failed: {state}")
                return True
            _quietly(xfer.request.release)
            xfer.request = None
        return self._finish_landed(write)

    def _finish_landed(self, write: PendingWrite) -> bool:
        """The write's bytes are at the peer: send a held-back notification once
        the writes it follows are DONE, then mark it DONE."""
        xfer: _Xfer = write.extra
        if xfer.held_notify is not None:
            earlier = self._earlier(write)
            if earlier.state is XferState.PENDING:
                return self._check_deadline(write)
            if earlier.state is XferState.FAILED:
                self._fail(write, f"an earlier write it must follow failed: {earlier.reason}")
                return True
            try:
                self._agent.send_notif(xfer.peer.agent_name, xfer.held_notify)
            except Exception as e:
                self._fail(write, f"notifying {write.handle.peer} failed: {type(e).__name__}: {e}")
                return True
        self._book.finish(write.handle.id, DONE)
        return True

    def _earlier(self, write: PendingWrite) -> TransferStatus:
        """Combined status of the writes in `after`: FAILED if any failed,
        PENDING if any is in flight, else DONE."""
        statuses = [self._book.status(h) for h in write.after]
        failed = [s for s in statuses if s.state is XferState.FAILED]
        if failed:
            return failed[0]
        return DONE if all(s.finished for s in statuses) else PENDING

    def _check_deadline(self, write: PendingWrite) -> bool:
        timeout = self._book.timed_out(write)
        if timeout is not None:
            self._fail(write, timeout.reason)
        return timeout is not None

    def _fail(self, write: PendingWrite, reason: str) -> None:
        """FAILED (unless it already ended) and cancel its request; call under the lock."""
        self._book.finish(write.handle.id, TransferStatus.failed(reason))
        self._cancel(write)

    def _cancel(self, write: PendingWrite) -> None:
        xfer: _Xfer | None = write.extra
        if xfer is not None and xfer.request is not None:
            _quietly(xfer.request.release)  # NIXL cancels a request still in flight
            xfer.request = None

    # -- teardown -----------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._poster.is_alive():
            self._queue.put(None)
            self._poster.join(timeout=10.0)
        for peer in list(self._peers.values()):
            self._drop(peer, "transport closed")
        with self._lock:
            for write in self._inflight + self._book.all_live():
                self._fail(write, "transport closed")
            if self._layout is not None:
                _quietly(self._local_dlist.release)
                _quietly(self._agent.deregister_memory, self._reg)
        self._agent = None

    def _require_registered(self) -> KVLayout:
        if self._closed:
            raise TransferError("transport is closed")
        if self._layout is None:
            raise TransferError("call register(kv) before using the transport")
        return self._layout


def _quietly(fn: Any, *args: Any) -> None:
    """Best-effort native cleanup: a failure is logged, never raised."""
    try:
        fn(*args)
    except Exception as e:
        logger.debug("nixl cleanup %s failed: %s", getattr(fn, "__name__", fn), e)
