"""The asyncio event loops of tandem's servers: uvloop's where it is installed.

The router's HTTP and gRPC client loop and each worker's gRPC server loop spend most of
their time in the event loop's own machinery at full load (one socket write per SSE
event, a callback per gRPC message). uvloop runs that machinery on libuv in C; grpc.aio
works on any asyncio loop. `TANDEM_UVLOOP=0` keeps the standard library's loop.
"""

from __future__ import annotations

import asyncio
import logging

from worker_runtime import envs

log = logging.getLogger(__name__)


def loop_factory():
    """A callable that makes a new event loop: uvloop's, or asyncio's when uvloop is
    missing or turned off."""
    if envs.use_uvloop():
        try:
            import uvloop
        except ImportError:
            log.info("uvloop is not installed: the standard asyncio loop serves")
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def new_event_loop() -> asyncio.AbstractEventLoop:
    return loop_factory()()


def run(coro):
    """`asyncio.run(coro)` on a loop from `loop_factory()`."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(coro)
