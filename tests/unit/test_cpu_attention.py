"""The C++ CPU paged-decode kernel against the torch reference, and the CpuAttention
backend against TorchAttention on a mixed decode + prefill step.

The kernel tests marked with `kernel_build` run once per build of the kernels this CPU
executes (tests/unit/conftest.py): AMX, AVX-512 BF16, AVX-512 and AVX2 on an AMX Xeon.
A build failure fails these tests rather than skipping them: CI machines have a compiler
and ninja.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, TorchAttention, dequantize_kv, get_backend, quantize_kv, reference
from engine.attention.cpu import kernels
from engine.attention.cpu.backend import CpuAttention
from engine.cpu_kernels import build

pytestmark = pytest.mark.unit

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


@pytest.fixture(scope="module", autouse=True)
def compiled():
    try:
        return build.load()
    except build.KernelBuildError as e:
        pytest.fail(f"the cpu attention kernel must build here: {e}")


def ragged_lens(block_size: int, batch: int, g: torch.Generator) -> list[int]:
    """1, block boundaries +-1, a few hundred; then random lengths in [1, 400)."""
    bs = block_size
    lens = [1, bs - 1, bs, bs + 1, 2 * bs - 1, 2 * bs, 2 * bs + 1, 300, 333]
    lens += torch.randint(1, 400, (max(0, batch - len(lens)),), generator=g).tolist()
    return lens[:batch]


def make_case(group, head_dim, block_size, dtype, lens, num_kv_heads=2, seed=0):
    """Random cache + query; each sequence gets distinct blocks in shuffled order, and
    the table is wider than needed (its tail holds garbage ids that must not be read)."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    m = max((n + block_size - 1) // block_size for n in lens) + 1
    num_blocks = b * m + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=g)[: b * m].view(b, m).to(torch.int32)
    for i, n in enumerate(lens):  # ids past the context are never read: poison them
        block_tables[i, (n + block_size - 1) // block_size :] = -1
    query = torch.randn(b, group * num_kv_heads, head_dim, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return query, k_cache, v_cache, block_tables, seq_lens


def run_both(query, k_cache, v_cache, block_tables, seq_lens):
    scale = query.shape[-1] ** -0.5
    got = kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale)
    ref_tables = block_tables.clamp(min=0)  # the reference gathers padded blocks, then masks
    want = reference.paged_decode_attention(
        query.float(), k_cache.float(), v_cache.float(), ref_tables, seq_lens, scale
    )
    return got, want


def outputs_over_threads(call, counts):
    """`call()` once with torch set to each thread count in `counts`."""
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in counts:
            torch.set_num_threads(n)
            outs.append(call())
    finally:
        torch.set_num_threads(threads)
    return outs


@pytest.mark.usefixtures("kernel_build")
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_fp32_matches_reference(group, head_dim, block_size):
    g = torch.Generator().manual_seed(group * 1000 + head_dim + block_size)
    for batch in (1, 64):
        lens = ragged_lens(block_size, batch, g) if batch > 1 else [333]
        case = make_case(group, head_dim, block_size, torch.float32, lens, seed=batch)
        got, want = run_both(*case)
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.usefixtures("kernel_build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,group", [(64, 4), (128, 1), (96, 2)])
def test_decode_over_an_fp8_cache_matches_the_reference_on_its_rounded_values(dtype, head_dim, group):
    """An fp8 e4m3 cache (K and V stored divided by their scales) under a query of each
    dtype: the kernel widens it exactly (subnormals and saturated values included), the K
    scale in the softmax scale and the V scale on the output."""
    g = torch.Generator().manual_seed(head_dim + group)
    query, k, v, tables, lens = make_case(group, head_dim, 16, torch.float32, ragged_lens(16, 12, g), seed=5)
    k[0, :3] = torch.tensor([1e-3, -2.5e-3, 1e4])[:, None, None]  # subnormal in e4m3, and saturating
    kv_scales = (0.5, 0.25)
    k8, v8 = quantize_kv(k * 4, kv_scales[0]), quantize_kv(v, kv_scales[1])
    assert k8.dtype == torch.float8_e4m3fn and k8.float().abs().max() == 448
    scale = head_dim**-0.5
    got = kernels.paged_decode_attention(query.to(dtype), k8, v8, tables, lens, scale * kv_scales[0],
                                         v_scale=kv_scales[1])
    want = reference.paged_decode_attention(query, k8, v8, tables.clamp(min=0), lens, scale, None, kv_scales)
    assert got.dtype == dtype
    # fp16 rounds outputs of up to ~4 here to steps of 2^-8
    tol = dict(atol=4e-3, rtol=4e-3) if dtype == torch.float16 else TOL[dtype]
    torch.testing.assert_close(got.float(), want, **tol)
    with pytest.raises(RuntimeError, match="needs an fp8 cache"):
        kernels.paged_decode_attention(query, k, v, tables, lens, scale, v_scale=0.5)
    with pytest.raises(RuntimeError, match="neither the query"):
        kernels.paged_decode_attention(query.to(torch.bfloat16), k, v, tables, lens, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_fp8_gives_the_bytes_of_quantize_kv_then_store(dtype):
    """The compiled store into an fp8 cache (decode steps and the one-call decoder layers)
    quantizes as engine/attention quantize_kv's torch operators do, to the bit: scales,
    saturation beyond 448, subnormals, skipped slots, every finite bf16 value; and the
    prefill's store (store_kv_fp8_rounded) gives the rows back as dequantize_kv does."""
    ops = build.load()
    g = torch.Generator().manual_seed(3)
    key = (torch.randn(6, 2, 64, generator=g) * 40).to(dtype)
    value = (torch.randn(6, 2, 64, generator=g) * 1e-3).to(dtype)
    key[0, 0, :4] = torch.tensor([1e5, -1e5, 0.0, 3e-3])
    slots = torch.tensor([3, -1, 0, 17, 9, 30])
    got = [torch.zeros(4, 8, 2, 64, dtype=torch.float8_e4m3fn) for _ in range(2)]
    ops.store_kv_fp8(*got, key, value, slots, 0.5, 0.25)
    want = [torch.zeros(4, 8, 2, 64, dtype=torch.float8_e4m3fn) for _ in range(2)]
    ops.store_kv(*want, quantize_kv(key, 0.5), quantize_kv(value, 0.25), slots)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # a prefill's store also gives the rows back as stored, every row (a skipped slot's too)
    got2 = [torch.zeros(4, 8, 2, 64, dtype=torch.float8_e4m3fn) for _ in range(2)]
    rows = [torch.full_like(key, 7.0), torch.full_like(value, 7.0)]
    ops.store_kv_fp8_rounded(*got2, key, value, slots, 0.5, 0.25, *rows)
    for a, b in zip(got2, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(rows[0], dequantize_kv(quantize_kv(key, 0.5), 0.5, dtype))
    assert torch.equal(rows[1], dequantize_kv(quantize_kv(value, 0.25), 0.25, dtype))
    # every finite bf16 value, at scale 1 (no division) and 0.5; 16 at a time on AVX-512
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    every = every[every.isfinite()]
    every = torch.cat([every, every[: (-len(every)) % 128]]).reshape(-1, 2, 64).to(dtype)
    slots = torch.arange(len(every))
    for scale in (1.0, 0.5):
        got = [torch.zeros(len(every), 1, 2, 64, dtype=torch.float8_e4m3fn) for _ in range(2)]
        ops.store_kv_fp8(*got, every, every, slots, scale, scale)
        want = quantize_kv(every, scale).view(torch.uint8).reshape(got[0].shape)
        assert torch.equal(got[0].view(torch.uint8), want) and torch.equal(got[1].view(torch.uint8), want)
        rows = [torch.empty_like(every) for _ in range(2)]
        ops.store_kv_fp8_rounded(*got, every, every, slots, scale, scale, *rows)
        back = dequantize_kv(quantize_kv(every, scale), scale, dtype)
        assert torch.equal(rows[0], back) and torch.equal(rows[1], back)


@pytest.mark.usefixtures("kernel_build")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_half_precision_matches_reference(dtype, head_dim, group):
    g = torch.Generator().manual_seed(7)
    case = make_case(group, head_dim, 16, dtype, ragged_lens(16, 24, g), seed=3)
    got, want = run_both(*case)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.usefixtures("kernel_build")
@pytest.mark.parametrize("head_dim,block_size", [(32, 16), (80, 16), (256, 16), (64, 8), (128, 64)])
def test_decode_other_head_dims_and_blocks(head_dim, block_size):
    """256 has its own unrolled path; 32 and 80 take the run-time head_dim path;
    blocks of 8 are shorter than a 16-token score tile."""
    g = torch.Generator().manual_seed(head_dim)
    case = make_case(4, head_dim, block_size, torch.float32, ragged_lens(block_size, 12, g), num_kv_heads=1)
    got, want = run_both(*case)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def poison_before_windows(block_tables, seq_lens, block_size, window):
    """Blocks wholly before each sequence's window may be freed and reused: their table
    ids become -1 (the kernel must not read them) and the reference gets block 0 there."""
    poisoned = block_tables.clone()
    for i, n in enumerate(seq_lens.tolist()):
        poisoned[i, : max(0, n - window) // block_size] = -1
    return poisoned


@pytest.mark.usefixtures("kernel_build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_sliding_window_and_soft_cap(dtype, group):
    """A window reads the blocks it touches alone (those before it poisoned) and masks
    its first block up to its start; a soft cap bends the scores before the softmax. Each
    against the fp32 reference with the same window and cap, and (so that the check is
    not vacuous) away from full attention where the window hides something."""
    bs = 16
    g = torch.Generator().manual_seed(group)
    lens = ragged_lens(bs, 40, g)
    query, kc, vc, tables, seq_lens = make_case(group, 64, bs, dtype, lens, seed=group)
    query = (query.float() * 4).to(dtype)  # scores large enough for the cap to matter
    scale = 64**-0.5
    full = reference.paged_decode_attention(query.float(), kc.float(), vc.float(), tables.clamp(min=0), seq_lens,
                                            scale)
    for window, softcap in ((1, None), (20, None), (64, None), (100, 5.0), (None, 5.0), (1000, None)):
        poisoned = poison_before_windows(tables, seq_lens, bs, window) if window else tables
        got = kernels.paged_decode_attention(query, kc, vc, poisoned, seq_lens, scale, window=window,
                                             softcap=softcap)
        want = reference.paged_decode_attention(query.float(), kc.float(), vc.float(), poisoned.clamp(min=0),
                                                seq_lens, scale, window=window, softcap=softcap)
        torch.testing.assert_close(got.float(), want, **TOL[dtype])
        if softcap or window < max(lens):
            assert (want - full).abs().max() > 0.1


@pytest.mark.usefixtures("kernel_build")
def test_decode_non_contiguous_views_and_out():
    """Caches as views of the engine's [layers, 2, ...] tensor; query a strided slice."""
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 2, 40, 16, 2, 64, generator=g)
    k_cache, v_cache = kv[1, 0], kv[1, 1]
    qkv = torch.randn(5, 3, 4, 64, generator=g)
    query = qkv[:, 0]  # [5, 4, 64], stride(0) = 3 * 4 * 64
    block_tables = torch.randperm(40, generator=g)[:20].view(5, 4).to(torch.int32)
    seq_lens = torch.tensor([1, 17, 33, 64, 50], dtype=torch.int32)
    out = torch.full((5, 4, 64), float("nan"))
    got = kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125, out=out)
    assert got is out
    want = reference.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.usefixtures("kernel_build")
def test_decode_is_bitwise_independent_of_threads_and_split():
    """1 thread vs several, whole rows vs split kv heads: same arithmetic per head."""
    g = torch.Generator().manual_seed(11)
    case = make_case(4, 64, 16, torch.float32, ragged_lens(16, 4, g), num_kv_heads=8)
    # 4 sequences: whole rows (8 kv heads) with 1 thread, runs of 2 with 4
    outs = outputs_over_threads(lambda: kernels.paged_decode_attention(*case, scale=0.125), (1, 4))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.usefixtures("kernel_build")
def test_decode_rejects_bad_block_ids():
    query, k_cache, v_cache, block_tables, seq_lens = make_case(2, 64, 16, torch.float32, [40, 20])
    block_tables[1, 0] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125)
    seq_lens[0] = block_tables.shape[1] * 16 + 1
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125)


@pytest.mark.usefixtures("kernel_build")
def test_backend_forward_mixed_batch_matches_torch():
    """Two decodes then two prefill chunks (one with a cached prefix), through forward()."""
    g = torch.Generator().manual_seed(5)
    nh, nkv, d, bs, num_blocks = 4, 2, 64, 16, 32
    k_cache = torch.randn(num_blocks, bs, nkv, d, generator=g)
    v_cache = torch.randn_like(k_cache)
    tables = [[3, 9, 4], [7], [12, 1, 20], [30, 31]]
    decode_lens, prefill = [40, 5], [(37, 37), (10, 25)]  # (query_len, seq_len)
    slots = [tables[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(decode_lens)]
    for i, (q_len, s_len) in enumerate(prefill):
        table = tables[2 + i]
        slots += [table[p // bs] * bs + p % bs for p in range(s_len - q_len, s_len)]
    t = len(slots)
    query = torch.randn(t, nh, d, generator=g)
    key = torch.randn(t, nkv, d, generator=g)
    value = torch.randn(t, nkv, d, generator=g)
    pad = lambda rows: torch.tensor([r + [0] * (3 - len(r)) for r in rows], dtype=torch.int32)  # noqa: E731
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decode_tokens=2,
        decode_block_tables=pad(tables[:2]), decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int32),
        decode_max_seq_len=max(decode_lens), prefill_block_tables=pad(tables[2:]),
        prefill_query_lens=[q for q, _ in prefill], prefill_seq_lens=[s for _, s in prefill],
    )
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    got = CpuAttention().forward(query, key, value, *caches[0], meta, d**-0.5)
    want = TorchAttention().forward(query, key, value, *caches[1], meta, d**-0.5)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(caches[0][0], caches[1][0], rtol=0, atol=0)
    decode_only = AttentionMetadata(**{**meta.__dict__, "slot_mapping": meta.slot_mapping[:2]})
    got = CpuAttention().forward(query[:2], key[:2], value[:2], *caches[0], decode_only, d**-0.5)
    torch.testing.assert_close(got, want[:2], **TOL[torch.float32])


needs_bf16_prefill = pytest.mark.skipif(
    not build.load_or_none() or not build.load().paged_prefill_attention_supported(),
    reason="the paged prefill kernel needs AVX512-BF16")


def prefill_case(group, head_dim, chunks, num_kv_heads=2, block_size=16, seed=0):
    """chunks: (query_len, seq_len) per sequence. A bf16 cache with distinct shuffled
    blocks per sequence (table tails poisoned), the chunk's rows; returns the kernel's
    inputs and, per sequence, its new rows' keys/values as stored in the cache."""
    g = torch.Generator().manual_seed(seed)
    m = max((s + block_size - 1) // block_size for _, s in chunks) + 1
    num_blocks = len(chunks) * m + 5
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).bfloat16()
    v_cache = torch.randn(shape, generator=g).bfloat16()
    tables = torch.randperm(num_blocks, generator=g)[: len(chunks) * m].view(len(chunks), m).to(torch.int32)
    keys, values = [], []
    for i, (q_len, s_len) in enumerate(chunks):
        tables[i, (s_len + block_size - 1) // block_size:] = -1
        pos = torch.arange(s_len - q_len, s_len)
        blocks = tables[i, pos // block_size].long()
        keys.append(k_cache[blocks, pos % block_size])
        values.append(v_cache[blocks, pos % block_size])
    rows = sum(q for q, _ in chunks)
    query = torch.randn(rows, group * num_kv_heads, head_dim, generator=g).bfloat16()
    starts = torch.tensor([0] + [sum(q for q, _ in chunks[: i + 1]) for i in range(len(chunks))], dtype=torch.int32)
    seq_lens = torch.tensor([s for _, s in chunks], dtype=torch.int32)
    return query, k_cache, v_cache, tables, starts, seq_lens, torch.cat(keys), torch.cat(values)


@needs_bf16_prefill
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_prefill_kernel_matches_reference_as_closely_as_sdpa(group, head_dim):
    """Fresh prompts (1 row, block edges, a few hundred) and chunks over a cached prefix
    (odd and even context lengths), in one call: within bf16 tolerance of the fp32
    reference, and no further from it than torch's own bf16 SDPA."""
    chunks = [(1, 1), (15, 15), (16, 16), (17, 17), (300, 300), (1, 40), (33, 100), (64, 257), (7, 333)]
    query, kc, vc, tables, starts, seq_lens, key, value = prefill_case(group, head_dim, chunks, seed=group + head_dim)
    scale = head_dim**-0.5
    q_lens, s_lens = [q for q, _ in chunks], [s for _, s in chunks]
    got = kernels.paged_prefill_attention(query, kc, vc, tables, starts, seq_lens, scale)
    ref_tables = tables.clamp(min=0)
    want = reference.varlen_attention(query.float(), key.float(), value.float(), kc.float(), vc.float(),
                                      ref_tables, q_lens, s_lens, scale)
    sdpa = reference.varlen_attention(query, key, value, kc, vc, ref_tables, q_lens, s_lens, scale)
    assert got.dtype == torch.bfloat16 and got.shape == query.shape
    torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])
    err, sdpa_err = (got.float() - want).abs(), (sdpa.float() - want).abs()
    assert err.mean() <= 1.1 * sdpa_err.mean() and err.max() <= 1.5 * sdpa_err.max()


@needs_bf16_prefill
@pytest.mark.parametrize("amx", [False, True])
def test_prefill_kernel_over_an_fp8_cache(amx):
    """An fp8 e4m3 cache is widened to bf16 as the kernel copies a context (exactly), so the
    kernel gives the bits it gives over a bf16 cache of the same values (V scale 1); with a
    V scale, within bf16 tolerance of the reference on the same bytes."""
    ops = build.load()
    if amx and not ops.decode_amx_supported():
        pytest.skip("no AMX tiles here")
    chunks = [(1, 1), (17, 17), (300, 300), (33, 100), (7, 333)]
    query, kc, vc, tables, starts, seq_lens, _, _ = prefill_case(4, 64, chunks, seed=8)
    k8, v8 = quantize_kv(kc.float() * 3, 0.5), quantize_kv(vc.float(), 0.25)
    scale = 64**-0.5
    before = ops.set_prefill_amx(amx)
    try:
        got = kernels.paged_prefill_attention(query, k8, v8, tables, starts, seq_lens, scale * 0.5)
        same = kernels.paged_prefill_attention(query, k8.bfloat16(), v8.bfloat16(), tables, starts, seq_lens,
                                               scale * 0.5)
        assert torch.equal(got, same)
        got = kernels.paged_prefill_attention(query, k8, v8, tables, starts, seq_lens, scale * 0.5, v_scale=0.25)
    finally:
        ops.set_prefill_amx(before)
    rows = [(tables[i, pos // 16].long(), pos % 16) for i, (q, n) in enumerate(chunks)
            for pos in [torch.arange(n - q, n)]]  # each chunk's own rows, as stored
    key = torch.cat([k8[b, t].float() * 0.5 for b, t in rows])
    value = torch.cat([v8[b, t].float() * 0.25 for b, t in rows])
    want = reference.varlen_attention(query.float(), key, value, k8, v8, tables.clamp(min=0),
                                      [q for q, _ in chunks], [n for _, n in chunks], scale, (0.5, 0.25))
    torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])


@needs_bf16_prefill
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_kernel_sliding_window_and_soft_cap(group):
    """Each row sees its own last `window` keys: fresh prompts longer than the window and
    chunks over a cached context whose first blocks lie before every row's window (their
    ids poisoned: the kernel must not read them); with and without a soft cap; against the
    fp32 reference with the same window and cap."""
    bs = 16
    chunks = [(1, 1), (17, 17), (300, 300), (1, 40), (33, 100), (64, 257), (7, 333)]
    query, kc, vc, tables, starts, seq_lens, key, value = prefill_case(group, 64, chunks, seed=group)
    query = (query.float() * 4).bfloat16()
    scale = 64**-0.5
    q_lens, s_lens = [q for q, _ in chunks], [s for _, s in chunks]
    for window, softcap in ((1, None), (24, None), (64, 5.0), (None, 5.0)):
        poisoned = tables.clone()
        if window:
            for i, (q, s_len) in enumerate(chunks):
                poisoned[i, : max(0, s_len - q - window + 1) // bs] = -1
        got = kernels.paged_prefill_attention(query, kc, vc, poisoned, starts, seq_lens, scale, window=window,
                                              softcap=softcap)
        want = reference.varlen_attention(query.float(), key.float(), value.float(), kc.float(), vc.float(),
                                          poisoned.clamp(min=0), q_lens, s_lens, scale, window=window,
                                          softcap=softcap)
        full = reference.varlen_attention(query.float(), key.float(), value.float(), kc.float(), vc.float(),
                                          tables.clamp(min=0), q_lens, s_lens, scale)
        torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])
        assert (want - full).abs().max() > 0.1


@needs_bf16_prefill
def test_prefill_kernel_is_bitwise_independent_of_threads():
    case = prefill_case(4, 64, [(50, 50), (20, 90), (1, 17)], num_kv_heads=4)[:6]
    outs = outputs_over_threads(lambda: kernels.paged_prefill_attention(*case, scale=0.125), (1, 3))
    assert torch.equal(outs[0], outs[1])


@needs_bf16_prefill
def test_prefill_kernel_rejects_bad_input():
    query, kc, vc, tables, starts, seq_lens, _, _ = prefill_case(2, 64, [(10, 40), (5, 5)])
    bad = tables.clone()
    bad[0, 1] = kc.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.paged_prefill_attention(query, kc, vc, bad, starts, seq_lens, 0.125)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        kernels.paged_prefill_attention(query, kc, vc, tables, starts, seq_lens * 0 + 4, 0.125)
    with pytest.raises(RuntimeError, match="query_start must run from 0"):
        kernels.paged_prefill_attention(query, kc, vc, tables, starts + 1, seq_lens, 0.125)
    with pytest.raises(RuntimeError, match="takes a bf16 query over a bf16 or float8_e4m3fn cache"):
        kernels.paged_prefill_attention(query.float(), kc.float(), vc.float(), tables, starts, seq_lens, 0.125)


@needs_bf16_prefill
def test_backend_prefill_uses_the_kernel_for_bf16_only(monkeypatch):
    """bf16 prefill goes to the kernel, fp32 stays on torch's SDPA (transformers' own
    attention), and TANDEM_CPU_PREFILL_KERNEL=0 sends bf16 back to SDPA too."""
    calls = []
    real = kernels.paged_prefill_attention
    monkeypatch.setattr(kernels, "paged_prefill_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    query, kc, vc, tables, starts, seq_lens, key, value = prefill_case(4, 64, [(20, 20), (6, 30)])
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64), num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int32), decode_seq_lens=torch.zeros(0, dtype=torch.int32),
        decode_max_seq_len=0, prefill_block_tables=tables.clamp(min=0), prefill_query_lens=[20, 6],
        prefill_seq_lens=[20, 30], prefill_query_start_loc=starts, prefill_seq_lens_tensor=seq_lens)
    backend = CpuAttention()
    assert backend.prefill_tensors
    got = backend.prefill(query, key, value, kc, vc, meta, 0.125)
    assert calls == [1]
    want = reference.varlen_attention(query, key, value, kc, vc, meta.prefill_block_tables, [20, 6], [20, 30], 0.125)
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.bfloat16])
    backend.prefill(query.float(), key.float(), value.float(), kc.float(), vc.float(), meta, 0.125)
    assert calls == [1]
    monkeypatch.setenv("TANDEM_CPU_PREFILL_KERNEL", "0")
    off = CpuAttention()
    assert not off.prefill_tensors
    off.prefill(query, key, value, kc, vc, meta, 0.125)
    assert calls == [1]


