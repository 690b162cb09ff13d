"""Token feeds: one stream per (router, decode worker) that carries every step's tokens
for all of that router's requests on this worker.

With one Decode stream per request, a step of B sequences costs B gRPC messages on the
worker's event loop and B reads on the router's: at full load on the 11M model that was
a third of the worker's CPU samples, most of it inside gRPC's own send path. A router
opens one Feed per decode worker and names it in each DecodeRequest; the worker then
puts the request's events on the feed, which sends what queued since its last message
as one FeedBatch (normally one step's worth). The request's own Decode stream still
carries the reservation, errors as gRPC statuses, and cancellation both ways: the
router closing it aborts the request, and it ends once the request's last event has
been sent on the feed. A feed that closes (its router went away, or the connection
broke) ends the Decode streams of its unfinished requests with UNAVAILABLE.

A router may ask for the batches on a plain TCP connection instead of the Feed stream
(FeedSocket below): the same FeedBatch messages as length-prefixed frames, which cost a
fraction of a gRPC message's CPU at both ends; the Feed stream then only says where to
connect and stays open as the feed's lifeline.

Everything here runs on the worker's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator

from engine.events import TokenEvent
from protos import tandem_pb2 as pb
from protos.tokens import can_join, fill_tokens
from worker_runtime.frames import frame, read_frame
from worker_runtime.rpc import cluster_tls

log = logging.getLogger(__name__)

KEY_BYTES = 16
ATTACH_S = 10.0  # a feed offered on the socket waits this long for the router's connection


class FeedClosed(Exception):
    """The feed a request was bound to closed before the request's last event was sent."""


class FeedSink:
    """Stands in for a request's event queue (`AsyncEngine.subscribe(..., sink)`):
    its events go to the feed; `done` resolves to True once the last one was sent on
    it, or to False if the feed closed first."""

    def __init__(self, feed: "TokenFeed", rid: str) -> None:
        self.feed, self.rid = feed, rid
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.saw_finished = False  # the request's finished event was handed to the feed

    def put_nowait(self, ev: TokenEvent) -> None:
        if ev.finished:
            self.saw_finished = True
        self.feed.put(ev)


class TokenFeed:
    def __init__(self, feed_id: str) -> None:
        self.feed_id = feed_id
        self.ended = asyncio.Event()  # set by close()
        self.attached = asyncio.Event()  # a router's connection took it (FeedSocket)
        self._pending: list[TokenEvent] = []
        self._wake = asyncio.Event()
        self._sinks: dict[str, FeedSink] = {}

    @property
    def closed(self) -> bool:
        return self.ended.is_set()

    def bind(self, rid: str) -> FeedSink:
        if self.closed:
            raise FeedClosed(f"token feed {self.feed_id} is closed")
        sink = self._sinks[rid] = FeedSink(self, rid)
        return sink

    def unbind(self, rid: str) -> None:
        self._sinks.pop(rid, None)

    def put(self, ev: TokenEvent) -> None:
        self._pending.append(ev)
        self._wake.set()

    async def batches(self) -> AsyncIterator[pb.FeedBatch]:
        """The Feed RPC's messages, until the caller stops iterating (the RPC ended)."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self.closed:  # closed from elsewhere: the RPC that offered it on the socket ended
                    return
                evs, self._pending = self._pending, []
                if not evs:
                    continue
                batch, finished = self._batch(evs)
                yield batch
                for rid in finished:  # sent: their Decode streams may end now
                    sink = self._sinks.pop(rid, None)
                    if sink is not None and not sink.done.done():
                        sink.done.set_result(True)
        finally:
            self.close()

    def close(self) -> None:
        """No more sends: every bound request's Decode stream learns it at once."""
        self.ended.set()
        self._wake.set()
        for sink in self._sinks.values():
            if not sink.done.done():
                sink.done.set_result(False)
        self._sinks.clear()

    @staticmethod
    def _batch(evs: list[TokenEvent]) -> tuple[pb.FeedBatch, list[str]]:
        """Each request's events in step order; consecutive ones that can share a Tokens
        message do (a request that produced several tokens since the last batch)."""
        per: dict[str, list[list[TokenEvent]]] = {}
        for ev in evs:
            runs = per.setdefault(ev.seq_id, [])
            if runs and can_join(runs[-1][-1], ev):
                runs[-1].append(ev)
            else:
                runs.append([ev])
        batch, finished = pb.FeedBatch(), []
        add = batch.items.add
        for rid, runs in per.items():
            for run in runs:
                item = add()
                item.request_id = rid
                fill_tokens(item.tokens, run)
            if runs[-1][-1].finished:
                finished.append(rid)
        return batch, finished


class FeedSocket:
    """A decode worker's listener for token feeds read over a plain TCP connection
    (FeedRequest.socket). The Feed RPC offers its feed here under a one-time random key
    and tells the router the port and the key; the router connects and sends the key as
    its first frame, and from then on the feed's batches go out on that connection, one
    frame each. Either end closing the connection, or the RPC ending, closes the feed:
    its requests' Decode streams then end with UNAVAILABLE, as with a broken gRPC feed.
    The key is the only credential: it was handed out on the authenticated RPC, lives
    until used or ATTACH_S, and a connection with a wrong key is closed unanswered."""

    def __init__(self) -> None:
        self._server: asyncio.AbstractServer | None = None
        self.port = 0
        self._offers: dict[bytes, TokenFeed] = {}

    async def start(self, host: str) -> int:
        tls = cluster_tls()  # with cluster TLS, the feed's connection is mutual TLS too
        self._server = await asyncio.start_server(self._serve, host, 0,
                                                  ssl=tls.server_context() if tls is not None else None)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def offer(self, feed: TokenFeed) -> bytes:
        key = secrets.token_bytes(KEY_BYTES)
        self._offers[key] = feed
        return key

    def withdraw(self, key: bytes) -> None:
        self._offers.pop(key, None)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for feed in list(self._offers.values()):
            feed.close()
        self._offers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        feed: TokenFeed | None = None
        watch: asyncio.Task | None = None
        try:
            key = await asyncio.wait_for(read_frame(reader, KEY_BYTES), ATTACH_S)
            feed = self._offers.pop(key, None)
            if feed is None:  # an offer is withdrawn before its feed closes
                return
            feed.attached.set()
            # the router never writes after the key: a read returning is its end closing
            watch = asyncio.get_running_loop().create_task(reader.read(1))
            watch.add_done_callback(lambda _: feed.close())
            async for batch in feed.batches():
                writer.write(frame(batch.SerializeToString()))
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as e:
            log.info("token feed connection from %s ended: %s", writer.get_extra_info("peername"), e)
        finally:
            if watch is not None:
                watch.cancel()
            if feed is not None:
                feed.close()
            writer.close()
