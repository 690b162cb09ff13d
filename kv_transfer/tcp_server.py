"""Receiving side of the TCP transport, and the framing and buffers both sides use.

One thread accepts; one thread per connection reads frames in order, copies
each write into the KV tensor, queues its notification, then acknowledges. A
write is validated before its bytes are used: a bad one is drained and refused
(the connection stays usable); a malformed frame closes the connection.

A write's payload is its regions in (layer, k|v, block) order. Both sides move
it one layer at a time through a reusable host buffer, so memory stays bounded
by one layer of one write and the sender gathers layer l+1 while the receiver
scatters layer l.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import select
import socket
import struct
import threading
from typing import Any

import torch

from kv_transfer.base import KVLayout, LayoutMismatch, Notification, PeerId, TransportConfig

logger = logging.getLogger("tandem.kv_transfer.tcp")

_PREFIX = struct.Struct("!IQ")  # header length, payload length
_MAX_HEADER = 16 << 20


def send_message(sock: socket.socket, header: dict[str, Any], payload_len: int = 0) -> None:
    """Send prefix and header; the caller then sends exactly `payload_len` bytes."""
    head = json.dumps(header).encode()
    sock.sendall(_PREFIX.pack(len(head), payload_len) + head)


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], int]:
    """Read a prefix and header; returns (header, payload length still to read)."""
    head_len, payload_len = _PREFIX.unpack(_recv_exact(sock, _PREFIX.size))
    if head_len > _MAX_HEADER:
        raise ValueError(f"frame header of {head_len} bytes: not a tandem KV frame")
    return json.loads(_recv_exact(sock, head_len)), payload_len


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def region_view(kv: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """`kv` as `[L, 2, N, words]` of the widest integer dtype dividing a region:
    torch's index_select / index_copy_ are several times faster on 8-byte words
    than on bytes."""
    word = next(w for w in (8, 4, 2, 1) if layout.region_bytes % w == 0)
    as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
    return kv.view(layout.num_layers, 2, layout.num_blocks, -1).view(as_int)


class LayerBuffer:
    """A reusable host buffer holding one layer of a write: `[2, blocks, words]`."""

    def __init__(self, like: torch.Tensor) -> None:
        self._dtype = like.dtype
        self._words = like.shape[-1]
        self._buf = torch.empty(0, dtype=like.dtype)

    def take(self, num_blocks: int) -> torch.Tensor:
        need = 2 * num_blocks * self._words
        if self._buf.numel() < need:
            self._buf = torch.empty(need, dtype=self._dtype)
        return self._buf[:need].view(2, num_blocks, self._words)

    def take_bytes(self, n: int) -> torch.Tensor:
        """`n` bytes of the buffer, as uint8 (a write of some heads: its own shape)."""
        size = self._buf.element_size()
        words = -(-n // size)
        if self._buf.numel() < words:
            self._buf = torch.empty(words, dtype=self._dtype)
        return self._buf[:words].view(torch.uint8)[:n]


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


class KVReceiver:
    """Accepts writes from peers into `regions`, the KV tensor as `region_view`."""

    def __init__(self, config: TransportConfig, layout: KVLayout, regions: torch.Tensor,
                 kv: torch.Tensor | None = None) -> None:
        self.config = config
        self.layout = layout
        self.regions = regions
        self.kv = kv  # [L, 2, N, block, heads, dim]: where writes of some heads land
        self._inbox: list[Notification] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._tls = config.tls.server_context() if config.tls is not None else None
        self._listener = socket.create_server((config.bind_host, config.port))
        self._listener.settimeout(0.2)
        host, port = self._listener.getsockname()[:2]
        self.address = f"{config.advertise_host or host}:{port}"
        self._thread = threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True)
        self._thread.start()

    def take_notifications(self) -> list[Notification]:
        with self._lock:
            out, self._inbox = self._inbox, []
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self.config.io_timeout_s)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="kv-tcp-recv", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self._tls is not None:  # on this connection's thread: a slow handshake holds no other
                plain = conn
                try:
                    conn = self._tls.wrap_socket(plain, server_side=True)
                except OSError as e:  # ssl.SSLError included: no certificate, or one the CA did not sign
                    logger.warning("kv receiver: TLS handshake refused: %s", e)
                    return
                with self._lock:
                    self._conns.discard(plain)
                    self._conns.add(conn)
            peer = self._handshake(conn)
            if peer is not None:
                _Connection(self, conn, peer).run()
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.info("kv receiver: connection closed: %s: %s", type(e).__name__, e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket) -> PeerId | None:
        hello, _ = recv_message(conn)
        reason = self._refusal(hello)
        send_message(conn, {"ok": reason is None, "reason": reason})
        if reason is not None:
            logger.warning("kv receiver: refused %s: %s", hello.get("name"), reason)
            return None
        return PeerId(str(hello["name"]), str(hello["epoch"]))

    def _refusal(self, hello: dict[str, Any]) -> str | None:
        """Why a HELLO is refused, or None to accept it."""
        if hello.get("kind") != "hello":
            return "expected a hello message"
        expected = (self.config.token or "").encode()
        if expected and not hmac.compare_digest(expected, str(hello.get("token", "")).encode()):
            return "bad token: the sender is not a member of this cluster"
        if hello.get("target_epoch") != self.config.epoch:
            return (
                f"stale descriptor: it names epoch {hello.get('target_epoch')}, "
                f"this worker now runs epoch {self.config.epoch}"
            )
        try:
            self.layout.check_compatible(KVLayout(**hello["layout"]), str(hello.get("name")))
        except (LayoutMismatch, TypeError, ValueError) as e:
            return str(e)
        return None

    def deliver(self, notification: Notification) -> None:
        with self._lock:
            self._inbox.append(notification)

    def stopping(self) -> bool:
        return self._stop.is_set()


class _Connection:
    """One sender's stream of write frames."""

    def __init__(self, receiver: KVReceiver, conn: socket.socket, peer: PeerId) -> None:
        self.rx, self.conn, self.peer = receiver, conn, peer
        self.buffer = LayerBuffer(receiver.regions)

    def run(self) -> None:
        while not self.rx.stopping():
            readable, _, _ = select.select([self.conn], [], [], 0.5)
            if not readable:
                continue
            header, payload_len = recv_message(self.conn)
            if header.get("kind") != "write":
                raise ValueError(f"unexpected message kind {header.get('kind')!r}")
            reason = self._invalid(header, payload_len)
            if reason is None:
                self._apply(header)
            else:
                self._drain(payload_len)
            send_message(
                self.conn, {"id": header.get("id"), "ok": reason is None, "reason": reason}
            )

    def _invalid(self, header: dict[str, Any], payload_len: int) -> str | None:
        """Why a write cannot be applied, or None; raises on a malformed frame."""
        layout = self.rx.layout
        start, stop = header["layers"]
        remote = header["remote"]
        heads = header.get("heads")
        region = layout.region_bytes
        if heads is not None:
            dst, count = int(heads[0]), int(heads[1])
            if count < 1 or dst < 0 or dst + count > layout.num_kv_heads or self.rx.kv is None:
                return f"heads [{dst}, {dst + count}) outside this worker's {layout.num_kv_heads} KV heads"
            region = region // layout.num_kv_heads * count
        expected = (stop - start) * 2 * len(remote) * region
        if payload_len != expected:
            raise ValueError(f"payload of {payload_len} bytes, header implies {expected}")
        if start == stop == 0 and not remote:  # a message only (Transport.notify)
            return None if header.get("notify") is not None else "a write of no blocks carries no message"
        if not 0 <= start < stop <= layout.num_layers:
            return f"layers [{start}, {stop}) out of range [0, {layout.num_layers})"
        bad = [b for b in remote if not 0 <= b < layout.num_blocks]
        if bad:
            return f"block id {bad[0]} out of range [0, {layout.num_blocks})"
        return None

    def _drain(self, n: int) -> None:
        while n > 0:
            view = as_bytes(self.buffer.take(1))[:n]
            recv_into_exact(self.conn, view)
            n -= view.nbytes

    def _apply(self, header: dict[str, Any]) -> None:
        regions = self.rx.regions
        start, stop = header["layers"]
        ids = torch.tensor(header["remote"], dtype=torch.long, device=regions.device)
        heads = header.get("heads")
        if heads is not None:
            kv = self.rx.kv
            dst, count = int(heads[0]), int(heads[1])
            shape = (2, len(ids), kv.shape[3], count, kv.shape[5])
            n = 2 * len(ids) * kv.shape[3] * count * kv.shape[5] * kv.element_size()
            for layer in range(start, stop):
                chunk = self.buffer.take_bytes(n)
                recv_into_exact(self.conn, as_bytes(chunk))
                kv[layer][:, ids, :, dst:dst + count] = chunk.view(kv.dtype).view(shape).to(kv.device)
        else:
            for layer in range(start, stop):
                chunk = self.buffer.take(len(ids))
                recv_into_exact(self.conn, as_bytes(chunk))
                regions[layer].index_copy_(1, ids, chunk.to(regions.device))
        if regions.is_cuda and stop > start:
            torch.cuda.current_stream(regions.device).synchronize()
        if header.get("notify") is not None:
            self.rx.deliver(Notification(self.peer, base64.b64decode(header["notify"])))