@needs_bf16_prefill
@pytest.mark.parametrize("head_dim", [64, 128])
def test_long_prompt_chunks_go_to_sdpa_where_switched_on(monkeypatch, head_dim):
    """With TANDEM_CPU_AMX_PREFILL_SDPA on, chunks of 64+ tokens take SDPA: fresh ones (a
    run of two of one length, then others) on their own keys and values, one over a
    cached context (70 of 150) on its gathered context; the shorter ones (fresh or not)
    the paged kernel, one call each. The whole step matches the reference, SDPA's rows to
    the bit. Off: one kernel call for all. Auto is off (the kernel multiplies on AMX
    tiles where the CPU has them)."""
    calls = []
    real = kernels.paged_prefill_attention
    monkeypatch.setattr(kernels, "paged_prefill_attention",
                        lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    chunks = [(64, 64), (64, 64), (100, 100), (6, 30), (20, 20), (70, 70), (40, 90), (70, 150)]
    query, kc, vc, tables, starts, seq_lens, key, value = prefill_case(4, head_dim, chunks)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64), num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int32), decode_seq_lens=torch.zeros(0, dtype=torch.int32),
        decode_max_seq_len=0, prefill_block_tables=tables.clamp(min=0), prefill_query_lens=[q for q, _ in chunks],
        prefill_seq_lens=[s for _, s in chunks], prefill_query_start_loc=starts, prefill_seq_lens_tensor=seq_lens)
    want = reference.varlen_attention(query, key, value, kc, vc, meta.prefill_block_tables,
                                      meta.prefill_query_lens, meta.prefill_seq_lens, 0.125)
    monkeypatch.setenv("TANDEM_CPU_AMX_PREFILL_SDPA", "1")
    on = CpuAttention()
    assert on.long_chunks_sdpa
    got = on.prefill(query, key, value, kc, vc, meta, 0.125)
    assert calls == [6, 20, 40]
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.bfloat16])
    long = [0, 1, 2, 5, 7]  # SDPA's rows equal the reference's (SDPA per sequence) to the bit
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in long])
    assert torch.equal(got[rows], want[rows])
    monkeypatch.setenv("TANDEM_CPU_AMX_PREFILL_SDPA", "0")
    calls.clear()
    off = CpuAttention()
    assert not off.long_chunks_sdpa
    torch.testing.assert_close(off.prefill(query, key, value, kc, vc, meta, 0.125).float(), want.float(),
                               **TOL[torch.bfloat16])
    assert calls == [query.shape[0]]
    monkeypatch.delenv("TANDEM_CPU_AMX_PREFILL_SDPA")
    assert not CpuAttention().long_chunks_sdpa
    monkeypatch.setenv("TANDEM_CPU_AMX_PREFILL_SDPA", "sometimes")
    with pytest.raises(ValueError, match="TANDEM_CPU_AMX_PREFILL_SDPA"):
        CpuAttention()


