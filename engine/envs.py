"""Every environment variable tandem reads, in one place.

    TANDEM_CACHE_DIR   where the built-in model and compiled kernels live
                       (default ~/.cache/tandem)
    TANDEM_LOG_LEVEL   log level of workers and the router (default INFO)
    TANDEM_CPU_PACKED_WEIGHTS  0 turns off oneDNN pre-packed bf16 linear layers on
                       CPU (engine/models/packed.py; default on where supported)
    TANDEM_CPU_PREFILL_KERNEL  0 sends bf16 prefill attention on CPU to torch's SDPA
                       instead of tandem's paged prefill kernel (engine/attention/cpu)
    TANDEM_CPU_AMX_PREFILL_SDPA  where the kernel above is on, whether bf16 prompt
                       chunks of 64 tokens or more go to torch's SDPA instead: 1 always;
                       auto (the default) and 0 never, now that the kernel multiplies on
                       AMX tiles where the CPU has them (engine/attention/cpu/backend.py)
    TANDEM_CPU_DECODE_PAIRS  0 keeps bf16 decode attention's p.v product in fp32 (p
                       unrounded) instead of on AVX512-BF16's dot-product instruction,
                       two tokens an instruction, p rounded to bf16 (engine/cpu_kernels/
                       paged_attention.cpp)
    TANDEM_CPU_AMX_ATTENTION  0 keeps bf16 attention on AVX512-BF16 where the CPU has
                       AMX; by default its scores and its p.v product run on AMX tiles:
                       decode (blocks of a multiple of 32 tokens, head_dim 64 or 128, 4 to
                       16 query heads per kv head) and the paged prefill kernel (head_dim
                       64 or 128)
    TANDEM_CPU_SMALL_BATCH_LINEAR  whether bf16 linear layers keep a second copy of
                       their weights for decode steps' own kernels: auto (the default)
                       when the copies take at most 1/8 of the machine's memory, 1
                       always, 0 never (engine/models/packed.py)
    TANDEM_CPU_TILE_LINEAR  0 gives decode steps of one to four tokens the row-major
                       kernel instead of the AMX tile kernel (steps of up to 256 tokens),
                       where the CPU has AMX
    TANDEM_KEPT_ROWS   0 runs every prefill token through the whole last layer; by
                       default the last layer computes attention, o_proj and the MLP
                       only for the rows a step samples from, the others needing just
                       their keys and values (engine/attention KeptRows)
    TANDEM_TOKEN_FEED  0 has the router read each request's tokens from its own Decode
                       stream instead of one token feed per decode worker (router/token_feed.py)
    TANDEM_FEED_SOCKET  0 keeps a token feed's batches on its gRPC stream instead of
                       moving them to a plain TCP connection to the worker
    TANDEM_UVLOOP      0 runs the router's and workers' event loops on the standard
                       library's asyncio loop instead of uvloop's (worker_runtime/eventloop.py)
    TANDEM_CPU_HUGE_PAGES  0 leaves torch's CPU allocator on 4 KB pages; by default the
                       `tandem` command sets THP_MEM_ALLOC_ENABLE=1 (torch's own switch:
                       allocations of 2 MB and more are aligned and madvised for
                       transparent huge pages) before torch loads, for itself and the
                       local Ray workers it starts (use_huge_pages below)
    TANDEM_CPU_MALLOC_REUSE  0 leaves glibc malloc's defaults; by default a CPU engine
                       with huge pages on has it keep freed blocks of up to 32 MB for
                       reuse instead of returning them to the system
                       (engine/memory.py reuse_freed_memory)
    TANDEM_CPU_IDLE_HELPERS  0 leaves a worker's OpenMP helper threads at normal priority
                       between the steps that use them; by default a bound team's helpers
                       that the next step does not use wait at SCHED_IDLE (engine/cores.py
                       IdleHelpers)
    TANDEM_GC_FREEZE   0 leaves Python's garbage collector as it is; by default the router
                       and each worker move the objects they made at start-up out of its
                       collections once they are ready to serve (worker_runtime/gcheap.py)
    TANDEM_FAULTS      fault injection for failure tests, comma-separated key=value:
                         prefill_step_delay_s=F  sleep F s in every prefill step
                         transfer_delay_s=F      hold every KV write F s before it completes
                         fail_transfers=1        every KV write fails ("injected fault")
                         refuse_decodes=N        a decode worker refuses its first N Decode
                                                 requests for room (RESOURCE_EXHAUSTED)
                         reserve_delay_s=F       a decode worker's engine thread sleeps F s
                                                 before each reservation for a remote prefill
                       Never set in production; workers log a warning when it is.

The admin commands `tandem scale` and `tandem status` (router/cli.py) take their
defaults for --url and --admin-key from TANDEM_URL and TANDEM_ADMIN_KEY; `tandem tune`
(bench/tune.py) takes --admin-key's from TANDEM_ADMIN_KEY.

Transport libraries read their own (UCX_NET_DEVICES, NIXL_LOG_LEVEL); kv_transfer
sets safe defaults for them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR") or "~/.cache/tandem").expanduser()


def log_level() -> str:
    return os.environ.get("TANDEM_LOG_LEVEL", "INFO").upper()


OFF = ("0", "false", "no", "off")


def _on(name: str) -> bool:
    """A switch that is on unless set to 0/false/no/off."""
    return os.environ.get(name, "1").strip().lower() not in OFF


def cpu_packed_weights() -> bool:
    return _on("TANDEM_CPU_PACKED_WEIGHTS")


def cpu_fused_ops() -> bool:
    return _on("TANDEM_CPU_FUSED_OPS")


def token_feed() -> bool:
    return _on("TANDEM_TOKEN_FEED")


def feed_socket() -> bool:
    return _on("TANDEM_FEED_SOCKET")


def use_uvloop() -> bool:
    return _on("TANDEM_UVLOOP")


def cpu_prefill_kernel() -> bool:
    return _on("TANDEM_CPU_PREFILL_KERNEL")


def kept_rows() -> bool:
    return _on("TANDEM_KEPT_ROWS")


def cpu_decode_pairs() -> bool:
    return _on("TANDEM_CPU_DECODE_PAIRS")


def cpu_amx_attention() -> bool:
    return _on("TANDEM_CPU_AMX_ATTENTION")


def cpu_bind_threads() -> bool:
    return _on("TANDEM_CPU_BIND_THREADS")


def cpu_idle_helpers() -> bool:
    return _on("TANDEM_CPU_IDLE_HELPERS")


def gc_freeze() -> bool:
    return _on("TANDEM_GC_FREEZE")


def use_huge_pages() -> bool:
    """Ask torch's CPU allocator for transparent huge pages, unless TANDEM_CPU_HUGE_PAGES
    is off or THP_MEM_ALLOC_ENABLE is already set. torch reads THP_MEM_ALLOC_ENABLE once,
    at its first allocation, so this must run before torch allocates anything in the
    process (the `tandem` command calls it first thing); processes started later from
    this one (a local Ray runtime's workers) inherit it. A decode step reads every weight
    once, hundreds of MB for a 200M model, and with 4 KB pages every page is a TLB miss:
    one-stream decode of the 200M model took 16.6-16.8 ms/token with huge pages against
    18.1-18.2 without (docs/performance.md). Returns whether the variable is on."""
    if _on("TANDEM_CPU_HUGE_PAGES"):
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return huge_pages_on()


def huge_pages_on() -> bool:
    """Whether torch's CPU allocator was asked for huge pages (THP_MEM_ALLOC_ENABLE)."""
    return os.environ.get("THP_MEM_ALLOC_ENABLE", "0").strip() not in ("", *OFF)


def cpu_malloc_reuse() -> bool:
    return _on("TANDEM_CPU_MALLOC_REUSE")


def cpu_lend_cores() -> bool:
    """Workers sharing one host's cores lend idle ones to each other (engine/cores.py)."""
    return _on("TANDEM_CPU_LEND_CORES")


def _mode(name: str) -> str:
    """A three-way setting: "auto" (unset or auto), "on" (1/true/yes/on) or "off"."""
    raw = os.environ.get(name, "auto").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    if raw in ("1", "true", "yes", "on"):
        return "on"
    if raw in OFF:
        return "off"
    raise ValueError(f"{name} must be auto, 1 or 0, not {raw!r}")


def cpu_small_batch_linear() -> str:
    """"auto", "on" or "off" (TANDEM_CPU_SMALL_BATCH_LINEAR)."""
    return _mode("TANDEM_CPU_SMALL_BATCH_LINEAR")


def cpu_tile_linear() -> str:
    """"auto", "on" or "off" (TANDEM_CPU_TILE_LINEAR): decode steps' linear layers on the
    AMX tile kernel where the CPU has it (engine/models/packed.py)."""
    return _mode("TANDEM_CPU_TILE_LINEAR")


def cpu_amx_prefill_sdpa() -> str:
    """"auto", "on" or "off" (TANDEM_CPU_AMX_PREFILL_SDPA)."""
    return _mode("TANDEM_CPU_AMX_PREFILL_SDPA")


def physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume plenty is not known
        return 0


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
