"""Run an ASGI app under uvicorn on a background thread (tests, notebooks, embedding).

    with ServerThread(app) as server:      # 127.0.0.1, a free port
        httpx.get(server.url + "/health")

Start-up and shutdown are bounded; the app's lifespan runs on the thread's event
loop (`server.loop`), so coroutines touching the app's backend can be submitted
with `server.call(coro)`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time
from typing import Any, Coroutine

import uvicorn


class ServerThread:
    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 startup_timeout_s: float = 120.0, shutdown_timeout_s: float = 15.0) -> None:
        self.config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                     loop="asyncio", http="h11", ws="none",
                                     timeout_graceful_shutdown=max(1, int(shutdown_timeout_s / 2)))
        self.server = uvicorn.Server(self.config)
        self.startup_timeout_s = startup_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        try:
            self.loop.run_until_complete(self.server.serve())
        except BaseException as e:  # reported by start()
            self._error = e
        finally:
            self.loop.close()

    def start(self) -> "ServerThread":
        self._thread = threading.Thread(target=self._run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start: {self._error!r}")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(self.shutdown_timeout_s)
            if self._thread.is_alive():
                self.server.force_exit = True
                self._thread.join(self.shutdown_timeout_s)

    def call(self, coro: Coroutine, timeout_s: float = 30.0) -> Any:
        """Run `coro` on the server's loop and return its result."""
        fut: cf.Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout_s)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