def test_get_backend_picks_cpu_on_cpu():
    assert get_backend("auto", torch.device("cpu")).name == "cpu"
    assert get_backend("cpu", torch.device("cpu")).name == "cpu"
    assert get_backend("torch", torch.device("cpu")).name == "torch"


def test_auto_falls_back_to_torch_when_the_build_fails(monkeypatch, caplog):
    def broken():
        raise build.KernelBuildError("no compiler")

    monkeypatch.setattr(build, "load", broken)
    with caplog.at_level("WARNING", logger="engine.attention"):
        assert get_backend("auto", torch.device("cpu")).name == "torch"
    assert [r.message for r in caplog.records if "no compiler" in r.message]
    with pytest.raises(RuntimeError, match="use auto or torch"):
        get_backend("cpu", torch.device("cpu"))


def test_load_or_none_falls_back_with_one_warning(monkeypatch, caplog):
    failure = build.KernelBuildError("no compiler")
    monkeypatch.setattr(build, "_load_once", lambda name=None: (None, failure))
    with caplog.at_level("WARNING", logger=build.__name__):
        assert build.load_or_none() is None and build.load_or_none() is None
    assert len([r for r in caplog.records if "no compiler" in r.message]) == 1


def _bf16_case(group, head_dim, block_size, lens, seed, num_kv_heads=2):
    return make_case(group, head_dim, block_size, torch.bfloat16, lens, seed=seed, num_kv_heads=num_kv_heads)


