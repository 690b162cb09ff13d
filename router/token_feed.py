"""The router's end of the decode workers' token feeds (decode_worker/feed.py).

One FeedReader per decode worker client, opened on first use: one Feed RPC whose
messages carry every step's tokens for all of this router's requests on that worker.
A request registers before its Decode call goes out and names the feed in it; its
tokens then arrive on its own queue, whether the worker put them on the feed or (if the
feed was not open there yet) on the request's own stream. The request's Decode stream
stays the authority on errors and on the end: a feed that breaks puts FEED_LOST on
every queue, and the worker ends those requests' streams with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref

import grpc

from engine import envs
from protos import tandem_pb2 as pb
from worker_runtime.client import RPC_ERRORS, WorkerClient

log = logging.getLogger(__name__)

FEED_LOST = object()  # queued for every registered request when the feed ends
REOPEN_S = 1.0  # after a feed ended, requests use their own streams this long before a new one opens

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
        self.feed_id = ""
        self._queues: dict[str, asyncio.Queue] = {}
        self._task: asyncio.Task | None = None
        self._ended_at = -float("inf")

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
            call = self.stub.Feed(pb.FeedRequest(feed_id=self.feed_id), metadata=self.metadata)
        except grpc.aio.UsageError:  # the client was closed: its worker left the pool
            self._ended_at, self.feed_id = time.monotonic(), ""
            return
        self._task = asyncio.get_running_loop().create_task(self._read(call))

    async def _read(self, call) -> None:
        try:
            async for batch in call:
                for item in batch.items:
                    q = self._queues.get(item.request_id)
                    if q is not None:
                        q.put_nowait(item.tokens)
        except RPC_ERRORS as e:
            if not isinstance(e, grpc.aio.AioRpcError) or e.code() != grpc.StatusCode.CANCELLED:
                log.info("token feed from %s ended: %s", self.worker_id, e)
        finally:
            self._ended_at = time.monotonic()
            call.cancel()
            for q in self._queues.values():
                q.put_nowait(FEED_LOST)
