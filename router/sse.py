"""HTTP plumbing for long requests: client-disconnect detection and SSE responses.

Disconnects are seen through the ASGI `http.disconnect` message, which the server
delivers once the request body has been read; a watcher task waits for it next to
the work and cancels the work when it comes, so closing the backend iterators aborts
the engine requests at once (not at the next token).

The SSE stream is `data: <json>\\n\\n` events ending with `data: [DONE]\\n\\n`, and
nothing else: no comment / keep-alive lines (vLLM's bench client breaks on them).
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router.access import note_client_closed

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away; nobody is left to answer."""


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _race_disconnect(work: Awaitable[T], receive: Receive) -> asyncio.Future[T]:
    """Run `work` until it ends or the client disconnects, whichever comes first; the
    other is cancelled and awaited. Returns the work's (done or cancelled) future."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            t.cancel()  # no-op when done
        await asyncio.gather(task, watch, return_exceptions=True)
    return task


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` (body already read); if the client disconnects first, cancel it
    and raise ClientDisconnected."""
    task = await _race_disconnect(work, request.receive)
    if task.cancelled():
        note_client_closed(request.scope)
        raise ClientDisconnected()
    return task.result()


def sse_event(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode("utf-8")


SSE_DONE = b"data: [DONE]\n\n"


class SSEResponse(Response):
    """Streams `body` as SSE; on client disconnect cancels it; always awaits `on_close`
    (which must end the engine requests) exactly once."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        # like StreamingResponse: no body, so no Content-Length header
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.body_iter = body
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            pump = await _race_disconnect(self._pump(send), receive)
        finally:
            try:
                await self.body_iter.aclose()
            finally:
                await self.on_close()
        if pump.cancelled():  # the client's disconnect won the race
            note_client_closed(scope)
        elif pump.exception() is not None:
            exc = pump.exception()
            if isinstance(exc, OSError):  # the client went away mid-send
                note_client_closed(scope)
            else:
                log.error("SSE stream failed", exc_info=exc)

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iter:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
