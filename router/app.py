"""The router's FastAPI app: OpenAI endpoints, probes, metrics and admin.

    app = create_app(backend, tokenizer, RouterSettings(...), admin=None)
    uvicorn.run(app, host=..., port=...)

Routes:
    POST /v1/completions, POST /v1/chat/completions   API key (if any configured)
    GET  /v1/models, GET /v1/models/{model}           API key (if any configured)
    GET  /health   process is up: 200
    GET  /ready    backend can serve now: 200, else 503 with Retry-After (and while draining)
    GET  /metrics  Prometheus text (router series plus any collectors passed in)
    GET/POST /admin/pools   admin key; 501 when the app has no admin object

Request bodies are read here (capped: 413) and parsed with pydantic, so every bad
input is an OpenAI error object with status 400 (never FastAPI's 422). There is no
OpenAPI/docs page: the API is OpenAI's. The lifespan starts and stops the backend
unless `settings.manage_backend` is False. `app.state.drain` (router/shutdown.py) counts
the requests in flight and, once a drain begins, answers new /v1 requests with 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Iterable, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from engine.build_info import build_info
from engine.tokenizer import Tokenizer
from router.access import AccessLogMiddleware
from router.admin import AdminInterface
from router.admission import Admission
from router.auth import KeyChecker, read_key_file
from router.backend import Backend
from router.drift import DriftCollector, DriftMonitor
from router.errors import ApiError, install_error_handlers
from router.metrics import RouterMetrics
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    PoolsUpdate,
    TokenizeRequest,
)
from router.serving import OpenAIServing
from router.settings import RouterSettings, SettingsError
from router.shutdown import Drain, DrainMiddleware
from router.sse import ClientDisconnected
from worker_runtime.prom import ConstLabels

log = logging.getLogger("tandem.admin")

__all__ = ["create_app", "RouterSettings"]
M = TypeVar("M", bound=BaseModel)
CLIENT_CLOSED = 499  # nginx's code for "client closed the request", used in metrics only


_INLINE_PARSE_BYTES = 256 * 1024


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 as soon as it is known to exceed `limit` bytes."""
    too_large = ApiError(413, f"request body is larger than {limit} bytes", None, "request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:  # gone before its body arrived: 499, not a 500 with a traceback
        raise ClientDisconnected() from None
    return b"".join(chunks)


def parse(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise ApiError.from_validation(e.errors(include_url=False)) from None


def create_app(backend: Backend, tokenizer: Tokenizer, settings: RouterSettings,
               admin: AdminInterface | None = None, collectors: Iterable[Collector] = ()) -> FastAPI:
    keys = set(settings.api_keys)
    if settings.api_key_file:
        keys.update(read_key_file(settings.api_key_file))
    if settings.admin_key and settings.admin_key in keys:
        raise SettingsError("the admin key must differ from every API key (including the key file's)")
    auth = KeyChecker(keys, settings.admin_key)
    admission = Admission(settings.max_concurrent_requests, settings.max_queued_requests,
                          settings.queue_timeout_s, settings.retry_after_s,
                          order=settings.admission_order, aging_s=settings.batch_aging_s)
    metrics = RouterMetrics(settings.served_model_name, settings.slos,
                            load=lambda: (admission.running, admission.waiting_by_class))
    metrics.admission_limits(settings.max_concurrent_requests, settings.max_queued_requests, settings.queue_timeout_s)
    metrics.drift = drift = DriftMonitor(settings.drift_reference, settings.drift_window_s, settings.drift_min_requests)
    metrics.register(DriftCollector(settings.served_model_name, drift))
    for c in collectors:  # the cluster's series, with the model's name like the router's own
        metrics.register(ConstLabels(c, {"model_name": settings.served_model_name}))
    serving = OpenAIServing(backend, tokenizer, settings, metrics, admission)
    drain = Drain(settings.shutdown_grace_s, settings.retry_after_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if settings.manage_backend:
            await backend.start()
        try:
            yield
        finally:
            if settings.manage_backend:
                await backend.stop()

    app = FastAPI(title="tandem router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.settings, app.state.metrics, app.state.admission = settings, metrics, admission
    app.state.backend, app.state.serving, app.state.drain = backend, serving, drain
    install_error_handlers(app, metrics.count_error)
    app.add_middleware(DrainMiddleware, drain=drain, on_refuse=metrics.count_error)
    app.add_middleware(AccessLogMiddleware)  # added last: outermost, so it sees every answer, 503s included

    async def openai_call(request: Request, model: type[M], handler) -> Response:
        arrival = time.monotonic()
        auth.require_api_key(request)
        admission.refuse_if_full()
        try:
            body = await read_body(request, settings.max_request_body_bytes)
            # a big body's JSON parse on a thread: the loop keeps serving between GIL slices
            req = (parse(model, body) if len(body) <= _INLINE_PARSE_BYTES
                   else await asyncio.to_thread(parse, model, body))
            return await handler(request, req, arrival)
        except ClientDisconnected:
            metrics.count_error(CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai_call(request, CompletionRequest, serving.completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai_call(request, ChatCompletionRequest, serving.chat)

    async def json_call(request: Request, model: type[M], handler) -> Response:
        auth.require_api_key(request)
        req = parse(model, await read_body(request, settings.max_request_body_bytes))
        return Response((await handler(req)).model_dump_json(), media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await json_call(request, TokenizeRequest, serving.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await json_call(request, DetokenizeRequest, serving.detokenize)

    def model_card(name: str) -> ModelCard:
        return ModelCard(id=name, created=int(time.time()), root=settings.served_model_name,
                         max_model_len=backend.max_model_len if backend.ready() else None)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        auth.require_api_key(request)
        # only the served names: an alias (the checkpoint's path) is accepted in requests
        # but never shown, so the API does not reveal the server's filesystem
        cards = ModelList(data=[model_card(name) for name in settings.listed_names])
        return Response(cards.model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str) -> Response:
        auth.require_api_key(request)
        if model_id not in settings.listed_names:
            raise ApiError.model_not_found(model_id)
        return Response(model_card(model_id).model_dump_json(), media_type="application/json")

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> JSONResponse:
        """vLLM's /version, with the commit where known (engine/build_info.py)."""
        return JSONResponse(build_info())

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if drain.draining:
            raise ApiError(503, "the server is shutting down", None, "shutting_down",
                           retry_after=settings.retry_after_s)
        if not backend.ready():
            raise ApiError(503, "the backend is not ready", None, "not_ready", retry_after=settings.retry_after_s)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def admin_or_501(request: Request) -> AdminInterface:
        if admin is None:
            raise ApiError(501, "this router has no worker pools to administer", None, "not_implemented")
        auth.require_admin(request)
        return admin

    @app.get("/admin/pools")
    async def get_pools(request: Request) -> JSONResponse:
        return JSONResponse({**await admin_or_501(request).get_pools(), "drift": drift.snapshot()})

    @app.post("/admin/pools")
    async def set_pools(request: Request) -> JSONResponse:
        target = admin_or_501(request)
        update = parse(PoolsUpdate, await read_body(request, settings.max_request_body_bytes))
        if update.prefill is None and update.decode is None:
            raise ApiError.invalid("give `prefill` and/or `decode` worker counts", "prefill")
        asked = {r: n for r, n in (("prefill", update.prefill), ("decode", update.decode)) if n is not None}
        client = request.client.host if request.client else "-"
        try:
            before = await target.get_pools()
            data = await target.set_pools(update.prefill, update.decode)
        except ValueError as e:
            log.warning("scale request from %s refused (%s): %s", client, asked, e)
            raise ApiError.invalid(str(e)) from None
        was = {r: p.get("target") for r, p in before.get("pools", {}).items() if isinstance(p, dict)}
        log.info("scale request from %s: %s", client, ", ".join(f"{r} {was.get(r, '?')} -> {n}"
                                                               for r, n in asked.items()))
        return JSONResponse(data)

    return app
