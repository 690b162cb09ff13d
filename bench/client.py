"""Streaming client for OpenAI-compatible /v1/completions and /v1/chat/completions.

`StreamClient.send` never raises for a failed request: the failure goes into the
record's `error` as "kind: detail" (kinds: http_NNN, connect, timeout, disconnected,
truncated, no_tokens, stream_error, bad_chunk, client_error), so one bad request
never ends a run.

Server quirks handled: SSE comments (": ping"), usage in a separate final chunk or in
the last chunk that still has `choices` (llama.cpp), role-only first chat deltas,
empty final chunks carrying only `finish_reason`, `data: {"error": ...}` mid-stream,
and a keep-alive connection the server closed after the previous stream (llama.cpp):
a request that fails before any response byte is retried on a new connection, at
most twice, with its send time reset.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.records import RequestRecord
from bench.sse import SSEParser
from bench.workloads import RequestSpec

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MAX_STALE_RETRIES = 2


class BenchError(RuntimeError):
    """A problem that stops the run before it starts (bad server URL, no model)."""


class _StreamFailed(Exception):
    pass


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    endpoint: str = "completions"
    model: str | None = None
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    ignore_eos: bool = True
    temperature: float | None = 0.0
    continuous_usage: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 600.0
    keepalive: bool = True

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {sorted(ENDPOINTS)}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://: {self.base_url}")
        if self.request_timeout_s <= 0:
            raise ValueError("--request-timeout must be > 0")

    @property
    def root(self) -> str:
        """The base URL without a trailing slash or /v1, so both spellings work."""
        root = self.base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root

    @property
    def url(self) -> str:
        return self.root + ENDPOINTS[self.endpoint]


class _Stream:
    """Folds one response's SSE events into a RequestRecord."""

    def __init__(self, rec: RequestRecord, chat: bool, continuous: bool) -> None:
        self.rec, self.chat = rec, chat
        self.continuous: bool | None = None if continuous else False
        self.cum_tokens = 0
        self.usage_out: int | None = None
        self.usage_in: int | None = None
        self.done = False

    def on_event(self, event: str, data: str, t: float) -> None:
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            raise _StreamFailed(f"bad_chunk: not JSON: {data[:200]!r}") from None
        if event == "error" or (isinstance(chunk, dict) and chunk.get("error")):
            raise _StreamFailed(f"stream_error: {_error_text(chunk)}")
        if not isinstance(chunk, dict):
            raise _StreamFailed(f"bad_chunk: not an object: {data[:200]!r}")
        usage = chunk.get("usage")
        usage = usage if isinstance(usage, dict) else None
        if usage:
            self.usage_out = _int_or(usage.get("completion_tokens"), self.usage_out)
            self.usage_in = _int_or(usage.get("prompt_tokens"), self.usage_in)
        choices = chunk.get("choices") or []
        if choices:
            self._on_choice(choices[0], usage, t)

    def _on_choice(self, choice: dict, usage: dict | None, t: float) -> None:
        if choice.get("finish_reason"):
            self.rec.finish_reason = choice["finish_reason"]
        piece, carries = self._piece(choice)
        self.rec.output_chars += len(piece)
        if self.continuous is None and carries:
            self.continuous = usage is not None  # trust per-chunk usage only if it starts so
        n = 1 if carries else 0
        if self.continuous and usage is not None:
            cum = _int_or(usage.get("completion_tokens"), self.cum_tokens)
            n, self.cum_tokens = cum - self.cum_tokens, cum
        if n > 0:
            self.rec.chunk_times.append(t)
            self.rec.chunk_tokens.append(n)

    def _piece(self, choice: dict) -> tuple[str, bool]:
        """(text, whether the chunk carries a token). An empty text mid-stream still
        carries one (a token whose text is held back); an empty closing chunk with a
        finish_reason, or a role-only chat delta, does not."""
        if self.chat:
            delta = choice.get("delta") or {}
            text = delta.get("content") or delta.get("reasoning_content") \
                or delta.get("reasoning") or ""
            if text or delta.get("tool_calls"):
                return text, True
            return "", "role" not in delta and not choice.get("finish_reason")
        text = choice.get("text") or ""
        return text, bool(text) or not choice.get("finish_reason")

    def finish(self, spec: RequestSpec) -> None:
        rec = self.rec
        if self.usage_out is not None:
            rec.output_tokens, rec.output_tokens_source = self.usage_out, "usage"
        else:
            rec.output_tokens, rec.output_tokens_source = sum(rec.chunk_tokens), "chunks"
        if self.usage_in is not None:
            rec.input_tokens, rec.input_tokens_source = self.usage_in, "usage"
        else:
            rec.input_tokens, rec.input_tokens_source = spec.input_len, "spec"
        if not rec.chunk_times:
            raise _StreamFailed(f"no_tokens: stream ended without a token "
                                f"(finish_reason={rec.finish_reason})")
        if not self.done and rec.finish_reason is None:
            raise _StreamFailed(f"truncated: stream ended without [DONE] after "
                                f"{len(rec.chunk_times)} token chunks")


def _int_or(value: Any, default: int | None) -> int | None:
    return int(value) if isinstance(value, (int, float)) else default


def _error_text(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:300]
        return str(err)[:300]
    return str(body)[:300]


