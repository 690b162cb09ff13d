"""AsyncEngine: LLMEngine on a thread of its own, driven from asyncio.

Every engine mutation runs on the engine thread (commands are queued to it), so the
engine needs no locks; the forward pass releases the GIL, so the event loop serving
gRPC / HTTP stays responsive while a step runs. Events of one step are handed to the
loop in one call and fanned out to per-request queues there.

Fatal path (one per process): if a step raises, every live request gets an error
event, the engine is marked dead and `healthy` turns False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import queue
import threading
from typing import AsyncIterator, Callable

from decode_worker.engine import LLMEngine, TokenEvent
from engine.sampling_params import SamplingParams
from engine.sequence import INTERACTIVE, FinishReason

log = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.02) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._subs: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: str | None = None
        self.on_step: Callable[[list[TokenEvent]], None] | None = None  # metrics hook (engine thread)

    # ---- lifecycle -------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    # ---- calls into the engine thread -----------------------------------------
    async def call(self, fn: Callable, *args, timeout: float = 30.0):
        """Run `fn(*args)` on the engine thread between steps; return its result."""
        if not self.healthy:
            raise EngineDead(self.error or "engine is not running")
        fut: cf.Future = cf.Future()
        self._commands.put((fn, args, fut))
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)

    def post(self, fn: Callable, *args) -> None:
        """Fire-and-forget variant of `call` (usable from any thread)."""
        self._commands.put((fn, args, None))

    # ---- requests ----------------------------------------------------------------
    def subscribe(self, seq_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._subs[seq_id] = q
        return q

    def unsubscribe(self, seq_id: str) -> None:
        self._subs.pop(seq_id, None)

    async def generate(self, seq_id: str, prompt_ids: list[int], params: SamplingParams,
                       priority: int = INTERACTIVE) -> AsyncIterator[TokenEvent]:
        """Prefill locally and decode; yields one event per new token, the last one
        finished. Closing the iterator early aborts the request."""
        q = self.subscribe(seq_id)
        try:
            await self.call(self.engine.add_request, seq_id, prompt_ids, params, priority)
        except BaseException:
            self.unsubscribe(seq_id)
            raise
        async for ev in self.events(seq_id, q):
            yield ev

    async def events(self, seq_id: str, q: asyncio.Queue) -> AsyncIterator[TokenEvent]:
        """Drain a subscribed request's events until it finishes; abort it if the
        consumer goes away first."""
        finished = False
        try:
            while not finished:
                ev: TokenEvent = await q.get()
                finished = ev.finished
                yield ev
        finally:
            self.unsubscribe(seq_id)
            if not finished and self.healthy:
                self.post(self.engine.abort, seq_id)

    # ---- engine thread -----------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                # idle: wait (bounded) for a command; reservations still get expired
                if not self._drain_commands(block=not self.engine.has_work()):
                    break
                if not (self.engine.has_work() or self.engine.scheduler.awaiting_kv):
                    continue
                events = self.engine.step()
                if events:
                    if self.on_step is not None:
                        self.on_step(events)
                    self._deliver(events)
        except Exception as e:  # the one fatal path of this process's engine
            log.exception("engine step failed")
            self.error = f"engine failure: {type(e).__name__}: {e}"
            self._fail_all(self.error)

    def _drain_commands(self, block: bool) -> bool:
        """Run queued commands; wait briefly for one when idle. False on shutdown."""
        try:
            item = self._commands.get(timeout=self.idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while item is not None:
            fn, args, fut = item
            try:
                res = fn(*args)
                if fut is not None:
                    fut.set_result(res)
            except Exception as e:
                if fut is not None:
                    fut.set_exception(e)
                else:
                    log.warning("engine command %s failed: %s", getattr(fn, "__name__", fn), e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _deliver(self, events: list[TokenEvent]) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fan_out, events)

    def _fan_out(self, events: list[TokenEvent]) -> None:
        for ev in events:
            q = self._subs.get(ev.seq_id)
            if q is not None:
                q.put_nowait(ev)

    def _fail_all(self, msg: str) -> None:
        events = [TokenEvent(sid, None, finished=True, finish_reason=FinishReason.ERROR, error=msg) for sid in list(self._subs)]
        self._deliver(events)
