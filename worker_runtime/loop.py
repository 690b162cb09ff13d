"""EngineLoop: an engine's step function on a thread of its own, driven from asyncio.

Every engine mutation runs on this thread (commands are queued to it), so engines
need no locks; the forward pass releases the GIL, so the event loop serving gRPC or
HTTP stays responsive while a step runs. Each step's results are handed to the
event loop in one call.

Fatal path (one per process): if a step raises, `on_fatal` runs once with the
reason, the loop stops and `healthy` turns False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import queue
import threading
from typing import Callable

from worker_runtime.config import WORKER_LOST

log = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    pass



class EngineLoop:
    def __init__(
        self,
        step: Callable[[], list],
        wait_s: Callable[[], float | None],
        on_results: Callable[[list], None],
        on_fatal: Callable[[str], None],
        name: str = "engine",
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        """`step` runs one iteration and returns results for `on_results` (called on
        the event loop). `wait_s` says how long to wait for a command before the next
        step: 0 when there is work, a short poll while waiting on remote input, None
        when idle (then the loop sleeps until a command or the idle tick). `on_idle`
        (optional) runs on the engine thread before each wait that is not 0."""
        self._step = step
        self._wait_s = wait_s
        self._on_results = on_results
        self._on_fatal = on_fatal
        self._name = name
        self._on_idle = on_idle
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: str | None = None
        self.lost_rank = False  # the failure was a tensor-parallel rank gone (WORKER_LOST)
        self.idle_tick_s = 0.05
        # hold a step's results until `flush()`, which the next step calls just before its
        # layers (ModelRunner.before_layers), instead of handing them over as the step ends
        self.hold_results = False
        self._held: list = []

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    async def call(self, fn: Callable, *args, timeout: float = 30.0):
        """Run `fn(*args)` on the engine thread between steps; return its result."""
        if not self.healthy:
            raise EngineDead(self.error or f"{self._name} is not running")
        fut: cf.Future = cf.Future()
        self._commands.put((fn, args, fut))
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)

    def post(self, fn: Callable, *args) -> None:
        """Fire-and-forget `call`, usable from any thread."""
        self._commands.put((fn, args, None))

    def deliver(self, results: list) -> None:
        """Hand results to the event loop (from any thread)."""
        if results and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._on_results, results)
            except RuntimeError:  # loop closed between the check and the call
                pass

    def flush(self) -> None:
        """Hand the held results to the event loop (engine thread).

        Handed over as a step ends, they wake the event loop's thread while the engine
        thread still runs the Python between two steps; that thread takes the GIL at the
        engine's first operator call, and the engine thread then waits for it at the next
        Python line, once a step, for as long as the event loop's handling of the events
        takes (a tenth to a few tenths of a millisecond on a 2-core host, its caches cold
        after the weight stream). Handed over just before the layers, the event loop runs
        while the engine thread is inside them, without the GIL, for milliseconds."""
        if self._held:
            held, self._held = self._held, []
            self.deliver(held)

    def _run(self) -> None:
        import torch  # here, not at the top: routers import this package and need no torch

        # the whole thread in inference mode, so each step need not enter it (engine/runner.py)
        try:
            with torch.inference_mode():
                while not self._stop.is_set():
                    wait = self._wait_s()
                    if wait != 0:
                        self.flush()  # no step follows at once to hand them over in
                        if self._on_idle is not None:
                            self._on_idle()
                    if not self._drain(self.idle_tick_s if wait is None else wait):
                        break
                    results = self._step()
                    self.flush()  # the step had no layers to hand them over before
                    if self.hold_results:
                        self._held = results
                    else:
                        self.deliver(results)
        except Exception as e:
            self.flush()  # what the steps before gave goes ahead of the failure's events
            log.exception("%s step failed", self._name)
            self.lost_rank = type(e).__name__ == "RankLost"
            self.error = f"{WORKER_LOST if self.lost_rank else ''}{self._name} failure: {type(e).__name__}: {e}"
            self._on_fatal(self.error)

    def _drain(self, wait: float) -> bool:
        """Run queued commands, waiting up to `wait` for the first. False on shutdown."""
        try:
            item = self._commands.get(timeout=wait) if wait > 0 else self._commands.get_nowait()
        except queue.Empty:
            return True
        while item is not None:
            fn, args, fut = item
            # a caller that gave up (its wait timed out, its client left) cancelled the
            # future: skip the command; a running future can no longer be cancelled, so
            # setting its result below cannot fail
            if fut is None or fut.set_running_or_notify_cancel():
                try:
                    res = fn(*args)
                    if fut is not None:
                        fut.set_result(res)
                except Exception as e:
                    if fut is not None:
                        fut.set_exception(e)
                    else:
                        log.warning("%s command %s failed: %s", self._name, getattr(fn, "__name__", fn), e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False