@pytest.mark.parametrize("block_size", [8, 16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_bf16_pairs_match_reference_and_the_fp32_product(kernel_build, group, head_dim, block_size):
    """bf16 pass 2 on the dot-product instruction (p rounded to bf16): within bf16
    tolerance of the fp32 reference, and next to the kernel's own fp32 product; odd
    and even lengths, so blocks end on a lone token."""
    g = torch.Generator().manual_seed(group * 100 + head_dim + block_size)
    lens = ragged_lens(block_size, 24, g) + [1, 2, 3, block_size - 1, block_size + 1]
    case = _bf16_case(group, head_dim, block_size, lens, seed=5)
    scale = head_dim ** -0.5
    pairs = kernels.paged_decode_attention(*case, scale=scale)
    plain = kernels.paged_decode_attention(*case, scale=scale, bf16_pairs=False)
    _, want = run_both(*case)
    assert pairs.dtype == torch.bfloat16
    torch.testing.assert_close(pairs.float(), want, **TOL[torch.bfloat16])
    torch.testing.assert_close(pairs.float(), plain.float(), **TOL[torch.bfloat16])
    # the two products are different paths where the build has AVX512-BF16's dot product;
    # elsewhere the switch has nothing to choose
    assert torch.equal(pairs, plain) == (build.load().small_batch_linear_kernel() != "avx512_bf16")


@pytest.mark.usefixtures("kernel_build")
def test_decode_bf16_many_sequences_same_bits_as_one_at_a_time():
    """Enough sequences that each thread claims its next item ahead and fetches its K
    while computing the current one (paged_attention.cpp, Prefetcher): the output is
    the reference's, and bit for bit what each sequence gets alone (no claim ahead, no
    prefetch) and what one thread gets. Small's shape: 16 heads on 4 kv heads, D = 64,
    blocks of 64, garbage block ids past each context."""
    g = torch.Generator().manual_seed(11)
    lens = ragged_lens(64, 80, g) + [257, 320, 384, 1, 2]
    case = _bf16_case(4, 64, 64, lens, seed=9, num_kv_heads=4)
    query, k_cache, v_cache, tables, seq_lens = case
    scale = 64 ** -0.5
    many = outputs_over_threads(lambda: kernels.paged_decode_attention(*case, scale=scale), [2, 1])
    alone = torch.cat([kernels.paged_decode_attention(query[i:i + 1], k_cache, v_cache, tables[i:i + 1],
                                                      seq_lens[i:i + 1], scale=scale) for i in range(len(lens))])
    _, want = run_both(*case)
    torch.testing.assert_close(many[0].float(), want, **TOL[torch.bfloat16])
    assert torch.equal(many[0], alone) and torch.equal(many[0], many[1])


@pytest.mark.usefixtures("kernel_build")
def test_decode_bf16_pairs_never_read_past_a_sequence():
    """Cache slots past each sequence's length hold NaN (what a reused block may hold):
    a lone last token pairs with zeros, not with the slot after it."""
    _assert_nothing_read_past_the_end([1, 3, 15, 17, 31, 33], block_size=16, num_kv_heads=2)


@pytest.mark.parametrize("amx", [False, True])
def test_decode_bf16_nan_output_is_written_as_torch_writes_it(amx, compiled):
    """A NaN inside a sequence's V reaches its heads' outputs; the bf16 store writes it
    as c10::BFloat16 does (0x7fc0), where the 16-wide conversion instruction would keep
    the NaN's sign and payload. The other sequences' outputs stay finite."""
    if amx and not compiled.decode_amx_supported():
        pytest.skip("this CPU (or build, or kernel) has no AMX tiles")
    query, k_cache, v_cache, tables, seq_lens = _bf16_case(4, 64, 32, [5, 40, 70], seed=3, num_kv_heads=4)
    # sequence 1, token 2, kv head 0: a negative NaN with a payload (0xffa1)
    v_cache.view(torch.int16)[int(tables[1, 0]), 2, 0] = 0xFFA1 - 0x10000
    before = compiled.set_decode_amx(amx)
    try:
        got = kernels.paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, 0.125)
    finally:
        compiled.set_decode_amx(before)
    bits = got.view(torch.int16)
    assert torch.isnan(got[1, :4].float()).all()
    assert (bits[1, :4] == 0x7FC0).all()
    assert torch.isfinite(got[1, 4:].float()).all() and torch.isfinite(got[[0, 2]].float()).all()


def _assert_nothing_read_past_the_end(lens, block_size, num_kv_heads):
    """Poisons every cache slot past each sequence's end with NaN: the output must not move."""
    query, k_cache, v_cache, tables, seq_lens = _bf16_case(4, 64, block_size, lens, seed=9,
                                                           num_kv_heads=num_kv_heads)
    clean = kernels.paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, 0.125)
    for b, n in enumerate(lens):
        for t in range(n, tables.shape[1] * block_size):
            block = int(tables[b, t // block_size])
            if block >= 0:
                k_cache[block, t % block_size] = float("nan")
                v_cache[block, t % block_size] = float("nan")
    got = kernels.paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, 0.125)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got, clean)


