"""TCP transport: the portable fallback; works wherever two processes share a network.

Receiving side: a threaded server (bind address from the config) copies each
write frame into the registered KV tensor, then queues its notification, then
acknowledges; the sender's write is DONE on that acknowledgement.

Sending side: one connection and one I/O thread per peer, writes in FIFO order.
A write is one frame: its header, then for each layer the blocks' K and V
regions gathered with `index_select` into one contiguous buffer
(`[2, blocks, region]`, reused) and sent as they are gathered.

Wire format, every message: `!IQ` (header length, payload length), a JSON
header, the payload. After connecting, the sender says HELLO (token, its name,
epoch and layout, the epoch it expects) and the receiver answers ok/reason.
"""

from __future__ import annotations

import base64
import logging
import queue
import socket
import threading
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from kv_transfer.base import (
    DONE,
    HandleBook,
    KVLayout,
    Notification,
    PeerDescriptor,
    PeerId,
    PeerRejected,
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
from kv_transfer.tcp_server import (
    KVReceiver,
    LayerBuffer,
    as_bytes,
    recv_message,
    region_view,
    send_message,
)

logger = logging.getLogger("tandem.kv_transfer.tcp")


@dataclass
class _Job:
    write: PendingWrite
    local: torch.Tensor  # local block ids, int64, on the KV tensor's device
    remote: list[int]
    layers: range
    notify: bytes | None
    heads: object = None  # HeadSlice or None


class _PeerLink:
    """Connection to one peer and the thread that runs its writes in order."""

    def __init__(self, owner: "TcpTransport", desc: PeerDescriptor) -> None:
        self.owner = owner
        self.desc = desc
        self.id = desc.peer_id
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.sock: socket.socket | None = None
        self.buffer = LayerBuffer(owner._regions)
        self.thread = threading.Thread(target=self._run, name=f"kv-tcp-send-{self.id}", daemon=True)

    def connect(self) -> None:
        """Connect and handshake; raises PeerRejected with the reason."""
        cfg = self.owner.config
        host, _, port = self.desc.address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=cfg.connect_timeout_s)
        except OSError as e:
            raise PeerRejected(f"cannot reach {self.id} at {self.desc.address}: {e}") from e
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(cfg.io_timeout_s)
        if cfg.tls is not None:  # both certificates checked before anything else is said
            try:
                sock = self.owner._tls.wrap_socket(sock, server_hostname=cfg.tls.server_name)
            except OSError as e:  # ssl.SSLError included
                sock.close()
                raise PeerRejected(f"TLS with {self.id} at {self.desc.address} failed: {e}") from e
        hello = {
            "kind": "hello",
            "token": cfg.token or "",
            "name": cfg.worker_name,
            "epoch": cfg.epoch,
            "layout": asdict(self.owner.layout),
            "target_epoch": self.desc.epoch,
        }
        try:
            send_message(sock, hello)
            reply, _ = recv_message(sock)
        except OSError as e:
            sock.close()
            raise PeerRejected(f"handshake with {self.id} failed: {e}") from e
        if not reply.get("ok"):
            sock.close()
            raise PeerRejected(f"{self.id} refused us: {reply.get('reason')}")
        self.sock = sock

    def close(self) -> None:
        self.jobs.put(None)
        self._disconnect()

    def _disconnect(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            book = self.owner._book
            if not book.status(job.write.handle.id).finished:  # not timed out or released
                book.finish(job.write.handle.id, self._execute(job))

    def _execute(self, job: _Job) -> TransferStatus:
        book = self.owner._book
        # FIFO: the writes in `after` went first, so each is DONE or FAILED by now
        failed = [book.status(h) for h in job.write.after] if job.notify is not None else []
        failed = [s for s in failed if s.state is not XferState.DONE]
        if failed:
            return TransferStatus.failed(
                f"an earlier write it must follow failed: {failed[0].reason}"
            )
        not_ready = await_ready(job.write)
        if not_ready is not None:
            return not_ready
        try:
            if self.sock is None:
                self.connect()
            return self._send(job)
        except PeerRejected as e:
            return TransferStatus.failed(str(e))
        except (OSError, ValueError) as e:
            self._disconnect()
            return TransferStatus.failed(f"connection to {self.id} lost: {type(e).__name__}: {e}")

    def _send(self, job: _Job) -> TransferStatus:
        regions = self.owner._regions
        n = len(job.remote)
        layout = self.owner.layout
        header = {
            "kind": "write",
            "id": job.write.handle.id,
            "remote": job.remote,
            "layers": [job.layers.start, job.layers.stop],
            "notify": None if job.notify is None else base64.b64encode(job.notify).decode(),
        }
        h = job.heads
        region = layout.region_bytes
        if h is not None:  # [bs, count, hd] of each region: a strided part, gathered
            header["heads"] = [h.dst, h.count]
            region = region // layout.num_kv_heads * h.count
        assert self.sock is not None
        send_message(self.sock, header, len(job.layers) * 2 * n * region)
        for layer in job.layers:  # (layer, k|v, block) order, one layer in memory at a time
            if h is not None:
                part = self.owner._heads[layer].index_select(1, job.local)[:, :, :, h.src:h.src + h.count]
                chunk = self.buffer.take_bytes(part.numel() * part.element_size())
                chunk.view(part.dtype).view(part.shape).copy_(part)
                self.sock.sendall(as_bytes(chunk))
                continue
            chunk = self.buffer.take(n)
            if regions.is_cuda:
                chunk.copy_(regions[layer].index_select(1, job.local))
            else:
                torch.index_select(regions[layer], 1, job.local, out=chunk)
            self.sock.sendall(as_bytes(chunk))
        reply, _ = recv_message(self.sock)
        if reply.get("id") != job.write.handle.id:
            raise ValueError(
                f"acknowledgement for write {reply.get('id')}, expected {job.write.handle.id}"
            )
        if not reply.get("ok"):
            return TransferStatus.failed(f"{self.id} rejected the write: {reply.get('reason')}")
        return DONE


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, config: TransportConfig) -> None:
        self.config = config
        self._book = HandleBook(config.xfer_timeout_s)
        self._links: dict[str, _PeerLink] = {}
        self._layout: KVLayout | None = None
        self._receiver: KVReceiver | None = None
        self._closed = False
        self._tls = config.tls.client_context() if config.tls is not None else None  # senders' side

    def describe(self) -> str:
        where = f" on {self._receiver.address}" if self._receiver else ""
        return f"tcp{where}{', mutual TLS' if self._tls is not None else ''}"

    @property
    def layout(self) -> KVLayout:
        if self._closed:
            raise TransferError("transport is closed")
        if self._layout is None:
            raise TransferError("call register(kv) before using the transport")
        return self._layout

    def register(self, kv: torch.Tensor) -> KVLayout:
        if self._layout is not None:
            raise TransferError("register() was already called: a transport serves one KV tensor")
        layout = KVLayout.of(kv)
        self._regions = region_view(kv, layout)  # [L, 2, N, words]: whole regions
        self._heads = kv  # [L, 2, N, block, heads, dim]: for writes of some heads only
        self._receiver = KVReceiver(self.config, layout, self._regions, kv)
        self._layout = layout
        return layout

    def local_descriptor(self) -> bytes:
        layout = self.layout
        assert self._receiver is not None
        return PeerDescriptor(
            transport=self.name,
            name=self.config.worker_name,
            epoch=self.config.epoch,
            layout=layout,
            address=self._receiver.address,
        ).to_bytes()

    def add_peer(self, descriptor: bytes) -> PeerId:
        desc = PeerDescriptor.accept(descriptor, self.name, self.layout)
        old = self._links.get(desc.name)
        if old is not None and old.id == desc.peer_id:
            return old.id
        link = _PeerLink(self, desc)
        link.connect()
        if old is not None:
            self._drop(
                old, f"peer {desc.name} restarted: epoch {old.id.epoch} replaced by {desc.epoch}"
            )
        self._links[desc.name] = link
        link.thread.start()
        return desc.peer_id

    def remove_peer(self, peer: PeerId) -> None:
        link = self._links.get(peer.name)
        if link is not None and link.id == peer:
            self._drop(link, f"peer {peer} was removed")

    def _drop(self, link: _PeerLink, reason: str) -> None:
        self._links.pop(link.id.name, None)
        for write in self._book.live_for(link.id):
            self._book.finish(write.handle.id, TransferStatus.failed(reason))
        link.close()

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
        ours = self.layout
        link = self._links.get(peer.name)
        theirs = link.desc.layout if link is not None else ours
        local, remote, layers = resolve_write(
            ours, theirs, peer, local_block_ids, remote_block_ids, layers, heads
        )
        region = ours.region_bytes if heads is None else ours.region_bytes // ours.num_kv_heads * heads.count
        write = self._book.open(peer, len(local) * len(layers) * 2 * region, after,
                                ready if self.config.wait_for_ready else None)
        if link is None or link.id != peer:
            reason = f"peer {peer} is not connected (never added, removed or replaced)"
            self._book.finish(write.handle.id, TransferStatus.failed(reason))
            return write.handle
        ids = torch.from_numpy(local).to(self._regions.device)
        link.jobs.put(_Job(write, ids, remote.tolist(), layers, notify, heads))
        return write.handle

    def notify(self, peer: PeerId, message: bytes) -> TransferHandle:
        self.layout  # registered and not closed
        write = self._book.open(peer, 0, (), None)
        link = self._links.get(peer.name)
        if link is None or link.id != peer:
            reason = f"peer {peer} is not connected (never added, removed or replaced)"
            self._book.finish(write.handle.id, TransferStatus.failed(reason))
            return write.handle
        # a write frame of no blocks and no layers: the receiver only delivers its message
        no_blocks = torch.empty(0, dtype=torch.int64, device=self._regions.device)
        link.jobs.put(_Job(write, no_blocks, [], range(0, 0), message))
        return write.handle

    def poll(self, handle: TransferHandle) -> TransferStatus:
        return self._book.poll(handle.id)

    def release(self, handle: TransferHandle) -> None:
        self._book.release(handle.id)

    def notifications(self) -> list[Notification]:
        return self._receiver.take_notifications() if self._receiver else []

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for link in list(self._links.values()):
            self._drop(link, "transport closed")
        if self._receiver is not None:
            self._receiver.close()
