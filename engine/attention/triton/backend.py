"""Triton attention backend: the KV store, paged decode and ragged paged prefill
(causal, over a cached prefix) run as Triton kernels."""

from __future__ import annotations

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.attention.triton import kernels


class TritonAttention(AttentionBackend):
    name = "triton"
    prefill_tensors = True

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        kernels.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def decode(self, query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len,
               kv_scales=(1.0, 1.0), window=None, softcap=None) -> torch.Tensor:
        return kernels.paged_decode_attention(
            query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, kv_scales=kv_scales, window=window,
            softcap=softcap,
        )

    def prefill(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                kv_scales=(1.0, 1.0), window=None, softcap=None) -> torch.Tensor:
        if meta.prefill_query_start_loc is None or meta.prefill_seq_lens_tensor is None:
            raise ValueError("the triton prefill kernel needs prefill_query_start_loc and prefill_seq_lens_tensor")
        return kernels.varlen_prefill_attention(
            query, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
            meta.prefill_seq_lens_tensor, scale, max(meta.prefill_query_lens, default=0), kv_scales=kv_scales,
            window=window, softcap=softcap,
        )