def test_decode_bf16_pairs_are_bitwise_independent_of_threads_and_split():
    """1 thread vs several, whole rows vs split kv heads: same arithmetic per head."""
    g = torch.Generator().manual_seed(12)
    case = _bf16_case(4, 64, 16, ragged_lens(16, 4, g), seed=4, num_kv_heads=8)
    outs = outputs_over_threads(lambda: kernels.paged_decode_attention(*case, scale=0.125), (1, 4))
    assert torch.equal(outs[0], outs[1])


needs_amx = pytest.mark.skipif(not build.load().decode_amx_supported(),
                               reason="this CPU (or build, or kernel) has no AMX tiles")


@pytest.fixture
def amx_switch(compiled):
    """Sets the kernels' process-wide AMX switch for one test and restores it after."""
    before = compiled.set_decode_amx(True)
    yield compiled.set_decode_amx
    compiled.set_decode_amx(before)


@needs_amx
@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [4, 8, 16])
def test_decode_amx_matches_reference_and_the_avx512_path(amx_switch, group, head_dim, block_size):
    """bf16 decode on AMX tiles: within bf16 tolerance of the fp32 reference and of the
    AVX512-BF16 path, at lengths that end mid-tile, mid-pair and on block boundaries."""
    g = torch.Generator().manual_seed(group * 10 + head_dim + block_size)
    lens = ragged_lens(block_size, 24, g) + [1, 2, 3, 15, 16, 17, 31, 33]
    case = _bf16_case(group, head_dim, block_size, lens, seed=7, num_kv_heads=4)
    scale = head_dim ** -0.5
    amx_switch(True)
    tiles = kernels.paged_decode_attention(*case, scale=scale)
    amx_switch(False)
    vectors = kernels.paged_decode_attention(*case, scale=scale)
    _, want = run_both(*case)
    torch.testing.assert_close(tiles.float(), want, **TOL[torch.bfloat16])
    torch.testing.assert_close(tiles.float(), vectors.float(), **TOL[torch.bfloat16])
    assert not torch.equal(tiles, vectors)  # the switch does change the path


