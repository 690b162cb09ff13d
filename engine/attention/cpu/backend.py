"""CPU attention backend: paged decode and the KV store run the C++ kernels (kernels.py,
engine/cpu_kernels). Prefill runs the C++ paged prefill kernel for bf16 models where the
CPU has AVX512-BF16 (head_dim 64 or 128), and the torch reference (SDPA) otherwise: fp32
models keep torch's own attention, the same as transformers'."""

from __future__ import annotations

import torch

from engine import envs
from engine.attention import AttentionBackend, reference
from engine.attention.cpu import kernels
from engine.cpu_kernels import build


class CpuAttention(AttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        self.ops = build.load()  # compile (or load the cached build) now, not on the first step
        self._bf16_prefill = envs.cpu_prefill_kernel() and bool(self.ops.paged_prefill_attention_supported())
        self.prefill_tensors = self._bf16_prefill  # the runner then builds the int32 lengths
        self.bf16_pairs = envs.cpu_decode_pairs()  # bf16 decode: p.v on the dot-product instruction
        # bf16 decode on AMX tiles where the CPU has them (a process-wide switch of the kernels)
        self.ops.set_decode_amx(envs.cpu_amx_attention())

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        fits = (key.dtype == k_cache.dtype and value.dtype == k_cache.dtype and k_cache.is_contiguous()
                and v_cache.is_contiguous() and key.stride(-1) == 1 and value.stride(-1) == 1
                and key.stride(-2) == key.shape[-1] and value.stride(-2) == value.shape[-1]
                and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous())
        if not fits:
            reference.store_kv(key, value, k_cache, v_cache, slot_mapping)
            return
        self.ops.store_kv(k_cache, v_cache, key, value, slot_mapping)

    def decode(self, query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len) -> torch.Tensor:
        if query.shape[-1] % 16 or query.stride(-1) != 1:  # the kernel walks D in 16-lane steps
            return reference.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len)
        return kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale,
                                              bf16_pairs=self.bf16_pairs)

    def prefill(self, query, key, value, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
        if (self._bf16_prefill and query.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16
                and query.shape[-1] in (64, 128) and query.stride(-1) == 1 and k_cache.is_contiguous()
                and v_cache.is_contiguous() and meta.prefill_query_start_loc is not None):
            return kernels.paged_prefill_attention(query, k_cache, v_cache, meta.prefill_block_tables,
                                                   meta.prefill_query_start_loc, meta.prefill_seq_lens_tensor, scale)
        return super().prefill(query, key, value, k_cache, v_cache, meta, scale)
