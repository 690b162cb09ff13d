"""Triton KV-store and paged-decode kernels vs the torch reference, on CUDA or on CPU
under the Triton interpreter (tests/conftest.py); tests/gpu/test_triton_gpu.py covers
bigger sizes on a GPU."""

from __future__ import annotations

import pytest
import torch

from engine.attention import quantize_kv, reference
from tests import triton_env

pytestmark = pytest.mark.unit

kernels, DEVICE = triton_env.kernels_or_skip()

TOL = triton_env.TOL


def make_decode_case(group, head_dim, block_size, dtype, lens=None, num_kv_heads=2, seed=0):
    """Random cache + query; each sequence gets distinct blocks in shuffled order."""
    g = torch.Generator().manual_seed(seed)
    if lens is None:  # ragged: a single token, block boundaries +-1, a few hundred
        bs = block_size
        lens = [1, bs - 1, bs, bs + 1, 2 * bs + 1, 300]
    b = len(lens)
    m = max((n + block_size - 1) // block_size for n in lens)
    num_blocks = b * m + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=g)[: b * m].view(b, m).to(torch.int32)
    query = torch.randn(b, group * num_kv_heads, head_dim, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return tuple(t.to(DEVICE) for t in (query, k_cache, v_cache, block_tables, seq_lens))


def check_decode(case, **kw):
    query, k_cache, v_cache, block_tables, seq_lens = case
    scale = query.shape[-1] ** -0.5
    max_len = int(seq_lens.max())
    out = kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, max_len, **kw)
    ref = reference.paged_decode_attention(
        query.float(), k_cache.float(), v_cache.float(), block_tables, seq_lens, scale, max_len,
        window=kw.get("window")
    )
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out.float(), ref, **TOL[query.dtype])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_fp32_matches_reference(group, head_dim, block_size):
    check_decode(make_decode_case(group, head_dim, block_size, torch.float32), use_dot=False)


@pytest.mark.parametrize("head_dim,block_size", [(64, 32), (128, 16)])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_precision(dtype, group, head_dim, block_size):
    check_decode(make_decode_case(group, head_dim, block_size, dtype), use_dot=False)


# The interpreter's tl.dot multiplies bf16 operands as raw uint16, so the dot path
# (used for fp16/bf16 on CUDA) is checked here with fp32 and fp16 only.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group,head_dim,block_size", [(1, 64, 16), (4, 128, 32), (8, 64, 16)])
def test_decode_dot_path(dtype, group, head_dim, block_size):
    check_decode(make_decode_case(group, head_dim, block_size, dtype), use_dot=True)


def test_decode_default_max_seq_len_and_dispatch():
    """max_seq_len=None reads it from seq_lens; use_dot/num_splits=None pick by device."""
    query, k_cache, v_cache, block_tables, seq_lens = make_decode_case(2, 64, 16, torch.float32)
    out = kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125)
    ref = reference.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("num_splits", [2, 3, 8, 64])
def test_decode_split_context(num_splits):
    """Flash-decoding splits: short sequences leave whole splits empty."""
    case = make_decode_case(4, 64, 16, torch.float32, lens=[1, 17, 250, 64])
    check_decode(case, num_splits=num_splits, use_dot=False)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [1, 20, 64])
def test_decode_sliding_window(num_splits, window):
    """Each query sees its last `window` positions: the blocks before the window's are
    skipped, the window's first block masked up to its start; contexts shorter than the
    window see everything. The oracle differs from full attention (it is not vacuous)."""
    case = make_decode_case(4, 64, 16, torch.float32, lens=[1, 17, 250, 64])
    check_decode(case, num_splits=num_splits, use_dot=False, window=window)
    query, k_cache, v_cache, block_tables, seq_lens = case
    full = reference.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125)
    ref = reference.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125, window=window)
    assert not torch.allclose(full[2], ref[2])


