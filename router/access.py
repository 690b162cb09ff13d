"""Request ids and the access log.

Every HTTP request gets an id: the client's `X-Request-Id` when it is a sane one
(letters, digits and `._:-`, at most 96), else a fresh random one. It is echoed in the
response's `X-Request-Id` header, it is part of the OpenAI response id and of every
engine request id sent to the workers (`cmpl-<id>-<random>-<choice>`), so a worker's
log line about a request names it, and it ends the request's access-log line.

One access-log line per request (logger `tandem.access`), written when the response
has been sent in full (for a stream: after its last event), with the method, path,
status, prompt and output tokens, time to first token, duration and request id; a
request whose client went away before its answer ended (a stream cut, a request
abandoned) ends its line with `client_closed` (`"client_closed": true` in JSON), so a
cut stream's 200 is not read as a complete answer. A stream the server ended because
its shutdown grace ran out ends its line with `cut_at_shutdown` likewise.
`--log-format json` makes every log line of the router one JSON object, these with
their fields as keys. Health probes and metric scrapes (/health, /ready, /metrics) are
logged at DEBUG only: they come every few seconds and say nothing per request.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("tandem.access")

REQUEST_ID_HEADER = b"x-request-id"
_SANE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,96}$")
_QUIET_PATHS = ("/health", "/ready", "/metrics")


@dataclass
class AccessRecord:
    """What the serving layer tells the access log about one request."""

    request_id: str
    client_gave_id: bool
    job: object = None  # router.job.Job, once the engines took the request
    client_closed: bool = False  # the client went away before the answer ended
    cut_at_shutdown: bool = False  # the shutdown grace ended before the answer did

    def response_id(self, prefix: str) -> str:
        """`<prefix>-<request id>`, with a random tail when the id is the client's:
        engine request ids stay unique even when a client reuses its ids."""
        if self.client_gave_id:
            return f"{prefix}-{self.request_id}-{uuid.uuid4().hex[:16]}"
        return f"{prefix}-{self.request_id}"

    def tokens(self) -> tuple[int | None, int | None, float | None]:
        """(prompt tokens, output tokens, first token time) over every choice; Nones
        for a request that never reached the engines."""
        if self.job is None or not self.job.runs:
            return None, None, None
        runs = self.job.runs
        firsts = [r.first_token_at for r in runs if r.first_token_at is not None]
        return (sum(len(p.ids) for p in self.job.prompts), sum(r.completion_tokens for r in runs),
                min(firsts) if firsts else None)


def access_record(scope: Scope) -> AccessRecord:
    """The record AccessLogMiddleware (installed by create_app) put in the scope."""
    return scope["state"]["access"]


def note_client_closed(scope: Scope) -> None:
    """The client went away before the answer ended (when the access log runs)."""
    record = scope.get("state", {}).get("access")
    if record is not None:
        record.client_closed = True


def note_cut_at_shutdown(scope: Scope) -> None:
    """The server's shutdown grace ended this answer (when the access log runs)."""
    record = scope.get("state", {}).get("access")
    if record is not None:
        record.cut_at_shutdown = True


class AccessLogMiddleware:
    """Outermost: sets the request id, adds its header, logs the line at the end."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.monotonic()
        given = ""
        for k, v in scope.get("headers", ()):
            if k == REQUEST_ID_HEADER:
                given = v.decode("latin-1")
                break
        sane = bool(_SANE_ID.match(given))
        record = AccessRecord(given if sane else uuid.uuid4().hex[:16], sane)
        scope.setdefault("state", {})["access"] = record
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (REQUEST_ID_HEADER, record.request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._log(scope, record, status or 500, t0)

    @staticmethod
    def _log(scope: Scope, record: AccessRecord, status: int, t0: float) -> None:
        path = scope.get("path", "")
        level = logging.DEBUG if path in _QUIET_PATHS else logging.INFO
        if not log.isEnabledFor(level):
            return
        now = time.monotonic()
        prompt, output, first = record.tokens()
        client = scope.get("client") or ("-", 0)
        fields = {
            "client": f"{client[0]}:{client[1]}",
            "method": scope.get("method", ""),
            "path": path,
            "status": status,
            "prompt_tokens": prompt,
            "output_tokens": output,
            "ttft_ms": round((first - t0) * 1000, 1) if first is not None else None,
            "duration_ms": round((now - t0) * 1000, 1),
            "request_id": record.request_id,
        }
        text = (f'{fields["client"]} "{fields["method"]} {path}" {status} prompt={_dash(prompt)} '
                f'output={_dash(output)} ttft={_dash(fields["ttft_ms"], "ms")} '
                f'duration={fields["duration_ms"]}ms id={record.request_id}')
        if record.client_closed:
            fields["client_closed"] = True
            text += " client_closed"
        if record.cut_at_shutdown:
            fields["cut_at_shutdown"] = True
            text += " cut_at_shutdown"
        log.log(level, text, extra={"access": fields})


def _dash(v, unit: str = "") -> str:
    return "-" if v is None else f"{v}{unit}"
