"""The decode worker's token feed (decode_worker/feed.py) on its own: what one batch
holds, when a request's Decode stream may end, and what closing the feed does."""

from __future__ import annotations

import asyncio

import pytest

from decode_worker.feed import FeedClosed, TokenFeed
from engine.events import TokenEvent
from engine.sequence import FinishReason

pytestmark = pytest.mark.unit


def ev(rid, tok, n, finished=False):
    return TokenEvent(rid, tok, finished=finished, finish_reason=FinishReason.LENGTH if finished else None,
                      num_prompt_tokens=3, num_output_tokens=n)


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
    s.put_nowait(TokenEvent("a", None, finished=True, finish_reason=FinishReason.ABORT, error="x", num_output_tokens=3))
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
