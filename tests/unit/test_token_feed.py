"""The decode worker's token feed (decode_worker/feed.py) on its own: what one batch
holds, when a request's Decode stream may end, and what closing the feed does."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from decode_worker.feed import FeedClosed, TokenFeed
from engine.events import TokenEvent, Usage
from engine.sequence import FinishReason

pytestmark = pytest.mark.unit


def ev(rid, tok, n, finished=False):
    return TokenEvent(seq_id=rid, token_id=tok, completion_tokens=n, finished=finished,
                      finish_reason=FinishReason.LENGTH if finished else None,
                      usage=Usage(prompt_tokens=3, completion_tokens=n) if finished else None)


async def test_one_batch_per_wake_with_each_requests_tokens_in_order():
    feed = TokenFeed("f")
    a, b = feed.bind("a"), feed.bind("b")
    batches = feed.batches()
    for e in (ev("a", 10, 1), ev("b", 20, 1), ev("a", 11, 2), ev("b", 21, 2, finished=True)):
        (a if e.seq_id == "a" else b).put_nowait(e)
    batch = await asyncio.wait_for(batches.__anext__(), 5)
    items = [(i.request_id, list(i.tokens.token_ids), i.tokens.first_index, i.tokens.finished) for i in batch.items]
    assert items == [("a", [10, 11], 0, False), ("b", [20, 21], 0, True)]
    assert batch.items[1].tokens.usage.completion_tokens == 2
    assert not b.done.done()  # sent only once gRPC asks for the next message
    nxt = asyncio.ensure_future(batches.__anext__())
    await asyncio.sleep(0)
    assert b.done.result() is True and b.saw_finished and not a.done.done()  # b's stream may end; a's goes on
    a.put_nowait(ev("a", 12, 3))
    batch = await asyncio.wait_for(nxt, 5)
    assert [(i.request_id, list(i.tokens.token_ids), i.tokens.first_index) for i in batch.items] == [("a", [12], 2)]
    await batches.aclose()  # the RPC ended: a's stream learns at once
    assert await a.done is False
    with pytest.raises(FeedClosed):
        feed.bind("c")


async def test_events_that_cannot_join_go_as_separate_items_in_order():
    feed = TokenFeed("f")
    s = feed.bind("a")
    batches = feed.batches()
    s.put_nowait(ev("a", 10, 1))
    s.put_nowait(ev("a", 12, 3))  # not consecutive (a speculative step's rows are, this is not)
    s.put_nowait(TokenEvent(seq_id="a", token_id=None, completion_tokens=3, finished=True,
                            finish_reason=FinishReason.ABORT, error="x"))
    batch = await asyncio.wait_for(batches.__anext__(), 5)
    toks = [(list(i.tokens.token_ids), i.tokens.finished) for i in batch.items]
    assert toks == [([10], False), ([12], True)]
    assert batch.items[1].tokens.finish_reason == "abort" and batch.items[1].tokens.error == "x"
    await batches.aclose()


async def test_the_routers_reader_does_not_outlive_its_worker_client():
    """The router keeps one reader per decode worker client, weakly: a client the pool
    dropped takes its reader with it."""
    import gc

    from router import token_feed
    from worker_runtime.client import WorkerClient

    client = WorkerClient("decode-x", "decode", "127.0.0.1:1")
    reader = token_feed.reader_for(client)
    assert reader is not None and token_feed.reader_for(client) is reader
    await client.close()
    del client, reader
    gc.collect()
    assert not any(r.worker_id == "decode-x" for r in token_feed._readers.values())


@contextlib.asynccontextmanager
async def feed_pair(monkeypatch, socket: bool):
    """A decode worker's real Feed RPC on a real gRPC server (the worker's engine is not
    needed for feeds) and the router's real reader on a real client, with the cluster
    token; all of it stopped on the way out."""
    from decode_worker.feed import FeedSocket
    from decode_worker.service import DecodeWorker
    from protos import tandem_pb2_grpc as pb_grpc
    from router import token_feed
    from worker_runtime.client import WorkerClient
    from worker_runtime.config import WorkerConfig
    from worker_runtime.rpc import start_server

    monkeypatch.setenv("TANDEM_FEED_SOCKET", "1" if socket else "0")
    worker = DecodeWorker(WorkerConfig(role="decode", worker_id="decode-feed", cluster_token="t0k"))
    worker.feed_socket = FeedSocket()
    await worker.feed_socket.start("127.0.0.1")
    server, port = await start_server(lambda s: pb_grpc.add_DecodeWorkerServicer_to_server(worker, s),
                                      "127.0.0.1", 0, "t0k")
    client = WorkerClient("decode-feed", "decode", f"127.0.0.1:{port}", "t0k")
    try:
        yield worker, server, token_feed.FeedReader(client)
    finally:
        await server.stop(0)
        await worker.feed_socket.stop()
        await client.close()


async def _bound(worker, feed_id, rid, attached: bool):
    for _ in range(500):  # the Feed RPC (and the socket) come up in the background
        feed = worker.feeds.get(feed_id)
        if feed is not None and (feed.attached.is_set() or not attached):
            return feed.bind(rid)
        await asyncio.sleep(0.01)
    raise AssertionError(f"feed {feed_id} never opened on the worker")


@pytest.mark.parametrize("socket", [True, False])
async def test_a_feed_carries_tokens_from_worker_to_router_and_its_end_reaches_both(monkeypatch, socket):
    from router.token_feed import FEED_LOST

    async with feed_pair(monkeypatch, socket) as (worker, server, reader):
        q, feed_id = reader.register("a")
        assert feed_id
        sink = await _bound(worker, feed_id, "a", attached=socket)
        assert worker.feeds[feed_id].attached.is_set() is socket  # on the socket only when asked
        sink.put_nowait(ev("a", 10, 1))
        sink.put_nowait(ev("a", 11, 2))
        got = await asyncio.wait_for(q.get(), 10)
        assert list(got.token_ids) == [10, 11] and got.first_index == 0
        sink.put_nowait(ev("a", 12, 3, finished=True))
        got = await asyncio.wait_for(q.get(), 10)
        assert list(got.token_ids) == [12] and got.finished
        assert await asyncio.wait_for(sink.done, 10) is True
        # the worker side goes away: the router's requests learn it, and so do the worker's
        other = worker.feeds[feed_id].bind("b")
        if socket:
            await worker.feed_socket.stop()
            worker.feeds[feed_id].close()
        else:
            await server.stop(0)
        assert await asyncio.wait_for(q.get(), 10) is FEED_LOST
        assert await asyncio.wait_for(other.done, 10) is False
        for _ in range(500):
            if feed_id not in worker.feeds:
                break
            await asyncio.sleep(0.01)
        assert feed_id not in worker.feeds


async def test_a_feed_socket_connection_with_a_wrong_key_gets_nothing(monkeypatch):
    from worker_runtime.frames import frame

    async with feed_pair(monkeypatch, True) as (worker, _, _):
        feed = TokenFeed("f")
        worker.feed_socket.offer(feed)
        r, w = await asyncio.open_connection("127.0.0.1", worker.feed_socket.port)
        w.write(frame(b"x" * 16))
        assert await asyncio.wait_for(r.read(), 10) == b""  # closed unanswered
        w.close()
        assert not feed.attached.is_set() and not feed.closed


async def test_a_feed_socket_the_router_cannot_reach_leaves_that_workers_feeds_on_grpc(monkeypatch):
    from router.token_feed import FEED_LOST

    async with feed_pair(monkeypatch, True) as (worker, _, reader):
        reader.host = "127.0.0.2"  # loopback, but nothing listens there: refused
        q, feed_id = reader.register("a")
        assert await asyncio.wait_for(q.get(), 10) is FEED_LOST
        assert reader.socket is False
        reader._ended_at = -float("inf")  # past REOPEN_S
        q2, feed_id2 = reader.register("b")
        assert feed_id2 and feed_id2 != feed_id
        sink = await _bound(worker, feed_id2, "b", attached=False)
        sink.put_nowait(ev("b", 5, 1))
        got = await asyncio.wait_for(q2.get(), 10)
        assert list(got.token_ids) == [5]
        assert not worker.feeds[feed_id2].attached.is_set()  # on the gRPC stream
