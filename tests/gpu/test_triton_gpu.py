"""Compiled Triton kernels vs the torch reference on CUDA, at serving-like sizes
(tests/unit/test_triton_kernels.py runs the same checks small, on CPU via the interpreter)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from engine.attention import reference  # noqa: E402
from engine.attention.triton import kernels  # noqa: E402

if kernels.interpreter_ready():
    pytest.skip("TRITON_INTERPRET=1 is set in this process; run GPU tests on their own",
                allow_module_level=True)

DEVICE = torch.device("cuda")
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def make_decode_case(batch, num_heads, num_kv_heads, head_dim, block_size, dtype, max_len, seed=0):
    """Ragged lengths incl. 1 and block boundaries +-1; shuffled, distinct blocks per sequence."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    bs = block_size
    edge = [1, bs - 1, bs, bs + 1, max_len]
    rand = torch.randint(1, max_len + 1, (max(batch - len(edge), 0),), generator=g, device=DEVICE)
    lens = torch.tensor(edge[:batch], device=DEVICE, dtype=torch.int64)
    seq_lens = torch.cat([lens, rand]).to(torch.int32)
    m = (max_len + bs - 1) // bs
    num_blocks = batch * m + 7
    shape = (num_blocks, bs, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g, device=DEVICE).to(dtype)
    v_cache = torch.randn(shape, generator=g, device=DEVICE).to(dtype)
    perm = torch.randperm(num_blocks, generator=g, device=DEVICE)
    block_tables = perm[: batch * m].view(batch, m).to(torch.int32)
    query = torch.randn(batch, num_heads, head_dim, generator=g, device=DEVICE).to(dtype)
    return query, k_cache, v_cache, block_tables, seq_lens


def check_decode(case, max_len, **kw):
    query, k_cache, v_cache, block_tables, seq_lens = case
    scale = query.shape[-1] ** -0.5
    out = kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, max_len, **kw)
    ref = reference.paged_decode_attention(
        query.float(), k_cache.float(), v_cache.float(), block_tables, seq_lens, scale, max_len
    )
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out.float(), ref, **TOL[query.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_matches_reference(group, head_dim, block_size, dtype):
    case = make_decode_case(48, 8 * group, 8, head_dim, block_size, dtype, max_len=1500)
    check_decode(case, 1500)


@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("num_splits", [None, 1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_long_context_splits(num_splits, use_dot, dtype):
    case = make_decode_case(6, 32, 8, 128, 16, dtype, max_len=8192)
    check_decode(case, 8192, num_splits=num_splits, use_dot=use_dot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_dot_path(dtype):
    """fp32 caches use ieee dots (no tf32), so even the dot path keeps fp32 accuracy."""
    case = make_decode_case(16, 16, 4, 128, 16, dtype, max_len=700)
    check_decode(case, 700, use_dot=True)


def test_decode_large_batch_default_dispatch():
    case = make_decode_case(256, 32, 8, 128, 16, torch.bfloat16, max_len=2048)
    check_decode(case, 2048)


@pytest.mark.parametrize(
    "key_dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
     (torch.float16, torch.float16), (torch.float32, torch.bfloat16)],
)
def test_store_kv_matches_reference(key_dtype, cache_dtype):
    t, hkv, d = 3000, 8, 128
    fused = torch.randn(t, 3, hkv, d, device=DEVICE).to(key_dtype)  # strided K/V views
    key, value = fused[:, 1], fused[:, 2]
    k_cache = torch.randn(512, 16, hkv, d, device=DEVICE).to(cache_dtype)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(512 * 16, device=DEVICE)[:t]
    slots[::7] = -1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, k_ref, v_ref, slots)
    kernels.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_decode_is_cuda_graph_capturable():
    query, k_cache, v_cache, block_tables, seq_lens = make_decode_case(
        8, 32, 8, 128, 16, torch.bfloat16, max_len=4096
    )
    run = lambda: kernels.paged_decode_attention(  # noqa: E731
        query, k_cache, v_cache, block_tables, seq_lens, 0.088, 4096, num_splits=8
    )
    expected = run()  # also compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    query.normal_()
    graph.replay()
    torch.testing.assert_close(out, run(), atol=0, rtol=0)
    assert not torch.equal(out, expected)
