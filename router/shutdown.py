"""Graceful stop of a router: drain, then exit.

On the first SIGTERM or SIGINT the router stops taking work and lets what it holds
finish:

- `/ready` answers 503 (a load balancer or Kubernetes takes the replica out);
- a new OpenAI request gets 503 with Retry-After (another replica can take it);
- requests already in flight, streams included, run to their end, for at most
  `grace_s` seconds: the grace is a limit. When it ends, each request still running is
  ended by the server with an answer the client can read: a stream gets a
  `shutting_down` error event and `[DONE]`, a request not yet answered a 503 (both
  cancel their engine requests, as a disconnect does; router/sse.py);
- then the HTTP server is told to exit, `tandem serve` stops the backend (workers, the
  local Ray), and the process exits 0 with one log line that says how many requests
  finished and how many were ended at the grace's end.

A second signal during the drain stops at once. In-flight requests are counted by an
ASGI middleware around the whole app, so a stream counts until its last byte is sent,
and a request that is still reading its body or tokenizing counts too.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass
from typing import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from router.errors import ApiError
from router.sse import CUTOFF_KEY, Cutoff

log = logging.getLogger("tandem")

# Paths that carry work; probes, metrics and admin keep answering during a drain.
WORK_PREFIX = "/v1/"
# After the cutoff, how long the requests it ended get to send their last bytes (each
# is one write); a request still reading its body is left to the HTTP server's exit.
CUT_WAIT_S = 1.0


@dataclass(frozen=True)
class DrainResult:
    started: int  # requests in flight when the drain began
    cut: int  # still running when the grace ended, so ended by the server
    left: int  # still counted after the cut's own wait (left to the HTTP server's exit)
    waited_s: float

    @property
    def finished(self) -> int:
        return self.started - self.cut

    def describe(self) -> str:
        if self.cut == 0:
            return f"all {self.started} finished"
        text = (f"{self.finished} of {self.started} finished, {self.cut} ended with a shutting_down error "
                "when the grace ran out")
        if self.left:
            text += f" ({self.left} of them not yet answered were closed with the server)"
        return text


class Drain:
    def __init__(self, grace_s: float, retry_after_s: float) -> None:
        self.grace_s = grace_s
        self.retry_after_s = retry_after_s
        self.draining = False
        self.in_flight = 0
        self.cutoff = Cutoff()  # set when the grace ends: what still runs is ended
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- counting --------------------------------------------------------------------
    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    # ---- draining --------------------------------------------------------------------
    async def run(self, reason: str) -> DrainResult:
        """Refuse new work, wait (at most `grace_s`) for the work in flight to end, then
        end what still runs (the cutoff) and give it `CUT_WAIT_S` to say so."""
        self.draining = True
        start, t0 = self.in_flight, time.monotonic()
        log.debug("%s: draining %d request(s) in flight, for at most %g s", reason, start, self.grace_s)
        cut = 0
        try:
            await asyncio.wait_for(self._idle.wait(), self.grace_s)
        except asyncio.TimeoutError:
            cut = self.in_flight
            self.cutoff.set()
            try:
                await asyncio.wait_for(self._idle.wait(), CUT_WAIT_S)
            except asyncio.TimeoutError:
                pass
        return DrainResult(start, cut, self.in_flight, time.monotonic() - t0)


class DrainMiddleware:
    """Counts requests in flight; during a drain refuses new work with 503
    (`on_refuse(status)` is told, for the error metrics)."""

    def __init__(self, app: ASGIApp, drain: Drain, on_refuse: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.drain = drain
        self.on_refuse = on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(WORK_PREFIX):
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            err = ApiError(503, "the server is shutting down; retry on another replica", None, "shutting_down",
                           retry_after=self.drain.retry_after_s, headers={"Connection": "close"})
            if self.on_refuse is not None:
                self.on_refuse(err.status)
            await err.response()(scope, receive, send)
            return
        scope[CUTOFF_KEY] = self.drain.cutoff
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()


class SignalDrain:
    """Signal handling for a router run by uvicorn.Server: the first SIGTERM/SIGINT
    drains and then calls `exit_server`; a second one calls `force_exit` at once.
    `install` must run on the server's event loop (the lifespan does), after anything
    that sets process signal handlers of its own (Ray's driver start-up does)."""

    def __init__(self, drain: Drain, exit_server: Callable[[], None], force_exit: Callable[[], None]) -> None:
        self.drain = drain
        self.exit_server = exit_server
        self.force_exit = force_exit
        self.signal_name: str | None = None
        self.result: DrainResult | None = None
        self._task: asyncio.Task | None = None

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._task is not None:
            log.warning("%s during the drain: stopping now", sig.name)
            self.force_exit()
            return
        self.signal_name = sig.name
        self._task = asyncio.get_running_loop().create_task(self._drain_then_exit(sig.name))

    async def _drain_then_exit(self, name: str) -> None:
        try:
            self.result = await self.drain.run(name)
        finally:
            self.exit_server()
