"""The worker runtime's environment variables: process-wide settings that every worker
process and the `tandem` command read (the engine's own are engine/envs.py's).

    TANDEM_LOG_LEVEL   log level of workers and the router (default INFO)
    TANDEM_UVLOOP      0 runs the router's and workers' event loops on the standard
                       library's asyncio loop instead of uvloop's (worker_runtime/eventloop.py)
    TANDEM_CPU_HUGE_PAGES  0 leaves torch's CPU allocator on 4 KB pages; by default the
                       `tandem` command sets THP_MEM_ALLOC_ENABLE=1 (torch's own switch:
                       allocations of 2 MB and more are aligned and madvised for
                       transparent huge pages) before torch loads, for itself and the
                       local Ray workers it starts (use_huge_pages below)
    TANDEM_GC_FREEZE   0 leaves Python's garbage collector as it is; by default the router
                       and each worker move the objects they made at start-up out of its
                       collections once they are ready to serve (worker_runtime/gcheap.py)
    TANDEM_CPU_LEND_CORES  0 keeps each worker on its own cores; by default workers that
                       share one host's cores lend idle ones to each other (engine/cores.py)
    TANDEM_CPU_EVENTS_IN_LAYERS  0 has a CPU decode worker hand each step's tokens to
                       its event loop as the step ends; by default they go as the next
                       step enters its layers, where the engine thread holds no GIL
                       (worker_runtime/loop.py EngineLoop.flush)
    TANDEM_FAULTS      fault injection for failure tests, comma-separated key=value:
                         prefill_step_delay_s=F  sleep F s in every prefill step
                         transfer_delay_s=F      hold every KV write F s before it completes
                         fail_transfers=1        every KV write fails ("injected fault")
                         refuse_decodes=N        a decode worker refuses its first N Decode
                                                 requests for room (RESOURCE_EXHAUSTED)
                         reserve_delay_s=F       a decode worker's engine thread sleeps F s
                                                 before each reservation for a remote prefill
                       Never set in production; workers log a warning when it is.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from engine.envs import huge_pages_on, switch_on

log = logging.getLogger(__name__)


def log_level() -> str:
    return os.environ.get("TANDEM_LOG_LEVEL", "INFO").upper()


def use_uvloop() -> bool:
    return switch_on("TANDEM_UVLOOP")


def events_in_layers() -> bool:
    return switch_on("TANDEM_CPU_EVENTS_IN_LAYERS")


def gc_freeze() -> bool:
    return switch_on("TANDEM_GC_FREEZE")


def use_huge_pages() -> bool:
    """Ask torch's CPU allocator for transparent huge pages, unless TANDEM_CPU_HUGE_PAGES
    is off or THP_MEM_ALLOC_ENABLE is already set. torch reads THP_MEM_ALLOC_ENABLE once,
    at its first allocation, so this must run before torch allocates anything in the
    process (the `tandem` command calls it first thing); processes started later from
    this one (a local Ray runtime's workers) inherit it. A decode step reads every weight
    once, hundreds of MB for a 200M model, and with 4 KB pages every page is a TLB miss:
    one-stream decode of the 200M model took 16.6-16.8 ms/token with huge pages against
    18.1-18.2 without (docs/performance.md). Returns whether the variable is on."""
    if switch_on("TANDEM_CPU_HUGE_PAGES"):
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return huge_pages_on()


def cpu_lend_cores() -> bool:
    """Workers sharing one host's cores lend idle ones to each other (engine/cores.py)."""
    return switch_on("TANDEM_CPU_LEND_CORES")


@dataclass(frozen=True)
class Faults:
    prefill_step_delay_s: float = 0.0
    transfer_delay_s: float = 0.0
    fail_transfers: bool = False
    refuse_decodes: float = 0.0
    reserve_delay_s: float = 0.0

    @property
    def any(self) -> bool:
        return bool(self.prefill_step_delay_s or self.transfer_delay_s or self.fail_transfers or self.refuse_decodes
                    or self.reserve_delay_s)


def faults() -> Faults:
    raw = os.environ.get("TANDEM_FAULTS", "")
    kw: dict = {}
    for item in filter(None, (x.strip() for x in raw.split(","))):
        key, _, val = item.partition("=")
        if key not in Faults.__dataclass_fields__:
            raise ValueError(f"TANDEM_FAULTS: unknown fault {key!r}; known: {', '.join(Faults.__dataclass_fields__)}")
        kw[key] = val not in ("0", "", "false") if key == "fail_transfers" else float(val)
    f = Faults(**kw)
    if f.any:
        log.warning("fault injection is ON: %s", f)
    return f
