"""KVEventHub: a worker's prefix-cache changes, streamed to routers.

Lives on the engine thread: `subscribe` (run there through EngineLoop.call) takes a
snapshot of the cached hashes and registers the subscriber in one go, so no change
falls between the snapshot and the stream; `publish` (engine thread, once per step)
hands each subscriber its batch through the event loop.
"""

from __future__ import annotations

import asyncio

from engine.block_pool import BlockPool
from protos import tandem_pb2 as pb


class KVEventHub:
    def __init__(self, pool: BlockPool, worker_id: str, epoch: int, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.worker_id = worker_id
        self.epoch = epoch
        self.loop = loop
        self._subs: list[asyncio.Queue] = []

    def subscribe(self) -> asyncio.Queue:
        """Engine thread. The queue starts with a full snapshot."""
        self.pool.drain_events()  # everything so far is in the snapshot
        q: asyncio.Queue = asyncio.Queue()  # bounded by the subscriber's RPC: cancelled -> unsubscribed
        snap = pb.KVEventBatch(worker_id=self.worker_id, epoch=self.epoch, cleared=True,
                               stored=self.pool.device_hashes(), offloaded=self.pool.offloaded_hashes())
        self.loop.call_soon_threadsafe(q.put_nowait, snap)
        self._subs.append(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        """Engine thread."""
        if q in self._subs:
            self._subs.remove(q)

    def publish(self) -> None:
        """Engine thread, after each step."""
        events = self.pool.drain_events()
        if not events or not self._subs:
            return
        batch = pb.KVEventBatch(worker_id=self.worker_id, epoch=self.epoch)
        for ev in events:
            if ev.kind == "stored":
                batch.stored.extend(ev.hashes)
            elif ev.kind == "removed":
                batch.removed.extend(ev.hashes)
            elif ev.kind == "offloaded":
                batch.offloaded.extend(ev.hashes)
            else:
                batch.cleared = True
                del batch.stored[:]
                del batch.removed[:]
                del batch.offloaded[:]
        for q in list(self._subs):
            self.loop.call_soon_threadsafe(q.put_nowait, batch)
