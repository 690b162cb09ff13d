"""The KV cache sized from the device's memory (`--gpu-memory-utilization`, vLLM's meaning).

The fraction is of the whole device, for this worker alone: the worker may hold up to
`total * utilization` bytes; what other processes hold is not counted against it, but
the worker refuses to start when less than that was free when it began.

    requested  = total * utilization
    KV cache   = requested - weights - peak activations - non-torch growth

Weights are what torch holds once the model is loaded. Peak activations come from a
profile step: one forward (and sampling) of `max_num_batched_tokens` tokens spread over
`max_num_seqs` sequences, the largest step the scheduler can plan, on a scratch cache
just big enough for it. Non-torch growth is what the CUDA context, cuBLAS workspaces
and the like took beyond torch's allocator since the first snapshot (taken before the
weights were loaded).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

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

    @property
    def requested(self) -> int:
        return int(self.total * self.utilization)

    @property
    def kv_bytes(self) -> int:
        return self.requested - self.weights - self.peak_activations - self.non_torch_growth

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
                f"activations and {self.non_torch_growth / GiB:.2f} GiB outside torch: fewer than 2 blocks; raise it "
                "or lower --max-num-batched-tokens")
        return int(n)

    def __str__(self) -> str:
        return (f"{self.utilization:.2f} of {self.total / GiB:.2f} GiB = {self.requested / GiB:.2f} GiB: weights "
                f"{self.weights / GiB:.2f} GiB, peak activations {self.peak_activations / GiB:.2f} GiB, outside torch "
                f"{self.non_torch_growth / GiB:.2f} GiB, KV cache {max(self.kv_bytes, 0) / GiB:.2f} GiB")


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
