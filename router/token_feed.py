"""The router's end of the decode workers' token feeds (decode_worker/feed.py).

One FeedReader per decode worker client, opened on first use: one Feed RPC whose
messages carry every step's tokens for all of this router's requests on that worker.
A request registers before its Decode call goes out and names the feed in it; its
tokens then arrive on its own queue, whether the worker put them on the feed or (if the
feed was not open there yet) on the request's own stream. The request's Decode stream
stays the authority on errors and on the end: a feed that breaks puts FEED_LOST on
every queue, and the worker ends those requests' streams with UNAVAILABLE.

The feed asks the worker to move its batches to a plain TCP connection (FeedRequest.
socket; decode_worker/feed.py FeedSocket): the worker's first message then names a port
and a one-time key, the reader connects to the worker's host on that port, sends the key,
and reads length-prefixed FeedBatch frames (worker_runtime/frames.py) while the RPC stays
open as the feed's lifeline. A gRPC message cost about 80 us of CPU at each end, a frame
12-32 us (docs/performance.md). A worker that does not move the feed keeps sending on the
stream; TANDEM_FEED_SOCKET=0 does not ask.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref

import grpc

from protos import tandem_pb2 as pb
from router import envs
from worker_runtime.client import RPC_ERRORS, WorkerClient
from worker_runtime.frames import frame, read_frame
from worker_runtime.rpc import cluster_tls

log = logging.getLogger(__name__)

FEED_LOST = object()  # queued for every registered request when the feed ends
REOPEN_S = 1.0  # after a feed ended, requests use their own streams this long before a new one opens
CONNECT_S = 5.0  # bound on connecting to a worker's feed socket

_readers: "weakref.WeakKeyDictionary[WorkerClient, FeedReader]" = weakref.WeakKeyDictionary()


def reader_for(client: WorkerClient) -> "FeedReader | None":
    """The feed reader of a decode worker's client (None with TANDEM_TOKEN_FEED=0)."""
    if not envs.token_feed():
        return None
    r = _readers.get(client)
    if r is None:
        r = _readers[client] = FeedReader(client)
    return r


class FeedReader:
    def __init__(self, client: WorkerClient) -> None:
        # the stub and metadata, not the client: `_readers` holds the client weakly, and
        # a reader that referred to it would keep its entry alive after the pool dropped it
        self.stub, self.metadata, self.worker_id = client.stub, client.metadata, client.worker_id
        self.host = client.address.rsplit(":", 1)[0].strip("[]")  # where its feed socket listens
        self.feed_id = ""
        self._queues: dict[str, asyncio.Queue] = {}
        self._task: asyncio.Task | None = None
        self._ended_at = -float("inf")
        self.socket = envs.feed_socket()  # ask for the socket (off after one could not be reached)

    def register(self, request_id: str) -> tuple[asyncio.Queue, str]:
        """A queue for the request's tokens, and the feed id to put in its DecodeRequest
        ("" while a feed that just ended waits to be reopened: tokens then come on the
        request's own stream, into the same queue)."""
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        if self._task is None or self._task.done():
            if time.monotonic() - self._ended_at < REOPEN_S:
                return q, ""
            self._open()
        return q, self.feed_id

    def release(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def _open(self) -> None:
        self.feed_id = uuid.uuid4().hex
        try:
            call = self.stub.Feed(pb.FeedRequest(feed_id=self.feed_id, socket=self.socket),
                                  metadata=self.metadata)
        except grpc.aio.UsageError:  # the client was closed: its worker left the pool
            self._ended_at, self.feed_id = time.monotonic(), ""
            return
        self._task = asyncio.get_running_loop().create_task(self._read(call))

    def _deliver(self, batch: pb.FeedBatch) -> None:
        for item in batch.items:
            q = self._queues.get(item.request_id)
            if q is not None:
                q.put_nowait(item.tokens)

    async def _read(self, call) -> None:
        try:
            while True:  # read(), not `async for`: the socket's lifeline reads the call too
                batch = await call.read()
                if batch is grpc.aio.EOF:
                    break
                if batch.socket_port:
                    await self._read_socket(call, batch.socket_port, batch.socket_key)
                    break
                self._deliver(batch)
        except RPC_ERRORS as e:
            if not isinstance(e, grpc.aio.AioRpcError) or e.code() != grpc.StatusCode.CANCELLED:
                log.info("token feed from %s ended: %s", self.worker_id, e)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as e:
            log.info("token feed socket from %s ended: %s", self.worker_id, e or type(e).__name__)
        finally:
            self._ended_at = time.monotonic()
            call.cancel()
            for q in self._queues.values():
                q.put_nowait(FEED_LOST)

    async def _read_socket(self, call, port: int, key: bytes) -> None:
        """The feed's batches from the worker's socket, until either the connection or the
        RPC ends (the worker ends the RPC when it closes the feed)."""
        try:
            tls = cluster_tls()  # the worker's feed socket speaks mutual TLS when the cluster does
            kw = {"ssl": tls.client_context(), "server_hostname": tls.server_name} if tls is not None else {}
            reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, port, **kw), CONNECT_S)
        except (OSError, asyncio.TimeoutError):
            self.socket = False  # unreachable from here (a firewall): this worker's feeds stay on gRPC
            raise
        lifeline = asyncio.get_running_loop().create_task(call.read())
        lifeline.add_done_callback(lambda _: writer.close())  # its end makes the next read fail
        try:
            writer.write(frame(key))
            while True:
                self._deliver(pb.FeedBatch.FromString(await read_frame(reader)))
        finally:
            lifeline.cancel()
            writer.close()
