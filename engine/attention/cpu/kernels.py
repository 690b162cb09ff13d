"""Thin launchers for the compiled CPU kernels: check what Python can cheaply, then
call into C++ (which checks shapes, dtypes, strides and block ids itself)."""

from __future__ import annotations

import torch

from engine.cpu_kernels import build


def paged_decode_attention(
    query: torch.Tensor,  # [B, H, D] fp32/bf16/fp16, last dim contiguous
    k_cache: torch.Tensor,  # [N, bs, Hkv, D] query's dtype, or float8_e4m3fn
    v_cache: torch.Tensor,  # [N, bs, Hkv, D], same dtype and strides as k_cache
    block_tables: torch.Tensor,  # [B, M] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including the new token
    scale: float,
    out: torch.Tensor | None = None,  # [B, H, D], query's dtype; allocated when None
    bf16_pairs: bool = True,  # bf16 query and cache: p.v two tokens an instruction, p in bf16
    v_scale: float = 1.0,  # an fp8 cache's V scale (its K scale goes into `scale`)
    window: int | None = None,  # a sliding window: the last `window` positions (their blocks alone are read)
    softcap: float | None = None,  # scores soft-capped as cap * tanh(s / cap)
) -> torch.Tensor:  # [B, H, D]
    """Attention of one query token per sequence over its paged context."""
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        block_tables = block_tables.to(torch.int32).contiguous()
    if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        seq_lens = seq_lens.to(torch.int32).contiguous()
    build.load().paged_decode_attention(out, query, k_cache, v_cache, block_tables, seq_lens, float(scale), bf16_pairs,
                                        float(v_scale), int(window or 0), float(softcap or 0.0))
    return out


def paged_prefill_attention(
    query: torch.Tensor,  # [T, H, D] bf16, last dim contiguous: the step's prefill rows
    k_cache: torch.Tensor,  # [N, bs, Hkv, D] bf16 or float8_e4m3fn, the rows' own K/V already stored
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [Bp, M] int32
    query_start: torch.Tensor,  # [Bp + 1] int32, cumulative rows
    seq_lens: torch.Tensor,  # [Bp] int32, context incl. the rows
    scale: float,
    v_scale: float = 1.0,  # an fp8 cache's V scale (its K scale goes into `scale`)
    window: int | None = None,  # a sliding window: row p sees keys p - window + 1 .. p
    softcap: float | None = None,  # scores soft-capped as cap * tanh(s / cap)
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each sequence's new rows over its paged context (bf16, AVX512-BF16;
    the cache bf16 or fp8 e4m3)."""
    out = torch.empty(query.shape, dtype=query.dtype)
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        block_tables = block_tables.to(torch.int32).contiguous()
    build.load().paged_prefill_attention(out, query, k_cache, v_cache, block_tables,
                                         query_start.to(torch.int32).contiguous(),
                                         seq_lens.to(torch.int32).contiguous(), float(scale), float(v_scale),
                                         int(window or 0), float(softcap or 0.0))
    return out