@needs_amx
@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("head_dim,group", [(64, 4), (128, 8), (64, 16)])
def test_decode_amx_over_an_fp8_cache(amx_switch, head_dim, group, block_size):
    """An fp8 cache on AMX tiles: its rows widened to bf16 as the tiles load them (exact),
    the K scale in the softmax scale and the V scale on the output; within bf16
    tolerance of the reference on the rounded values and of the vector path's fp32
    arithmetic, at lengths that end mid-tile, mid-pair and on block boundaries."""
    g = torch.Generator().manual_seed(head_dim + group + block_size)
    lens = ragged_lens(block_size, 16, g) + [1, 2, 15, 16, 17, 31, 33]
    query, k, v, tables, lens_t = make_case(group, head_dim, block_size, torch.float32, lens, seed=9,
                                            num_kv_heads=4)
    k[0, :3] = torch.tensor([1e-3, -2.5e-3, 1e4])[:, None, None]  # subnormal in e4m3, and saturating
    kv_scales = (0.5, 0.25)
    k8, v8 = quantize_kv(k * 4, kv_scales[0]), quantize_kv(v, kv_scales[1])
    scale = head_dim**-0.5
    args = (query.bfloat16(), k8, v8, tables, lens_t, scale * kv_scales[0])
    amx_switch(True)
    tiles = kernels.paged_decode_attention(*args, v_scale=kv_scales[1])
    amx_switch(False)
    vectors = kernels.paged_decode_attention(*args, v_scale=kv_scales[1])
    want = reference.paged_decode_attention(query.bfloat16().float(), k8, v8, tables.clamp(min=0), lens_t, scale,
                                            None, kv_scales)
    torch.testing.assert_close(tiles.float(), want, **TOL[torch.bfloat16])
    torch.testing.assert_close(tiles.float(), vectors.float(), **TOL[torch.bfloat16])
    assert not torch.equal(tiles, vectors)  # the switch does change the path


