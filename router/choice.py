"""One choice = one engine request: token batches in, text deltas out.

`ChoiceRun` applies detokenization and stop strings (engine/output.py TextStream),
ends the engine request as soon as a stop string completes (closing the backend
iterator aborts it on the workers), keeps the counts `usage` needs and feeds the
metrics timer. `start()` waits for the first batch, so overload and admission errors
surface before any response byte is sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Iterable, TypeVar

from engine.events import TokenLogprobs
from engine.output import TextStream
from protos.tokens import TokenBatch
from router.backend import Backend, BackendError, GenerateRequest
from router.metrics import ChoiceTimer

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None  # set on a choice's last delta


@dataclass
class ChoiceResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


class ChoiceRun:
    def __init__(self, index: int, prompt_index: int, backend: Backend, request: GenerateRequest,
                 stream: TextStream, timer: ChoiceTimer) -> None:
        self.index = index
        self.prompt_index = prompt_index
        self.prompt_tokens = len(request.prompt_ids)
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.draft_tokens = self.accepted_tokens = 0  # speculative decoding, known at the end
        self.finish_reason: str | None = None
        self._gen: AsyncIterator[TokenBatch] = backend.generate(request)
        self._stream = stream
        self._timer = timer
        self._first: TokenBatch | None = None
        self.prompt_logprobs: list[TokenLogprobs] | None = None  # from the first batch, when asked for
        self._first_at = 0.0

    @property
    def first_token_at(self) -> float | None:
        """When the first token reached the router (time.monotonic), if one has."""
        return self._timer.first

    async def start(self) -> None:
        """Wait for the first batch (raises BackendError when not accepted)."""
        try:
            self._first = await self._gen.__anext__()
            self._first_at = time.monotonic()
        except StopAsyncIteration:
            raise BackendError("the backend ended the request without output") from None

    async def deltas(self) -> AsyncIterator[Delta]:
        """Text deltas until the choice finishes; BackendError if the request fails."""
        batch, self._first = self._first, None
        if batch is None:
            raise RuntimeError("ChoiceRun.deltas() needs start() first, and runs once")
        at: float | None = self._first_at  # the first batch came in start()
        while True:
            delta = self._apply(batch, at)
            if delta.finish_reason and not batch.finished:
                await self._gen.aclose()  # a stop string ended it: abort the engine request
            if delta.token_ids or delta.finish_reason:
                yield delta
            if delta.finish_reason:
                return
            batch, at = await anext(self._gen, None), None
            if batch is None:
                raise BackendError("the backend stream ended before the request finished")

    async def collect(self) -> ChoiceResult:
        out = ChoiceResult()
        async for d in self.deltas():
            out.text += d.text
            out.token_ids += d.token_ids
            out.logprobs += d.logprobs
            out.finish_reason = d.finish_reason
        return out

    def _apply(self, batch: TokenBatch, at: float | None) -> Delta:
        if batch.finish_reason in ("error", "abort"):
            raise BackendError(batch.error or f"the request ended with {batch.finish_reason}",
                               503 if batch.finish_reason == "abort" else 500)
        self.cached_tokens = max(self.cached_tokens, batch.cached_tokens)
        if batch.finished:
            self.draft_tokens, self.accepted_tokens = batch.draft_tokens, batch.accepted_tokens
        if batch.prompt_logprobs:
            self.prompt_logprobs = batch.prompt_logprobs
        self.completion_tokens += len(batch.token_ids)
        self._timer.on_tokens(len(batch.token_ids), self.prompt_tokens, self.cached_tokens, at)
        step = self._stream.add(batch.token_ids)
        text, reason = step.text, None
        if step.stopped:
            reason = "stop"
        elif batch.finished:
            text += self._stream.finish()
            reason = "stop" if self._stream.stopped else (batch.finish_reason or "stop")
        if reason is not None:
            self.finish_reason = reason
            self._timer.finish(reason)
        return Delta(text, batch.token_ids, batch.logprobs, reason)  # the batch's own lists: nobody keeps it

    async def close(self) -> None:
        """End the engine request (an abort unless it already finished)."""
        if self.finish_reason is None:
            self._timer.finish("abort")
        try:
            await self._gen.aclose()
        except RuntimeError as e:  # still being iterated: its task must be cancelled first
            log.warning("choice %d: cannot close its stream: %s", self.index, e)


async def all_or_nothing(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Run awaitables concurrently; on the first failure (or cancellation) cancel
    the rest and wait for them, so nobody is left iterating a stream."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merge(runs: list[ChoiceRun]) -> AsyncIterator[tuple[ChoiceRun, Delta]]:
    """Deltas of several choices as they come; raises the first choice's error."""
    if len(runs) == 1:
        async for d in runs[0].deltas():
            yield runs[0], d
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(run: ChoiceRun) -> None:
        try:
            async for d in run.deltas():
                queue.put_nowait((run, d))
            queue.put_nowait((run, end))
        except Exception as e:
            queue.put_nowait((run, e))

    tasks = [asyncio.ensure_future(pump(r)) for r in runs]
    try:
        live = len(runs)
        while live:
            run, item = await queue.get()
            if item is end:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield run, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
