"""Start-up objects out of the garbage collector's way.

A router or worker process makes most of its Python objects at start-up: modules,
FastAPI's and pydantic's models, Ray's and gRPC's state, the engine's configuration and
its model's modules. They live as long as the process, yet CPython's cyclic collector
walks all of them in every full (generation 2) collection, and a server at load makes
those often: each request's coroutines, futures and dicts live for seconds, so they
reach the oldest generation and count toward the next full collection. On the 2-core
development machine a full collection of the router's 143 K objects took 93-191 ms of
its event loop, once or twice in a run of 200 streams; it runs in whichever thread
happens to allocate (in a worker, possibly the engine thread, between two steps'
kernels). docs/performance.md, fourteenth round.

`freeze_startup_heap` collects once and then moves every object alive into the
permanent generation (`gc.freeze`), which collections skip; what the process makes
later is collected as before. The garbage collected first is what would otherwise be
frozen for good. TANDEM_GC_FREEZE=0 leaves the collector as it is.
"""

from __future__ import annotations

import gc
import logging
import time

from worker_runtime import envs

log = logging.getLogger(__name__)


def freeze_startup_heap(who: str) -> int:
    """Collect, then freeze every object alive now; returns how many were frozen (0
    when TANDEM_GC_FREEZE=0). Call once, when the process is ready to serve."""
    if not envs.gc_freeze():
        return 0
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.debug("%s: %d start-up objects frozen out of garbage collection (%.0f ms)", who, n,
              1e3 * (time.perf_counter() - t0))
    return n