@needs_amx
def test_decode_amx_never_reads_past_a_sequence(amx_switch):
    """NaN in every cache slot past each sequence's length (K and V): the partial last
    tile of K reads the block's rows past the end, whose scores are never used, and V
    rows past the end enter as zeros."""
    _assert_nothing_read_past_the_end([1, 3, 15, 16, 17, 31, 33, 63, 64, 65], block_size=32, num_kv_heads=4)


@needs_amx
def test_decode_amx_is_bitwise_independent_of_threads_and_split(amx_switch):
    """1 thread vs several, whole rows vs split kv heads (16 query heads an item at
    most on tiles): each head's arithmetic is the same."""
    g = torch.Generator().manual_seed(13)
    case = _bf16_case(4, 64, 64, ragged_lens(64, 4, g), seed=4, num_kv_heads=8)
    outs = outputs_over_threads(lambda: kernels.paged_decode_attention(*case, scale=0.125), (1, 4))
    assert torch.equal(outs[0], outs[1])


def test_backend_sets_the_amx_switch_from_the_environment(monkeypatch, amx_switch):
    monkeypatch.setenv("TANDEM_CPU_AMX_ATTENTION", "0")
    CpuAttention()
    assert amx_switch(True) is False
    monkeypatch.delenv("TANDEM_CPU_AMX_ATTENTION")
    CpuAttention()
    assert amx_switch(True) is True


