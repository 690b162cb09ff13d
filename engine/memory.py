"""The KV cache sized from the device's memory (`--gpu-memory-utilization`, vLLM's meaning).

The fraction is of the whole device, for this worker alone: the worker may hold up to
`total * utilization` bytes; what other processes hold is not counted against it, but
the worker refuses to start when less than that was free when it began.

    requested  = total * utilization
    KV cache   = requested - weights - peak activations - non-torch growth - decode graphs

Weights are what torch holds once the model is loaded. Peak activations come from a
profile step: one forward (and sampling) of `max_num_batched_tokens` tokens spread over
`max_num_seqs` sequences, the largest step the scheduler can plan, on a scratch cache
just big enough for it. Non-torch growth is what the CUDA context, cuBLAS workspaces
and the like took beyond torch's allocator since the first snapshot (taken before the
weights were loaded). Decode graphs (engine/graphs.py), when the worker captures them,
keep a memory pool of their own for the worker's life, and their capture stream keeps a
cuBLAS workspace: they are measured by capturing the same buckets once on a two-block
scratch cache (ModelRunner.profile_graphs) and counting what the allocator still holds.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from dataclasses import dataclass

import torch

from engine import envs
from engine.config import ConfigError
from engine.plan import SampleRow, SeqWork, StepPlan
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

GiB = 1 << 30


@dataclass(frozen=True)
class MemorySnapshot:
    free: int
    total: int
    torch_reserved: int

    @property
    def non_torch(self) -> int:
        """Device memory in use that torch's allocator did not reserve (any process)."""
        return self.total - self.free - self.torch_reserved

    @classmethod
    def take(cls, device: torch.device) -> "MemorySnapshot":
        free, total = torch.cuda.mem_get_info(device)
        return cls(free, total, torch.cuda.memory_reserved(device))


class CudaMemory:
    """The device's memory counters the sizing reads (torch.cuda's)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def settle(self) -> None:
        """Wait for queued work and give cached blocks back to the device."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def snapshot(self) -> MemorySnapshot:
        return MemorySnapshot.take(self.device)


@dataclass(frozen=True)
class KVSizing:
    """The arithmetic of one sizing, kept for the start-up log."""

    utilization: float
    total: int
    free_at_start: int
    weights: int
    peak_activations: int
    non_torch_growth: int
    decode_graphs: int = 0

    @property
    def requested(self) -> int:
        return int(self.total * self.utilization)

    @property
    def kv_bytes(self) -> int:
        return self.requested - self.weights - self.peak_activations - self.non_torch_growth - self.decode_graphs

    def num_blocks(self, block_bytes: int) -> int:
        if self.free_at_start < self.requested:
            raise ConfigError(
                f"--gpu-memory-utilization {self.utilization} asks for {self.requested / GiB:.2f} GiB of the "
                f"{self.total / GiB:.2f} GiB device, but only {self.free_at_start / GiB:.2f} GiB was free when the "
                "worker started (other processes hold the rest): lower it")
        n = self.kv_bytes // block_bytes
        if n < 2:
            raise ConfigError(
                f"--gpu-memory-utilization {self.utilization} leaves {max(self.kv_bytes, 0) / GiB:.2f} GiB for the KV "
                f"cache after {self.weights / GiB:.2f} GiB of weights, {self.peak_activations / GiB:.2f} GiB of peak "
                f"activations, {self.non_torch_growth / GiB:.2f} GiB outside torch and {self.decode_graphs / GiB:.2f} "
                "GiB for decode graphs: fewer than 2 blocks; raise it or lower --max-num-batched-tokens (or "
                "--max-num-seqs, or pass --enforce-eager)")
        return int(n)

    def __str__(self) -> str:
        return (f"{self.utilization:.2f} of {self.total / GiB:.2f} GiB = {self.requested / GiB:.2f} GiB: weights "
                f"{self.weights / GiB:.2f} GiB, peak activations {self.peak_activations / GiB:.2f} GiB, outside torch "
                f"{self.non_torch_growth / GiB:.2f} GiB, decode graphs {self.decode_graphs / GiB:.2f} GiB, KV cache "
                f"{max(self.kv_bytes, 0) / GiB:.2f} GiB")


def profile_plan(num_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int) -> tuple[StepPlan, int]:
    """The largest step the scheduler can plan: `num_tokens` prompt tokens over as many
    sequences as may run (each no longer than max_model_len), every one sampling a token.
    Returns it and the number of cache blocks it writes (ids 0 .. n-1)."""
    seqs = max(1, min(max_num_seqs, num_tokens), -(-num_tokens // max_model_len))
    base, extra = divmod(num_tokens, seqs)
    plan, next_block = StepPlan(), 0
    greedy = SamplingParams(max_tokens=1, temperature=0)
    for i in range(seqs):
        n = base + (1 if i < extra else 0)
        if n == 0:
            continue
        blocks = -(-n // block_size)
        plan.add(SeqWork(("profile", i), [0] * n, 0, list(range(next_block, next_block + blocks)),
                         SampleRow(greedy, ())))
        next_block += blocks
    return plan, next_block


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MALLOC_REUSE_BYTES = 32 << 20  # glibc's largest mmap threshold on 64-bit


def reuse_freed_memory() -> bool:
    """Have glibc's malloc keep what a CPU step frees for the next step.

    A step's activations are large and short-lived: a 2,048-token prefill step of the
    200M model allocates and frees tens of MB, the gate and up projections' output alone
    23 MB. glibc serves a block above its mmap threshold (adaptive, up to 32 MB) with a
    fresh mapping and unmaps it when freed, and trims the heap top above 128 KB, so each
    step takes page faults and zeroes the pages again. With the threshold fixed at 32 MB
    and no trimming, the freed blocks stay in the heap and the next step reuses them.
    The cost is memory: the process keeps the largest set of activations a step needed
    (blocks over 32 MB, such as the KV cache, are still mapped and unmapped on their
    own). Measured offline, the 200M model, 200 prompts of 256 tokens and 128 out, with
    huge pages on: 797-805 -> 835-870 out tok/s, in prefill and decode steps alike
    (docs/performance.md). vLLM's CPU docs advise tcmalloc for the same reason.

    Only together with torch's huge-page allocations (THP_MEM_ALLOC_ENABLE, which the
    `tandem` command turns on: engine/envs.py use_huge_pages): those are 2 MB-aligned,
    and from the first few steps on the freed ones are reused whole (served, the 200M
    model at rate inf: 405,000 -> 45,000 page faults in the decode worker over the run).
    Without them, torch's 64-byte-aligned blocks were measured to fault in again on
    every allocation of 24 MB with these settings, and on none from the third with
    glibc's own, so they are left alone.

    Process-wide and idempotent. A no-op (False) off Linux, with TANDEM_CPU_MALLOC_REUSE
    off, without huge pages, or where the C library has no mallopt; under another
    allocator (tcmalloc preloaded) mallopt is that allocator's and changes nothing."""
    if not (envs.cpu_malloc_reuse() and envs.huge_pages_on()) or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MALLOC_REUSE_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    if not ok:
        log.debug("mallopt refused the reuse settings")
    return ok
