"""The Triton varlen paged prefill kernel vs the torch reference, across ragged batches:
whole prompts, chunks after a cached prefix, single tokens, block boundaries, GQA, head
dims 64/128/256 and block sizes 16/32. Without CUDA the kernel runs on CPU tensors under
the Triton interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import reference
from tests import triton_env

pytestmark = pytest.mark.unit

kernels, DEVICE = triton_env.kernels_or_skip()

TOL = triton_env.TOL


def ragged(bs: int) -> list[tuple[int, int]]:
    """(new tokens, context incl. them) per sequence: a whole prompt across a block
    boundary, a prefix hit (whole cached blocks), a chunk after a ragged prefix, one
    token after a long context, a prompt of exactly one block, a single-token prompt."""
    return [(bs + 3, bs + 3), (5, 2 * bs + 5), (bs + 1, 3 * bs - 2), (1, 2 * bs + 7), (bs, bs), (1, 1)]


def make_case(lens, group, head_dim, block_size, dtype, num_kv_heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, bs = len(lens), block_size
    m = max(-(-s // bs) for _, s in lens) + 1  # one table entry past every context: never read
    num_blocks = b * m + 3
    shape = (num_blocks, bs, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: b * m].view(b, m).to(torch.int32)
    t = sum(q for q, _ in lens)
    query = torch.randn(t, group * num_kv_heads, head_dim, generator=g).to(dtype)
    key = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
    slots = []
    for i, (q, s) in enumerate(lens):
        slots += [int(tables[i, p // bs]) * bs + p % bs for p in range(s - q, s)]
    reference.store_kv(key, value, k_cache, v_cache, torch.tensor(slots))
    starts = torch.tensor([0] + [q for q, _ in lens]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in lens], dtype=torch.int32)
    return [x.to(DEVICE) for x in (query, key, value, k_cache, v_cache, tables, starts, seq_lens)]


def check(lens, group, head_dim, block_size, dtype, **kw):
    query, key, value, k_cache, v_cache, tables, starts, seq_lens = make_case(lens, group, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = kernels.varlen_prefill_attention(query, k_cache, v_cache, tables, starts, seq_lens, scale,
                                           max(q for q, _ in lens), **kw)
    f = torch.float32
    ref = reference.varlen_attention(query.to(f), key.to(f), value.to(f), k_cache.to(f), v_cache.to(f), tables,
                                     [q for q, _ in lens], [s for _, s in lens], scale, window=kw.get("window"),
                                     softcap=kw.get("softcap"))
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_fp32_matches_reference(group, head_dim, block_size):
    check(ragged(block_size), group, head_dim, block_size, torch.float32)


@pytest.mark.parametrize("group", [2, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_half_precision(dtype, group):
    # the interpreter's tl.dot takes bf16 as raw integers, so bf16 runs the broadcast path here
    check(ragged(16), group, 128, 16, dtype)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 32), (16, 64)])
def test_prefill_tiles_that_span_pages_and_rows(block_m, block_n):
    """Key tiles longer than a page (each key finds its own block) and several query tiles."""
    lens = [(40, 40), (37, 70), (3, 33), (64, 64)]
    check(lens, 2, 64, 16, torch.float32, block_m=block_m, block_n=block_n)


def test_prefill_broadcast_path_fp32():
    check(ragged(16), 4, 64, 16, torch.float32, use_dot=False)


def test_prefill_odd_head_dim():
    check(ragged(16), 3, 80, 16, torch.float32, use_dot=False)


def test_prefill_rejects_bad_inputs():
    query, _, _, k_cache, v_cache, tables, starts, seq_lens = make_case(ragged(16), 1, 64, 16, torch.float32)
    with pytest.raises(AssertionError, match="int32"):
        kernels.varlen_prefill_attention(query, k_cache, v_cache, tables.long(), starts, seq_lens, 1.0, 19)
    with pytest.raises(AssertionError, match="query_start_loc"):
        kernels.varlen_prefill_attention(query, k_cache, v_cache, tables, starts[:-1], seq_lens, 1.0, 19)
    with pytest.raises(AssertionError, match="dtype"):
        kernels.varlen_prefill_attention(query.half(), k_cache, v_cache, tables, starts, seq_lens, 1.0, 19)


@pytest.mark.parametrize("window", [1, 7, 40])
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (16, 32)])
def test_prefill_sliding_window(window, block_m, block_n):
    """Each query row sees the keys after its position - window: key tiles before a
    query tile's first visible key are skipped, and rows of a tile whose window starts
    in a later key tile stay at zero weight until then (no NaN)."""
    check(ragged(16) + [(40, 90)], 2, 64, 16, torch.float32, block_m=block_m, block_n=block_n, window=window)


@pytest.mark.parametrize("window", [None, 7])
def test_prefill_soft_capped_scores(window):
    check(ragged(16), 2, 64, 16, torch.float32, window=window, softcap=0.5)