class StreamClient:
    """One aiohttp session for a run; use as `async with StreamClient(cfg, limit) as c`."""

    def __init__(self, cfg: ClientConfig, max_connections: int = 0) -> None:
        self.cfg = cfg
        self.max_connections = max_connections
        self.session: aiohttp.ClientSession | None = None
        self.model = cfg.model
        self._chat = cfg.endpoint == "chat"
        self._timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)

    async def __aenter__(self) -> StreamClient:
        connector = aiohttp.TCPConnector(limit=self.max_connections,
                                         force_close=not self.cfg.keepalive)
        headers = dict(self.cfg.headers)
        if self.cfg.api_key:
            headers["Authorization"] = f"Bearer {self.cfg.api_key}"
        self.session = aiohttp.ClientSession(connector=connector, headers=headers)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.session is not None:
            await self.session.close()

    async def resolve_model(self) -> str:
        """The configured model, else the first one the server lists at /v1/models."""
        if self.model:
            return self.model
        url = self.cfg.root + "/v1/models"
        try:
            timeout = aiohttp.ClientTimeout(total=30)
            async with self.session.get(url, timeout=timeout) as resp:
                body = await resp.json(content_type=None)
                self.model = body["data"][0]["id"]
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError,
                TypeError, ValueError) as exc:
            raise BenchError(f"cannot list models at {url} ({type(exc).__name__}: {exc}); "
                             "is the server up? pass --model to skip this") from None
        return self.model

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        cfg = self.cfg
        body: dict[str, Any] = {"model": self.model, "max_tokens": spec.output_len,
                                "stream": True, "stream_options": {"include_usage": True}}
        if cfg.continuous_usage:
            body["stream_options"]["continuous_usage_stats"] = True
        if cfg.temperature is not None:
            body["temperature"] = cfg.temperature
        if cfg.ignore_eos:
            body["ignore_eos"] = True
        if cfg.endpoint == "chat":
            body["messages"] = _messages(spec)
        else:
            body["prompt"] = _joined_prompt(spec)
        if spec.priority is not None:
            body["priority"] = spec.priority
        body.update(cfg.extra_body)
        return body

    async def send(self, spec: RequestSpec, rec: RequestRecord, t0: float) -> RequestRecord:
        """Send one request and fill `rec`; times are offsets from t0 (perf_counter)."""
        rec.expected_output_tokens = spec.output_len
        rec.input_tokens = spec.input_len
        send_t = time.perf_counter()
        try:  # the body is built and encoded once, before the clock starts
            body = json.dumps(self.payload(spec)).encode()
        except _StreamFailed as exc:
            rec.sent, rec.error = send_t - t0, str(exc)
            return rec
        for attempt in range(MAX_STALE_RETRIES + 1):
            send_t = time.perf_counter()
            rec.sent, rec.retries = send_t - t0, attempt
            try:
                await self._stream(body, spec, rec, send_t)
                break
            except _Stale as exc:
                if attempt == MAX_STALE_RETRIES:
                    rec.error = f"disconnected: before any response byte: {exc}"
            except _StreamFailed as exc:
                rec.error = str(exc)
                break
            except Exception as exc:  # noqa: BLE001 - every failure becomes a record
                rec.error = _classify(exc, rec, self.cfg.request_timeout_s)
                break
        rec.finished = time.perf_counter() - send_t
        return rec

    async def _stream(self, body: bytes, spec: RequestSpec, rec: RequestRecord,
                      send_t: float) -> None:
        rec.chunk_times, rec.chunk_tokens, rec.error = [], [], None
        state = _Stream(rec, self._chat, self.cfg.continuous_usage)
        answered = False
        try:
            async with self.session.post(self.cfg.url, data=body, headers=_JSON,
                                         timeout=self._timeout) as resp:
                answered = True
                await self._read(resp, state, spec, send_t)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if answered or isinstance(exc, aiohttp.ClientConnectorError):
                raise
            raise _Stale(str(exc) or type(exc).__name__) from None

    async def _read(self, resp: aiohttp.ClientResponse, state: _Stream, spec: RequestSpec,
                    send_t: float) -> None:
        state.rec.http_status = resp.status
        if resp.status != 200:
            text = (await resp.content.read(4096)).decode("utf-8", "replace")
            raise _StreamFailed(f"http_{resp.status}: {_http_error(text)}")
        parser = SSEParser()
        async for raw in resp.content.iter_any():
            now = time.perf_counter() - send_t
            for event, data in parser.feed(raw):
                state.on_event(event, data, now)
        now = time.perf_counter() - send_t
        for event, data in parser.close():
            state.on_event(event, data, now)
        state.finish(spec)


_JSON = {"Content-Type": "application/json"}


class _Stale(Exception):
    pass


def _messages(spec: RequestSpec) -> list[dict[str, str]]:
    if not isinstance(spec.prompt, str) or isinstance(spec.system, list):
        raise _StreamFailed("client_error: chat needs text prompts; "
                            "use --prompt-format text (the default for --endpoint chat)")
    msgs = [{"role": "system", "content": spec.system}] if spec.system else []
    return msgs + [{"role": "user", "content": spec.prompt}]


def _joined_prompt(spec: RequestSpec) -> str | list[int]:
    if spec.system is None:
        return spec.prompt
    if isinstance(spec.system, list) and isinstance(spec.prompt, list):
        return spec.system + spec.prompt
    return f"{spec.system}\n{spec.prompt}"


def _http_error(text: str) -> str:
    try:
        return _error_text(json.loads(text))
    except json.JSONDecodeError:
        return text.strip()[:300] or "(empty body)"


def _classify(exc: Exception, rec: RequestRecord, timeout_s: float) -> str:
    chunks = len(rec.chunk_times)
    if isinstance(exc, asyncio.TimeoutError):
        return f"timeout: no complete response within {timeout_s:g}s ({chunks} token chunks)"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"connect: {exc}"
    if isinstance(exc, (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                        aiohttp.ClientConnectionError)):
        return f"disconnected: after {chunks} token chunks: {type(exc).__name__}: {exc}"
    return f"client_error: {type(exc).__name__}: {exc}"
