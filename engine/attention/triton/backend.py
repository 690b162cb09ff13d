"""Triton attention backend: paged decode and the KV store run as Triton kernels;
prefill (ragged, causal) stays on the torch reference via AttentionBackend.forward."""

from __future__ import annotations

import torch

from engine.attention import AttentionBackend
from engine.attention.triton import kernels


class TritonAttention(AttentionBackend):
    name = "triton"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        kernels.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def decode(self, query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len) -> torch.Tensor:
        return kernels.paged_decode_attention(
            query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len
        )
