"""CPU attention backend: paged decode runs the C++ kernel (kernels.py); the KV store
and prefill stay on the torch reference via AttentionBackend.forward."""

from __future__ import annotations

import torch

from engine.attention import AttentionBackend, reference
from engine.attention.cpu import build, kernels


class CpuAttention(AttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        build.load()  # compile (or load the cached build) now, not on the first step

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def decode(self, query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len) -> torch.Tensor:
        if query.shape[-1] % 16 or query.stride(-1) != 1:  # the kernel walks D in 16-lane steps
            return reference.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len)
        return kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale)
