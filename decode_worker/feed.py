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

Everything here runs on the worker's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine.events import TokenEvent
from protos import tandem_pb2 as pb
from worker_runtime.convert import can_join, token_events_to_pb


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
        self.closed = False
        self._pending: list[TokenEvent] = []
        self._wake = asyncio.Event()
        self._sinks: dict[str, FeedSink] = {}

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
        self.closed = True
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
        for rid, runs in per.items():
            for run in runs:
                batch.items.append(pb.FeedItem(request_id=rid, tokens=token_events_to_pb(run).tokens))
            if runs[-1][-1].finished:
                finished.append(rid)
        return batch, finished
