"""HTTP plumbing for long requests: client-disconnect detection and SSE responses.

Disconnects are seen through the ASGI `http.disconnect` message, which the server
delivers once the request body has been read; a watcher task waits for it next to
the work and cancels the work when it comes, so closing the backend iterators aborts
the engine requests at once (not at the next token).

The SSE stream is `data: <json>\\n\\n` events ending with `data: [DONE]\\n\\n`, and
nothing else: no comment / keep-alive lines (vLLM's bench client breaks on them).

A server that stops puts an event in the scope (`CUTOFF_KEY`, set by
router.shutdown.DrainMiddleware) and sets it when its grace ends: the work racing it is
cancelled like a disconnect's, and the client is still there to be told. A stream ends
with a `shutting_down` error event and `[DONE]`; a request not yet answered gets a 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router.access import note_client_closed, note_cut_at_shutdown
from router.errors import ApiError

log = logging.getLogger(__name__)
T = TypeVar("T")


CUTOFF_KEY = "tandem.cutoff"  # scope key: the Cutoff set when the shutdown grace ends


class Cutoff:
    """A flag that coroutines on any event loop can wait for. (asyncio.Event binds to
    the first loop that waits on it and then fails on any other: Starlette's test
    client runs each request on a loop of its own.)"""

    def __init__(self) -> None:
        self._set = False
        self._waiters: set[asyncio.Future] = set()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        for fut in list(self._waiters):
            fut.get_loop().call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))

    async def wait(self) -> None:
        if self._set:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        try:
            await fut
        finally:
            self._waiters.discard(fut)


class ClientDisconnected(Exception):
    """The client went away; nobody is left to answer."""


def shutdown_error() -> ApiError:
    """What a request still running at the end of the shutdown grace is told."""
    return ApiError(503, "the server shut down before this request finished (its shutdown grace ended); "
                         "retry it on another replica", None, "shutting_down", retry_after=1.0,
                    headers={"Connection": "close"})


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _race_disconnect(work: Awaitable[T], receive: Receive,
                           cutoff: Cutoff | None = None) -> tuple[asyncio.Future[T], str]:
    """Run `work` until it ends, the client disconnects or `cutoff` is set, whichever
    comes first; the others are cancelled and awaited. Returns the work's (done or
    cancelled) future and what ended it: "done", "disconnect" or "cutoff"."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    waiters = {task, watch}
    stop = asyncio.ensure_future(cutoff.wait()) if cutoff is not None else None
    if stop is not None:
        waiters.add(stop)
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in waiters:
            t.cancel()  # no-op when done
        await asyncio.gather(*waiters, return_exceptions=True)
    if not task.cancelled():
        return task, "done"
    if watch.done() and not watch.cancelled():
        return task, "disconnect"  # nobody to tell, even when the cutoff came too
    cut = stop is not None and stop.done() and not stop.cancelled() and stop.exception() is None
    return task, "cutoff" if cut else "disconnect"


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` (body already read); if the client disconnects first, cancel it
    and raise ClientDisconnected; if the shutdown grace ends first, cancel it and
    raise the 503 `shutting_down` ApiError."""
    task, why = await _race_disconnect(work, request.receive, request.scope.get(CUTOFF_KEY))
    if why == "disconnect":
        note_client_closed(request.scope)
        raise ClientDisconnected()
    if why == "cutoff":
        note_cut_at_shutdown(request.scope)
        raise shutdown_error()
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
        self._started = False
        try:
            pump, why = await _race_disconnect(self._pump(send), receive, scope.get(CUTOFF_KEY))
        finally:
            try:
                await self.body_iter.aclose()
            finally:
                await self.on_close()
        if why == "disconnect":
            note_client_closed(scope)
        elif why == "cutoff":  # the client is still there: say why the stream ends here
            note_cut_at_shutdown(scope)
            try:
                if not self._started:
                    await send({"type": "http.response.start", "status": self.status_code,
                                "headers": self.raw_headers})
                await send({"type": "http.response.body", "more_body": False,
                            "body": sse_event(json.dumps(shutdown_error().body())) + SSE_DONE})
            except OSError:
                note_client_closed(scope)
        elif pump.exception() is not None:
            exc = pump.exception()
            if isinstance(exc, OSError):  # the client went away mid-send
                note_client_closed(scope)
            else:
                log.error("SSE stream failed", exc_info=exc)

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self._started = True
        async for chunk in self.body_iter:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
