"""Triton kernels over the paged KV cache, each a `@triton.jit` plus a thin launcher.

Cache layout (one layer, see engine/attention/reference.py):
    k_cache, v_cache: [N, bs, Hkv, D] contiguous; token p of a sequence lives in slot
    block_table[p // bs] * bs + p % bs, i.e. at row `slot` of the [N * bs, Hkv, D] view.

Paged decode: program (b, g, s) handles sequence b, kv head g (all H // Hkv query heads
of that GQA group, so each K/V block is read once per group) and context split s:

    blocks of seq b:   0  1  2  3  4  5  6  7 ...     (S splits: block i goes to split i % S)
    split:             0  1  2  0  1  2  0  1 ...     (S = 3 here)
                       ^ online softmax over bs-token blocks, fp32 running (max, denom, acc)

Blocks are dealt out in turn rather than in contiguous ranges so that the split count can
be chosen for the longest context the launch may see (a decode graph is captured once for
max_model_len) and still keep every split busy on a short one.

With one split the program writes the normalised output; with several (flash-decoding,
for few sequences with long contexts) each writes its partial (acc / denom, log-sum-exp)
and `_combine_kernel` merges the splits per (b, head).

The launchers accept CUDA tensors, or CPU tensors when TRITON_INTERPRET=1 was set
before triton was first imported (correctness tests only; see interpreter_ready).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_LOG2E_C = tl.constexpr(_LOG2E)  # the same, for use inside the kernels
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreter_ready() -> bool:
    """Whether these kernels run on CPU tensors: TRITON_INTERPRET=1 must have been set
    before `triton` itself was imported (its own jit'd library, e.g. tl.sum, is built then)."""
    return all(type(f).__name__ == "InterpretedFunction" for f in (_store_kv_kernel, tl.standard.sum))


def _check_device(*tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    for t in tensors:
        assert t.device == dev, f"all tensors must be on one device, got {t.device} and {dev}"
    assert dev.type == "cuda" or interpreter_ready(), (
        f"triton kernels need CUDA tensors (got {dev}); on CPU set TRITON_INTERPRET=1 before "
        "anything imports triton, or use the torch attention backend"
    )


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.dim() == 4, f"cache must be [N, bs, Hkv, D], got {tuple(k_cache.shape)}"
    assert k_cache.shape == v_cache.shape, f"{tuple(k_cache.shape)} != {tuple(v_cache.shape)}"
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (*_FLOAT_DTYPES, torch.float8_e4m3fn), (
        f"cache dtypes must match and be fp32/fp16/bf16/fp8 e4m3, got {k_cache.dtype}, {v_cache.dtype}"
    )
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache/v_cache must be contiguous"


def _check_query(query: torch.Tensor, k_cache: torch.Tensor, v_scale: float) -> bool:
    """Whether the cache is fp8 (the kernels then widen K and V to the query's dtype, the
    K scale in the softmax scale and the V scale on the output); else it holds the query's dtype."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    assert fp8 or query.dtype == k_cache.dtype, f"query dtype {query.dtype} != cache dtype {k_cache.dtype}"
    assert fp8 or v_scale == 1.0, "a V scale other than 1 needs an fp8 cache"
    return fp8


# --------------------------------------------------------------------------- store_kv


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr, DIM_P: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok)  # int64; negative = padding token, skip
    if slot >= 0:
        h = tl.arange(0, HEADS_P)
        d = tl.arange(0, DIM_P)
        mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
        src_k = key_ptr + tok.to(tl.int64) * stride_kt + h[:, None] * stride_kh + d[None, :]
        src_v = value_ptr + tok.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :]
        # the cache is contiguous, so slot s is row s of [N * bs, Hkv, D]
        dst = slot * (NUM_KV_HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(src_k, mask=mask)
        v = tl.load(src_v, mask=mask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D], last dim contiguous
    value: torch.Tensor,  # [T, Hkv, D], last dim contiguous
    k_cache: torch.Tensor,  # [N, bs, Hkv, D] contiguous
    v_cache: torch.Tensor,  # [N, bs, Hkv, D] contiguous
    slot_mapping: torch.Tensor,  # [T] int64; slot < 0 = skip
) -> None:
    """Write key[t], value[t] into cache slot slot_mapping[t] (cast to the cache dtype).

    Same semantics as reference.store_kv. key/value may be strided views (e.g. slices
    of a fused QKV projection) as long as the head_dim axis has stride 1.
    """
    _check_cache(k_cache, v_cache)
    t, hkv, d = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert k_cache.shape[2:] == (hkv, d), f"key heads/dim {(hkv, d)} != cache {tuple(k_cache.shape[2:])}"
    assert key.stride(2) == 1 and value.stride(2) == 1, "key/value head_dim must have stride 1"
    assert slot_mapping.shape == (t,) and slot_mapping.dtype == torch.int64, (
        f"slot_mapping must be [T={t}] int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
    )
    assert slot_mapping.is_contiguous(), "slot_mapping must be contiguous"
    _check_device(key, value, k_cache, v_cache, slot_mapping)
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=hkv, HEAD_DIM=d,
        HEADS_P=triton.next_power_of_2(hkv), DIM_P=triton.next_power_of_2(d),
    )


# --------------------------------------------------------------------------- decode


@triton.jit
def _softmax_step(q, k, v, visible, m, denom, acc, qk_scale, softcap, USE_DOT: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """One key tile of an fp32 online softmax, base 2 (flash attention's update).

    q [R, D] (fp32 unless USE_DOT), k and v [N, D], visible [R, N] or [1, N]; running
    max m [R], denominator denom [R] (sum of exp2(s - m)) and acc [R, D] (the same
    weights times v). With SOFTCAP, the scaled score s becomes softcap * tanh(s /
    softcap) first (Gemma 2). Returns the updated (m, denom, acc)."""
    if USE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [R, N]
    else:
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    s = s * qk_scale
    if SOFTCAP:  # in natural units: tanh(x) = 1 - 2 / (exp(2x) + 1), saturating cleanly at +-1
        x = s / (_LOG2E_C * softcap)
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * _LOG2E_C
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    # a row that has seen no visible key yet (a sliding window's, before its first) keeps
    # m = -inf: exponents taken against 0 leave it at zero weight instead of NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    if USE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    else:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    return m_new, denom, acc * alpha[:, None] + pv



@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale,  # softmax scale * log2(e): scores are kept in base 2 (an fp8 cache's K scale in it)
    v_scale,  # an fp8 cache's V scale (1 otherwise)
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    stride_cn, stride_cb, stride_ch,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, GROUP_P: tl.constexpr, DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    window,  # a sliding window's tokens; 0: none
    softcap, SOFTCAP: tl.constexpr,  # Gemma 2's score cap (SOFTCAP: one is set)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # the first position the query sees: its window's, else 0; blocks before it are skipped
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)

    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, DIM_P)
    t = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + g  # query heads of this GQA group (padded to GROUP_P)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask)
    if not USE_DOT:
        q = q.to(tl.float32)  # [GROUP_P, DIM_P]

    # split s takes blocks s, s + NUM_SPLITS, ... of its own sequence: every split has
    # work whatever the context's length, also when the grid was sized for a longer one
    # (a decode graph's, captured for max_model_len)
    num_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE

    m = tl.full([GROUP_P], float("-inf"), tl.float32)  # running max (base-2 scores)
    denom = tl.full([GROUP_P], 0.0, tl.float32)  # running sum of exp2(s - m)
    acc = tl.full([GROUP_P, DIM_P], 0.0, tl.float32)  # running sum of exp2(s - m) * v
    kv_head_off = kv_head * stride_ch
    for i in range(lo // BLOCK_SIZE + split, num_blocks, NUM_SPLITS):
        block = tl.load(block_tables_ptr + seq * stride_bt + i).to(tl.int64)
        t_mask = (i * BLOCK_SIZE + t < seq_len) & (i * BLOCK_SIZE + t >= lo)
        kv_mask = t_mask[:, None] & d_mask[None, :]
        off = block * stride_cn + t[:, None] * stride_cb + kv_head_off + d[None, :]
        k = tl.load(k_cache_ptr + off, mask=kv_mask, other=0.0)  # [BLOCK_SIZE, DIM_P]
        v = tl.load(v_cache_ptr + off, mask=kv_mask, other=0.0)
        if KV_FP8:  # e4m3 widens exactly to fp16, bf16 and fp32
            k = k.to(q_ptr.dtype.element_ty)
            v = v.to(q_ptr.dtype.element_ty)
        # every visited block has >= 1 valid token, so the running max stays finite
        m, denom, acc = _softmax_step(q, k, v, t_mask[None, :], m, denom, acc, qk_scale, softcap, USE_DOT,
                                      DOT_PRECISION, SOFTCAP)

    safe_denom = tl.where(denom > 0.0, denom, 1.0)  # empty split (or seq_len == 0): output 0
    out = acc / safe_denom[:, None]
    if KV_FP8:
        out = out * v_scale
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # partials: [B, H, NUM_SPLITS, DIM_P] and lse [B, H, NUM_SPLITS], base 2
        row = (seq * NUM_HEADS + heads) * NUM_SPLITS + split  # [GROUP_P]
        tl.store(part_out_ptr + row[:, None] * DIM_P + d[None, :], out, mask=q_mask)
        lse = tl.where(denom > 0.0, m + tl.log2(safe_denom), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_P)
    d = tl.arange(0, DIM_P)
    s_mask = s < NUM_SPLITS
    row = (seq * NUM_HEADS + head) * NUM_SPLITS + s  # [SPLITS_P]
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    parts = tl.load(part_out_ptr + row[:, None] * DIM_P + d[None, :], mask=s_mask[:, None], other=0.0)
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all splits empty
    w = tl.exp2(lse - lse_max)  # 0 for empty splits
    total = tl.sum(w, axis=0)
    total = tl.where(total > 0.0, total, 1.0)
    out = tl.sum(parts * w[:, None], axis=0) / total
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _default_num_splits(num_programs: int, max_blocks: int, device: torch.device) -> int:
    """Split the context only when there are too few (seq, kv head) programs to fill
    the GPU and each split still gets a useful amount of context (>= 8 blocks)."""
    if device.type != "cuda":
        return 1
    sms = _num_sms(device)
    if num_programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, num_programs), max_blocks // 8, 64))


def paged_decode_attention(
    query: torch.Tensor,  # [B, H, D], head_dim contiguous
    k_cache: torch.Tensor,  # [N, bs, Hkv, D] contiguous
    v_cache: torch.Tensor,  # [N, bs, Hkv, D] contiguous
    block_tables: torch.Tensor,  # [B, M] int32, last dim contiguous
    seq_lens: torch.Tensor,  # [B] int32, context incl. the new token, >= 1
    scale: float,
    max_seq_len: int | None = None,  # >= max(seq_lens); None reads it from seq_lens (syncs)
    num_splits: int | None = None,  # context splits (flash-decoding); None = heuristic
    use_dot: bool | None = None,  # tl.dot vs broadcast-multiply; None = dot for fp16/bf16 on CUDA
    kv_scales: tuple[float, float] = (1.0, 1.0),  # an fp8 cache's (K, V) scales
    window: int | None = None,  # a sliding window: the last `window` positions only
    softcap: float | None = None,  # scores as softcap * tanh(s / softcap)
) -> torch.Tensor:  # [B, H, D], query dtype
    """One query token per sequence attending to its paged context (= reference version)."""
    _check_cache(k_cache, v_cache)
    b, h, d = query.shape
    _, bs, hkv, cache_d = k_cache.shape
    assert d == cache_d, f"query head_dim {d} != cache head_dim {cache_d}"
    assert h % hkv == 0, f"num_heads {h} must be a multiple of num_kv_heads {hkv}"
    fp8 = _check_query(query, k_cache, kv_scales[1])
    assert query.stride(2) == 1, "query head_dim must have stride 1"
    assert bs & (bs - 1) == 0, f"block_size must be a power of two, got {bs}"
    assert block_tables.dim() == 2 and block_tables.shape[0] == b, (
        f"block_tables must be [B={b}, M], got {tuple(block_tables.shape)}"
    )
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1, (
        f"block_tables must be int32 with contiguous rows, got {block_tables.dtype}"
    )
    assert seq_lens.shape == (b,) and seq_lens.dtype == torch.int32, (
        f"seq_lens must be [B={b}] int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}"
    )
    _check_device(query, k_cache, v_cache, block_tables, seq_lens)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if b == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    max_blocks = triton.cdiv(max_seq_len, bs)
    assert max_blocks <= block_tables.shape[1], (
        f"max_seq_len {max_seq_len} needs {max_blocks} blocks, block_tables has {block_tables.shape[1]}"
    )
    if num_splits is None:
        num_splits = _default_num_splits(b * hkv, max_blocks, query.device)
    num_splits = max(1, min(num_splits, max_blocks))
    if use_dot is None:
        use_dot = query.is_cuda and query.dtype != torch.float32  # fp32 dot would use tf32
    group = h // hkv
    dim_p = triton.next_power_of_2(d)
    # tl.dot needs every dimension >= 16
    group_p = max(triton.next_power_of_2(group), 16 if use_dot else 1)
    if use_dot:
        assert bs >= 16 and dim_p >= 16, f"use_dot needs block_size, head_dim >= 16 (got {bs}, {d})"
    if num_splits > 1:
        part_out = torch.empty(b, h, num_splits, dim_p, device=query.device, dtype=torch.float32)
        part_lse = torch.empty(b, h, num_splits, device=query.device, dtype=torch.float32)
    else:
        part_out = part_lse = out  # unused
    _paged_decode_kernel[(b, hkv, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * kv_scales[0] * _LOG2E, kv_scales[1],
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=h, GROUP=group, HEAD_DIM=d, BLOCK_SIZE=bs, GROUP_P=group_p, DIM_P=dim_p,
        NUM_SPLITS=num_splits, USE_DOT=use_dot,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",  # no tf32 for fp32 caches
        KV_FP8=fp8, window=window or 0, softcap=float(softcap or 0.0), SOFTCAP=bool(softcap),
    )
    if num_splits > 1:
        _combine_kernel[(b, h)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            NUM_HEADS=h, HEAD_DIM=d, DIM_P=dim_p,
            NUM_SPLITS=num_splits, SPLITS_P=triton.next_power_of_2(num_splits),
        )
    return out


# --------------------------------------------------------------------------- prefill


@triton.jit
def _varlen_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr, out_ptr,
    qk_scale,  # softmax scale * log2(e): scores are kept in base 2 (an fp8 cache's K scale in it)
    v_scale,  # an fp8 cache's V scale (1 otherwise)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cn, stride_cb, stride_ch,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    window,  # a sliding window's tokens; 0: none
    softcap, SOFTCAP: tl.constexpr,  # Gemma 2's score cap (SOFTCAP: one is set)
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len:  # ragged batch: most sequences have fewer tiles than the grid
        seq_len = tl.load(seq_lens_ptr + seq)
        cached = seq_len - q_len  # the prefix already in the cache before this chunk
        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = m < q_len
        qpos = cached + m  # each query token's position in its sequence
        d = tl.arange(0, DIM_P)
        d_mask = d < HEAD_DIM
        q_rows = (q_start + m).to(tl.int64)
        q_mask = m_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0)
        if not USE_DOT:
            q = q.to(tl.float32)
        kv_off = (head // GROUP) * stride_ch
        n = tl.arange(0, BLOCK_N)
        # causal: this tile's last query sees keys up to its own position, no further
        hi = tl.minimum(seq_len, cached + (tile + 1) * BLOCK_M)

        # a sliding window: this tile's first query sees keys after its position - window,
        # so the key tiles before that one are skipped
        lo = tl.where(window > 0, tl.maximum(cached + tile * BLOCK_M - window + 1, 0), 0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base-2 scores)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)  # running sum of exp2(s - m_i)
        acc = tl.full([BLOCK_M, DIM_P], 0.0, tl.float32)
        for start in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
            kpos = start + n
            k_valid = (kpos < hi) & (kpos >= lo)  # before lo a block may be released (-1): never read it
            # a key tile may span pages: each key finds its own block (never past the context)
            block = tl.load(block_tables_ptr + seq * stride_bt + kpos // BLOCK_SIZE, mask=k_valid, other=0)
            off = (block.to(tl.int64) * stride_cn + (kpos % BLOCK_SIZE) * stride_cb)[:, None] + kv_off + d[None, :]
            kv_mask = k_valid[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + off, mask=kv_mask, other=0.0)  # [BLOCK_N, DIM_P]
            v = tl.load(v_cache_ptr + off, mask=kv_mask, other=0.0)
            if KV_FP8:
                k = k.to(q_ptr.dtype.element_ty)
                v = v.to(q_ptr.dtype.element_ty)
            visible = (kpos[None, :] <= qpos[:, None]) & k_valid[None, :]
            visible = visible & ((window == 0) | (kpos[None, :] > qpos[:, None] - window))
            m_i, l_i, acc = _softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, softcap, USE_DOT, DOT_PRECISION,
                                          SOFTCAP)
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        if KV_FP8:
            out = out * v_scale
        o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _prefill_tiles(head_dim: int, block_size: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): query rows and keys a program handles at once. On CUDA tiles
    that fill the tensor cores and fit shared memory up to head_dim 256; under the
    interpreter small ones (numpy runs every program in turn)."""
    if device.type != "cuda":
        return 16, block_size
    return 64, 64 if head_dim <= 128 else 32


def varlen_prefill_attention(
    query: torch.Tensor,  # [T, H, D], the new tokens of B sequences back to back, head_dim contiguous
    k_cache: torch.Tensor,  # [N, bs, Hkv, D] contiguous, the new tokens' K/V already stored
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, M] int32, last dim contiguous
    query_start_loc: torch.Tensor,  # [B + 1] int32: sequence b's tokens are rows start[b] .. start[b+1]-1
    seq_lens: torch.Tensor,  # [B] int32: cached prefix + new tokens
    scale: float,
    max_query_len: int,  # >= every sequence's new-token count (sizes the grid)
    block_m: int | None = None,
    block_n: int | None = None,
    use_dot: bool | None = None,  # None: tl.dot, except for bf16 under the interpreter (see tests)
    kv_scales: tuple[float, float] = (1.0, 1.0),  # an fp8 cache's (K, V) scales
    window: int | None = None,  # a sliding window: each query sees the last `window` positions
    softcap: float | None = None,  # scores as softcap * tanh(s / softcap)
) -> torch.Tensor:  # [T, H, D], query dtype
    """Ragged causal attention over the paged cache (= reference.varlen_attention).

    Query j of sequence b sits at position seq_len - q_len + j and attends to keys
    0 .. that position, which it reads from the cache (the cached prefix and the
    chunk's own keys alike). Program (tile, b, head) computes BLOCK_M query rows of
    one head, walking the keys in BLOCK_N tiles with an fp32 online softmax.
    """
    _check_cache(k_cache, v_cache)
    t, h, d = query.shape
    _, bs, hkv, cache_d = k_cache.shape
    b = seq_lens.shape[0]
    assert d == cache_d, f"query head_dim {d} != cache head_dim {cache_d}"
    assert h % hkv == 0, f"num_heads {h} must be a multiple of num_kv_heads {hkv}"
    fp8 = _check_query(query, k_cache, kv_scales[1])
    assert query.stride(2) == 1, "query head_dim must have stride 1"
    assert block_tables.dim() == 2 and block_tables.shape[0] == b, (
        f"block_tables must be [B={b}, M], got {tuple(block_tables.shape)}"
    )
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1, (
        f"block_tables must be int32 with contiguous rows, got {block_tables.dtype}"
    )
    assert seq_lens.dtype == torch.int32 and seq_lens.dim() == 1, f"seq_lens must be [B] int32, got {seq_lens.dtype}"
    assert query_start_loc.shape == (b + 1,) and query_start_loc.dtype == torch.int32, (
        f"query_start_loc must be [B+1={b + 1}] int32, got {tuple(query_start_loc.shape)} {query_start_loc.dtype}"
    )
    _check_device(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if t == 0 or b == 0:
        return out
    tile_m, tile_n = _prefill_tiles(d, bs, query.device)
    block_m, block_n = block_m or tile_m, block_n or tile_n
    if use_dot is None:
        use_dot = query.is_cuda or query.dtype != torch.bfloat16
    if use_dot:
        assert block_m >= 16 and block_n >= 16 and d >= 16, "tl.dot needs tiles and head_dim of at least 16"
    grid = (triton.cdiv(max(max_query_len, 1), block_m), b, h)
    _varlen_prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * kv_scales[0] * _LOG2E, kv_scales[1],
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=h // hkv, HEAD_DIM=d, DIM_P=triton.next_power_of_2(d),
        BLOCK_SIZE=bs, BLOCK_M=block_m, BLOCK_N=block_n, USE_DOT=use_dot,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", KV_FP8=fp8, window=window or 0,
        softcap=float(softcap or 0.0), SOFTCAP=bool(softcap),
    )
    return out