@needs_amx
@pytest.mark.parametrize("group", [1, 2])
def test_decode_amx_leaves_small_groups_on_avx512(amx_switch, group):
    """Fewer than 4 query heads per kv head stay on AVX512-BF16 (faster there): the
    switch changes nothing, bit for bit."""
    g = torch.Generator().manual_seed(group)
    case = _bf16_case(group, 64, 64, ragged_lens(64, 12, g), seed=3, num_kv_heads=2)
    amx_switch(True)
    on = kernels.paged_decode_attention(*case, scale=0.125)
    amx_switch(False)
    off = kernels.paged_decode_attention(*case, scale=0.125)
    assert torch.equal(on, off)


@pytest.fixture
def prefill_amx_switch(compiled):
    """Sets the kernels' process-wide prefill AMX switch for one test and restores it."""
    before = compiled.set_prefill_amx(True)
    yield compiled.set_prefill_amx
    compiled.set_prefill_amx(before)


def _prefill_both_ways(switch, case, scale):
    switch(True)
    tiles = kernels.paged_prefill_attention(*case, scale=scale)
    switch(False)
    vectors = kernels.paged_prefill_attention(*case, scale=scale)
    return tiles, vectors


@needs_bf16_prefill
@needs_amx
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_amx_matches_reference_and_the_avx512_path(prefill_amx_switch, group, head_dim):
    """bf16 prefill on AMX tiles (16 query rows of a head at a time): within bf16
    tolerance of the fp32 reference and of the AVX512-BF16 path, for fresh prompts that
    end inside, on and past a 16-row block and a 32-key block, and chunks over a cached
    prefix, in one call."""
    chunks = [(1, 1), (15, 15), (16, 16), (17, 17), (33, 33), (300, 300), (1, 40), (33, 100), (64, 257), (7, 333)]
    query, kc, vc, tables, starts, seq_lens, key, value = prefill_case(group, head_dim, chunks, seed=group * head_dim)
    scale = head_dim**-0.5
    tiles, vectors = _prefill_both_ways(prefill_amx_switch, (query, kc, vc, tables, starts, seq_lens), scale)
    want = reference.varlen_attention(query.float(), key.float(), value.float(), kc.float(), vc.float(),
                                      tables.clamp(min=0), [q for q, _ in chunks], [s for _, s in chunks], scale)
    torch.testing.assert_close(tiles.float(), want, **TOL[torch.bfloat16])
    torch.testing.assert_close(tiles.float(), vectors.float(), **TOL[torch.bfloat16])
    assert not torch.equal(tiles, vectors)  # the switch does change the path


@needs_bf16_prefill
@needs_amx
def test_prefill_amx_never_reads_past_a_sequence(prefill_amx_switch):
    """NaN in every cache slot past each sequence's length (K and V): outputs finite and
    unchanged (the padded keys and values are zeros, never the cache's slots)."""
    chunks = [(17, 17), (5, 40), (33, 70)]
    query, kc, vc, tables, starts, seq_lens, _, _ = prefill_case(4, 64, chunks, num_kv_heads=2, seed=5)
    prefill_amx_switch(True)
    clean = kernels.paged_prefill_attention(query, kc, vc, tables, starts, seq_lens, 0.125)
    for b, (_, s_len) in enumerate(chunks):
        for t in range(s_len, tables.shape[1] * kc.shape[1]):
            block = int(tables[b, t // kc.shape[1]])
            if block >= 0:
                kc[block, t % kc.shape[1]] = float("nan")
                vc[block, t % kc.shape[1]] = float("nan")
    got = kernels.paged_prefill_attention(query, kc, vc, tables, starts, seq_lens, 0.125)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got, clean)


@needs_bf16_prefill
@needs_amx
def test_prefill_amx_is_bitwise_independent_of_threads(prefill_amx_switch):
    case = prefill_case(4, 64, [(50, 50), (20, 90), (1, 17)], num_kv_heads=4)[:6]
    prefill_amx_switch(True)
    outs = outputs_over_threads(lambda: kernels.paged_prefill_attention(*case, scale=0.125), (1, 3))
    assert torch.equal(outs[0], outs[1])
