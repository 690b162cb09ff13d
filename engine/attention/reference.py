"""Torch reference attention over the paged KV cache. Runs on any device.

Layout (see engine/kv_cache.py): one layer's cache is
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A token at position p of a sequence lives in slot
    block_table[p // block_size] * block_size + p % block_size.

Every sequence in a batch contributes `q_len` query tokens that are the *last*
q_len positions of its `seq_len`-token context (cached prefix + new tokens), so a
prefill chunk, a whole prompt and a decode token are the same case:

    seq i:   |<------------- seq_len[i] ------------->|
             |  cached (already in k_cache/v_cache) | q_len new |
    query j of seq i sits at position seq_len[i] - q_len[i] + j and attends to
    positions 0 .. that position (causal); with a sliding window of W tokens, to the
    last W of them only (positions > its own - W, as transformers masks them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; slot < 0 = skip
) -> None:
    """Write new K/V rows into their cache slots."""
    n, bs, h, d = k_cache.shape
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(n * bs, h, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(n * bs, h, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def attend(q, k, v, mask, scale: float, softcap: float | None = None) -> torch.Tensor:
    """q [B, H, Lq, D] over k, v [B, Hkv, L, D] where `mask` [.., Lq, L] is True. With a
    `softcap`, transformers' eager attention, which Gemma 2 uses: scores in the query's
    dtype, softcap * tanh(s / softcap), softmax in fp32 cast back, then times V; else SDPA."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def gather_context(
    cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, M] int32/int64
    num_blocks: int,
    scale: float = 1.0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Gather the first `num_blocks` blocks of each row: [B, num_blocks * bs, Hkv, D];
    an fp8 cache's values times `scale`, in `dtype`."""
    b = block_tables.shape[0]
    _, bs, h, d = cache.shape
    idx = block_tables[:, :num_blocks].long().clamp_min(0)  # a released block (-1): masked by the caller
    out = cache[idx].view(b, num_blocks * bs, h, d)
    if cache.dtype == torch.float8_e4m3fn:
        out = out.float()
        if scale != 1.0:
            out = out * scale
        out = out.to(dtype)
    return out


def paged_decode_attention(
    query: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, M]
    seq_lens: torch.Tensor,  # [B] int32 (context length including the new token)
    scale: float,
    max_seq_len: int | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),  # an fp8 cache's
    window: int | None = None,  # a sliding window: the last `window` positions only
    softcap: float | None = None,  # scores soft-capped (see `attend`)
) -> torch.Tensor:  # [B, H, D]
    """One query token per sequence, attending to its cached context (or its window's part)."""
    b, h, d = query.shape
    bs = k_cache.shape[1]
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    nb = (max_seq_len + bs - 1) // bs
    k = gather_context(k_cache, block_tables, nb, kv_scales[0], query.dtype)  # [B, L, Hkv, D]
    v = gather_context(v_cache, block_tables, nb, kv_scales[1], query.dtype)
    length = nb * bs
    pos = torch.arange(length, device=query.device)[None, :]
    lens = seq_lens[:, None].to(query.device)
    mask = pos < lens
    if window is not None:
        mask &= pos >= lens - window
    out = attend(query.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), mask[:, None, None, :], scale, softcap)
    return out.squeeze(2)  # from [B, H, 1, D]


def varlen_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D] (the new tokens' keys, also already stored)
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, M]
    query_lens: list[int],  # [B]
    seq_lens: list[int],  # [B]
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),  # an fp8 cache's
    window: int | None = None,  # a sliding window (module docstring)
    softcap: float | None = None,  # scores soft-capped (see `attend`)
) -> torch.Tensor:  # [T, H, D]
    """Ragged causal attention for sequences with any number of new tokens.

    A sequence with no cached prefix attends to its own fresh K/V (no gather);
    one with a cached prefix reads its context from the paged cache.
    """
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        end = start + q_len
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if q_len == s_len and (window is None or q_len <= window) and not softcap:
            k = key[start:end].transpose(0, 1).unsqueeze(0)
            v = value[start:end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            bs = k_cache.shape[1]
            nb = (s_len + bs - 1) // bs
            k = gather_context(k_cache, block_tables[i : i + 1], nb, kv_scales[0], query.dtype)[:, :s_len]
            v = gather_context(v_cache, block_tables[i : i + 1], nb, kv_scales[1], query.dtype)[:, :s_len]
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            # query j (at position s_len - q_len + j) sees keys 0 .. s_len - q_len + j
            qpos = torch.arange(s_len - q_len, s_len, device=query.device)
            kpos = torch.arange(s_len, device=query.device)[None, :]
            mask = kpos <= qpos[:, None]
            if window is not None:
                mask &= kpos > qpos[:, None] - window
            o = attend(q, k, v, mask, scale, softcap)
        out[start:end] = o.squeeze(0).transpose(0, 1)
        start = end
    return out