@pytest.mark.parametrize("num_splits", [4, 16])
def test_decode_launched_for_a_longer_context_than_any_sequence_has(num_splits):
    """A decode graph's launch: the grid and the table's width are sized for max_model_len
    (here 1,024 tokens, 64 blocks) and every sequence is much shorter; blocks are dealt to
    the splits in turn, so a 4-block sequence spreads over 4 of them."""
    query, k_cache, v_cache, block_tables, seq_lens = make_decode_case(4, 64, 16, torch.float32, lens=[1, 17, 40, 64])
    wide = torch.zeros(block_tables.shape[0], 64, dtype=torch.int32, device=block_tables.device)
    wide[:, : block_tables.shape[1]] = block_tables
    out = kernels.paged_decode_attention(query, k_cache, v_cache, wide, seq_lens, 0.125, 1024,
                                         num_splits=num_splits, use_dot=False)
    ref = reference.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_decode_odd_head_dim_and_group():
    check_decode(make_decode_case(3, 80, 16, torch.float32, num_kv_heads=1), use_dot=False)


def test_decode_ignores_table_entries_past_the_context():
    query, k_cache, v_cache, block_tables, seq_lens = make_decode_case(2, 64, 16, torch.float32)
    used = (seq_lens + 15) // 16
    garbage = block_tables.clone()
    for i, n in enumerate(used.tolist()):
        garbage[i, n:] = 10**6  # out of range: must never be read
    out = kernels.paged_decode_attention(query, k_cache, v_cache, garbage, seq_lens, 0.125, 300)
    ref = kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125, 300)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_decode_rejects_bad_inputs():
    query, k_cache, v_cache, block_tables, seq_lens = make_decode_case(2, 64, 16, torch.float32)
    with pytest.raises(AssertionError, match="int32"):
        kernels.paged_decode_attention(query, k_cache, v_cache, block_tables.long(), seq_lens, 1.0, 300)
    with pytest.raises(AssertionError, match="contiguous"):
        kernels.paged_decode_attention(
            query, k_cache.transpose(1, 2), v_cache.transpose(1, 2), block_tables, seq_lens, 1.0, 300
        )
    with pytest.raises(AssertionError, match="dtype"):
        kernels.paged_decode_attention(query.half(), k_cache, v_cache, block_tables, seq_lens, 1.0, 300)


