"""The router's shutdown grace is a limit (router/shutdown.py, router/sse.py): when it
ends, a stream still running gets a `shutting_down` error event and `[DONE]`, a request
not yet answered gets a 503 with that code, both through their normal close path (the
engine side is told); work that ends within the grace is untouched. A real Starlette app
behind the real middleware, over httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from router.errors import install_error_handlers
from router.shutdown import Drain, DrainMiddleware
from router.sse import SSE_DONE, SSEResponse, sse_event, until_disconnect

pytestmark = pytest.mark.unit


def make_app(closed: list[str]):
    async def forever():
        n = 0
        while True:
            yield sse_event(json.dumps({"n": n}))
            n += 1
            await asyncio.sleep(0.01)

    async def short():
        yield sse_event(json.dumps({"n": 0}))
        yield SSE_DONE

    async def stream(request: Request):
        async def on_close():
            closed.append(request.query_params["name"])
        return SSEResponse(forever() if request.query_params["name"] == "long" else short(), on_close)

    async def wait(request: Request):
        async def work():
            await asyncio.sleep(3600)
        await until_disconnect(request, work())
        return JSONResponse({})

    app = Starlette(routes=[Route("/v1/stream", stream, methods=["POST"]),
                            Route("/v1/wait", wait, methods=["POST"])])
    install_error_handlers(app)
    drain = Drain(grace_s=0.3, retry_after_s=1.0)
    app.add_middleware(DrainMiddleware, drain=drain)
    return app, drain


def test_the_grace_ends_running_streams_and_requests_with_a_shutting_down_answer():
    closed: list[str] = []
    app, drain = make_app(closed)

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=10) as client:
            long = asyncio.create_task(client.post("/v1/stream?name=long"))
            waiting = asyncio.create_task(client.post("/v1/wait"))
            await asyncio.sleep(0.1)
            assert drain.in_flight == 2
            short = await client.post("/v1/stream?name=short")  # before the drain: runs whole
            result = await drain.run("test")
            return result, await long, await waiting, short

    result, long, waiting, short = asyncio.run(scenario())
    assert short.status_code == 200 and short.text.endswith("data: [DONE]\n\n")
    events = [line[6:] for line in long.text.split("\n\n") if line.startswith("data: ")]
    assert long.status_code == 200 and len(events) > 2 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "shutting_down"
    assert waiting.status_code == 503 and waiting.json()["error"]["code"] == "shutting_down"
    assert waiting.headers["retry-after"] == "1"
    assert sorted(closed) == ["long", "short"]  # the cut stream's engine side was closed too
    assert (result.started, result.cut, result.left, result.finished) == (2, 2, 0, 0)
    assert 0.3 <= result.waited_s < 1.3
    assert result.describe() == "0 of 2 finished, 2 ended with a shutting_down error when the grace ran out"


def test_work_that_ends_within_the_grace_is_not_cut():
    app, drain = make_app([])

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=10) as client:
            r = await client.post("/v1/stream?name=short")
            result = await drain.run("test")
            refused = await client.post("/v1/stream?name=short")
            return r, result, refused

    r, result, refused = asyncio.run(scenario())
    assert r.status_code == 200 and not drain.cutoff.is_set()
    assert result.describe() == "all 0 finished" and result.cut == 0
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"

