"""The engine's environment variables. Each process layer keeps its own registry: the
worker runtime's (process-wide settings of every worker and the command line) are in
worker_runtime/envs.py, the router's in router/envs.py; nothing else reads os.environ.

    TANDEM_CACHE_DIR   where the built-in model and compiled kernels live
                       (default ~/.cache/tandem)
    TANDEM_CPU_KERNELS which build of tandem's CPU kernels to load: auto (the default) the
                       best this CPU runs, or a name (amx, avx512_bf16, avx512, avx2,
                       generic) to force one, e.g. the AVX2 path on an AVX-512 machine
                       (engine/cpu_kernels/build.py)
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
    TANDEM_CPU_MALLOC_REUSE  0 leaves glibc malloc's defaults; by default a CPU engine
                       with huge pages on has it keep freed blocks of up to 32 MB for
                       reuse instead of returning them to the system
                       (engine/memory.py reuse_freed_memory)
    TANDEM_CPU_STEAL   0 gives each thread of a decode step's weight stream (one to four
                       rows) a fixed share; by default a thread done with its share takes
                       chunks of the others' (engine/cpu_kernels/steal.h)
    TANDEM_CPU_IDLE_HELPERS  0 leaves a worker's OpenMP helper threads at normal priority
                       between the steps that use them; by default a bound team's helpers
                       that the next step does not use wait at SCHED_IDLE (engine/cores.py
                       IdleHelpers)

The admin commands `tandem scale` and `tandem status` (cli/main.py) take their
defaults for --url and --admin-key from TANDEM_URL and TANDEM_ADMIN_KEY; `tandem tune`
(bench/tune.py) takes --admin-key's from TANDEM_ADMIN_KEY.

Transport libraries read their own (UCX_NET_DEVICES, NIXL_LOG_LEVEL); kv_transfer
sets safe defaults for them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR") or "~/.cache/tandem").expanduser()


OFF = ("0", "false", "no", "off")


def switch_on(name: str) -> bool:
    """A switch that is on unless set to 0/false/no/off."""
    return os.environ.get(name, "1").strip().lower() not in OFF


def cpu_packed_weights() -> bool:
    return switch_on("TANDEM_CPU_PACKED_WEIGHTS")


def cpu_fused_ops() -> bool:
    return switch_on("TANDEM_CPU_FUSED_OPS")


def cpu_prefill_kernel() -> bool:
    return switch_on("TANDEM_CPU_PREFILL_KERNEL")


def kept_rows() -> bool:
    return switch_on("TANDEM_KEPT_ROWS")


def cpu_decode_pairs() -> bool:
    return switch_on("TANDEM_CPU_DECODE_PAIRS")


def cpu_amx_attention() -> bool:
    return switch_on("TANDEM_CPU_AMX_ATTENTION")


def cpu_bind_threads() -> bool:
    return switch_on("TANDEM_CPU_BIND_THREADS")


def cpu_work_stealing() -> bool:
    return switch_on("TANDEM_CPU_STEAL")


def cpu_idle_helpers() -> bool:
    return switch_on("TANDEM_CPU_IDLE_HELPERS")


def huge_pages_on() -> bool:
    """Whether torch's CPU allocator was asked for huge pages (THP_MEM_ALLOC_ENABLE)."""
    return os.environ.get("THP_MEM_ALLOC_ENABLE", "0").strip() not in ("", *OFF)


def cpu_malloc_reuse() -> bool:
    return switch_on("TANDEM_CPU_MALLOC_REUSE")


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


def cpu_kernels() -> str:
    """TANDEM_CPU_KERNELS, lower-cased: "auto" or the name of a build of the CPU kernels."""
    return (os.environ.get("TANDEM_CPU_KERNELS") or "auto").strip().lower()


def physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume plenty is not known
        return 0