def make_store_case(cache_dtype, key_dtype=torch.float32, tokens=7, num_kv_heads=2, head_dim=64, seed=0):
    """Key/value are strided slices of one fused [T, 3, Hkv, D] tensor, as after a QKV matmul."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(tokens, 3, num_kv_heads, head_dim, generator=g).to(DEVICE, key_dtype)
    key, value = fused[:, 1], fused[:, 2]
    shape = (6, 16, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(cache_dtype)
    v_cache = torch.randn(shape, generator=g).to(cache_dtype)
    slots = torch.randperm(6 * 16, generator=g)[:tokens]
    slots[[1, 4]] = -1  # padding tokens
    return key, value, k_cache.to(DEVICE), v_cache.to(DEVICE), slots.to(DEVICE)


@pytest.mark.parametrize(
    "key_dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
     (torch.float32, torch.float16), (torch.float32, torch.bfloat16)],
)
def test_store_kv_matches_reference(key_dtype, cache_dtype):
    key, value, k_cache, v_cache, slots = make_store_case(cache_dtype, key_dtype)
    assert not key.is_contiguous()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, k_ref, v_ref, slots)
    kernels.store_kv(key, value, k_cache, v_cache, slots)
    if DEVICE.type == "cpu" and cache_dtype == torch.bfloat16 and key_dtype != cache_dtype:
        # the interpreter truncates fp32 -> bf16 (GPUs round to nearest even): 1 ulp
        tol = dict(atol=0, rtol=2**-7)
    else:
        tol = dict(atol=0, rtol=0)
    torch.testing.assert_close(k_cache, k_ref, **tol)
    torch.testing.assert_close(v_cache, v_ref, **tol)


def test_store_kv_all_skipped_and_empty():
    key, value, k_cache, v_cache, slots = make_store_case(torch.float32)
    before = k_cache.clone(), v_cache.clone()
    kernels.store_kv(key, value, k_cache, v_cache, torch.full_like(slots, -1))
    kernels.store_kv(key[:0], value[:0], k_cache, v_cache, slots[:0])
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_store_kv_rejects_int32_slots():
    key, value, k_cache, v_cache, slots = make_store_case(torch.float32)
    with pytest.raises(AssertionError, match="int64"):
        kernels.store_kv(key, value, k_cache, v_cache, slots.int())


def test_backend_forward_decode_batch():
    """TritonAttention.forward on a decode-only batch: store, then paged decode."""
    from engine.attention import AttentionMetadata, TorchAttention
    from engine.attention.triton import backend

    query, k_cache, v_cache, block_tables, seq_lens = make_decode_case(2, 64, 16, torch.float32)
    b, _, d = query.shape
    key, value = torch.randn(b, 2, d, device=DEVICE), torch.randn(b, 2, d, device=DEVICE)
    pos = (seq_lens - 1).long()
    slots = block_tables.long().gather(1, (pos // 16)[:, None]).squeeze(1) * 16 + pos % 16
    meta = AttentionMetadata(
        slot_mapping=slots, num_decode_tokens=b, decode_block_tables=block_tables,
        decode_seq_lens=seq_lens, decode_max_seq_len=int(seq_lens.max()),
        prefill_block_tables=block_tables[:0], prefill_query_lens=[], prefill_seq_lens=[],
    )
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = TorchAttention().forward(query, key, value, k_ref, v_ref, meta, d**-0.5)
    out = backend.TritonAttention().forward(query, key, value, k_cache, v_cache, meta, d**-0.5)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_and_prefill_over_an_fp8_cache(dtype):
    """An fp8 e4m3 cache: both kernels widen K and V to the query's dtype, the K scale in
    the softmax scale and the V scale on the output (= the reference on the same bytes)."""
    query, k, v, tables, lens = make_decode_case(2, 64, 16, torch.float32, lens=[1, 17, 40], seed=9)
    kv_scales = (0.5, 0.25)
    k8, v8 = quantize_kv(k, kv_scales[0]), quantize_kv(v, kv_scales[1])
    scale = 64**-0.5
    got = kernels.paged_decode_attention(query.to(dtype), k8, v8, tables, lens, scale, kv_scales=kv_scales)
    want = reference.paged_decode_attention(query, k8, v8, tables, lens, scale, None, kv_scales)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    rows = torch.randn(12, 4, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    starts = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([17, 40], dtype=torch.int32, device=DEVICE)
    got = kernels.varlen_prefill_attention(rows.to(dtype), k8, v8, tables[1:], starts, seq_lens, scale, 7,
                                           kv_scales=kv_scales)
    want = reference.varlen_attention(rows, None, None, k8, v8, tables[1:], [5, 7], [17, 40], scale, kv_scales)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    with pytest.raises(AssertionError, match="needs an fp8 cache"):
        kernels.paged_decode_attention(query, k, v, tables, lens, scale, kv_scales=kv_scales)


@pytest.mark.parametrize("window", [None, 20])
def test_decode_soft_capped_scores(window):
    """Gemma 2's softcap * tanh(s / softcap) on the scaled scores, alone and with a window;
    a cap small enough to change every row's answer."""
    query, k_cache, v_cache, block_tables, seq_lens = make_decode_case(4, 64, 16, torch.float32, lens=[1, 17, 90])
    query = query * 8  # scores well past the cap
    out = kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125, 90, num_splits=2,
                                         use_dot=False, window=window, softcap=5.0)
    ref = reference.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125, window=window,
                                           softcap=5.0)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    plain = reference.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125, window=window)
    assert not torch.allclose(ref[1:], plain[1:])
