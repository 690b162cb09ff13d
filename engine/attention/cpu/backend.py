"""CPU attention backend: paged decode and the KV store run the C++ kernels (kernels.py,
engine/cpu_kernels); prefill stays on the torch reference via AttentionBackend.forward."""

from __future__ import annotations

import torch

from engine.attention import AttentionBackend, reference
from engine.attention.cpu import kernels
from engine.cpu_kernels import build


class CpuAttention(AttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        self.ops = build.load()  # compile (or load the cached build) now, not on the first step

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
        return kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale)
