"""AsyncEngine: the decode engine on an EngineLoop, with per-request event streams.

Events of one step are fanned out to per-request asyncio queues on the event loop.
`poll_input` (optional) runs on the engine thread before each step, e.g. to turn
"KV landed" notifications from the transport into admitted requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from decode_worker.llm_engine import LLMEngine, TokenEvent
from engine.output import TextStream
from engine.sampling_params import SamplingParams
from engine.sequence import INTERACTIVE, FinishReason
from worker_runtime import envs
from worker_runtime.loop import EngineDead, EngineLoop  # noqa: F401 (re-exported)


@dataclass
class TextEvent:
    """One step of a request as text: the new token and the text that is now final
    (never a partial stop string). The last event has finished=True."""

    token_id: int | None
    text: str
    finished: bool
    finish_reason: str | None = None
    error: str | None = None


REMOTE_POLL_S = 0.0005  # poll interval while reservations wait for their KV


class AsyncEngine:
    def __init__(self, engine: LLMEngine, poll_input: Callable[[], list[TokenEvent]] | None = None,
                 abort: Callable[[str], object] | None = None, expects_input: Callable[[], bool] | None = None) -> None:
        self.engine = engine
        self.poll_input = poll_input
        # True while remote input is due soon (poll fast); default: any reservation waits
        self.expects_input = expects_input or (lambda: bool(engine.scheduler.awaiting_kv))
        self.abort = abort or engine.abort  # engine thread; must be idempotent
        self.on_step: Callable[[list[TokenEvent]], None] | None = None  # engine thread (metrics)
        self._subs: dict[str, asyncio.Queue] = {}
        self.loop = EngineLoop(self._step, self._wait_s, self._fan_out, self._fail_all, name="decode-engine",
                               on_idle=engine.runner.mark_idle)
        # on CPU a step's events go to the event loop as the next step enters its layers
        # (EngineLoop.flush says why); a CUDA step's host time is mostly Python with the GIL
        # held, so there they go as the step ends
        if engine.runner.device.type == "cpu" and envs.events_in_layers():
            self.loop.hold_results = True
            engine.runner.before_layers = self.loop.flush

    # ---- lifecycle -------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop.start(loop)

    def stop(self, timeout: float = 10.0) -> None:
        self.loop.stop(timeout)

    @property
    def healthy(self) -> bool:
        return self.loop.healthy

    @property
    def error(self) -> str | None:
        return self.loop.error

    async def call(self, fn: Callable, *args, timeout: float = 30.0):
        return await self.loop.call(fn, *args, timeout=timeout)

    def post(self, fn: Callable, *args) -> None:
        self.loop.post(fn, *args)

    # ---- requests ----------------------------------------------------------------
    def subscribe(self, seq_id: str, sink=None):
        """Send `seq_id`'s events to `sink` (anything with `put_nowait`, e.g. a token
        feed's FeedSink), or to a new queue; returns where they go."""
        q = asyncio.Queue() if sink is None else sink
        self._subs[seq_id] = q
        return q

    def unsubscribe(self, seq_id: str) -> None:
        self._subs.pop(seq_id, None)

    async def generate(self, seq_id: str, prompt_ids: list[int], params: SamplingParams,
                       priority: int = INTERACTIVE) -> AsyncIterator[TokenEvent]:
        """Prefill locally and decode; one event per new token, the last one finished.
        Closing the iterator early aborts the request."""
        q = self.subscribe(seq_id)
        try:
            await self.call(self.engine.add_request, seq_id, prompt_ids, params, priority)
        except BaseException:
            self.unsubscribe(seq_id)
            if self.healthy:  # cancelled while the add was queued: it may still run, so abort after it
                self.post(self.abort, seq_id)
            raise
        async with contextlib.aclosing(self.events(seq_id, q)) as events:
            async for ev in events:
                yield ev

    async def generate_text(self, seq_id: str, prompt_ids: list[int], params: SamplingParams, tokenizer,
                            priority: int = INTERACTIVE) -> AsyncIterator[TextEvent]:
        """`generate` with detokenized text deltas and stop strings applied; a stop string
        ends the request (finish_reason "stop") and aborts it in the engine."""
        stream = TextStream(tokenizer, params, prompt_ids)
        async with contextlib.aclosing(self.generate(seq_id, prompt_ids, params, priority)) as events:
            async for ev in events:
                delta = stream.add([ev.token_id]) if ev.token_id is not None else None
                if delta is not None and delta.stopped:
                    yield TextEvent(ev.token_id, delta.text, True, FinishReason.STOP.value)
                    return  # closing `events` aborts the request
                text = (delta.text if delta else "") + (stream.finish() if ev.finished else "")
                yield TextEvent(ev.token_id, text, ev.finished,
                                ev.finish_reason.value if ev.finish_reason else None, ev.error)

    async def events(self, seq_id: str, q: asyncio.Queue) -> AsyncIterator[TokenEvent]:
        """A subscribed request's events until it finishes; aborts it if the consumer
        goes away first."""
        finished = False
        try:
            while not finished:
                ev: TokenEvent = await q.get()
                finished = ev.finished
                yield ev
        finally:
            self.unsubscribe(seq_id)
            if not finished and self.healthy:
                self.post(self.abort, seq_id)

    # ---- engine thread -------------------------------------------------------------
    def _step(self) -> list[TokenEvent]:
        events = self.poll_input() if self.poll_input is not None else []
        if self.engine.has_work():
            events += self.engine.step()
        if events and self.on_step is not None:
            self.on_step(events)
        return events

    def _wait_s(self) -> float | None:
        if self.engine.has_work():
            return 0.0
        return REMOTE_POLL_S if self.expects_input() else None

    def _fan_out(self, events: list[TokenEvent]) -> None:
        for ev in events:
            q = self._subs.get(ev.seq_id)
            if q is not None:
                q.put_nowait(ev)

    def _fail_all(self, msg: str) -> None:
        self.loop.deliver([TokenEvent(seq_id=sid, token_id=None, finished=True, finish_reason=FinishReason.ERROR,
                                      error=msg) for sid in list(self._subs)])
