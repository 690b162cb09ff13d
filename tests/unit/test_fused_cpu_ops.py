"""The fused CPU operators (engine/cpu_kernels/fused.cpp) against the torch code they
replace in engine/models/llama.py and engine/attention/reference.py: rotary and the KV
store bit for bit; RMSNorm bit for bit in bf16 and fp16 (up to one step in rare
elements) and to fp32 rounding in fp32, where only its sum of squares adds in another
order."""

import pytest
import torch

from engine.attention import reference
from engine.models.llama import RMSNorm, rotate

pytestmark = pytest.mark.unit

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    return (a.view(bits).long() - b.view(bits).long()).abs()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim",
                         [(1, 4, 2, 64), (37, 16, 4, 64), (5, 8, 8, 128), (3, 2, 1, 6)])
def test_rotary_in_place_equals_torch_bitwise(build_ops, dtype, tokens, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(tokens * head_dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)  # strided, as in Attention
    positions = torch.randint(0, 500, (tokens,), generator=g)
    cos, sin = torch.randn(512, head_dim, generator=g), torch.randn(512, head_dim, generator=g)
    want = rotate(qk, cos[positions].to(dtype)[:, None, :], sin[positions].to(dtype)[:, None, :])
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    build_ops.rotary_(qk, positions, cos, sin)
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


def test_rotary_rejects_a_position_outside_the_table(build_ops):
    x = torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="outside the table"):
        build_ops.rotary_(x, torch.tensor([0, 16]), torch.randn(16, 8), torch.randn(16, 8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 256), (33, 1024), (4, 100)])
def test_rms_norm_and_add_rms_norm_match_torch(build_ops, dtype, rows, dim):
    g = torch.Generator().manual_seed(rows + dim)
    norm = RMSNorm(dim, 1e-5).to(dtype)
    norm.weight.data = torch.randn(dim, generator=g).to(dtype)
    x, delta = torch.randn(rows, dim, generator=g).to(dtype), torch.randn(rows, dim, generator=g).to(dtype)

    def close(got, want):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        else:
            apart = steps_apart(got, want)
            assert int(apart.max()) <= 1 and float((apart == 0).float().mean()) >= 0.99

    close(norm(x, build_ops), norm(x))
    r_fused, r_torch = x.clone(), x.clone()
    got, want = norm.add_forward(r_fused, delta, build_ops), norm.add_forward(r_torch, delta)
    assert torch.equal(r_fused, x + delta) and torch.equal(r_torch, x + delta)  # the skip connection, in place
    close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_equals_reference_and_skips_negative_slots(build_ops, dtype):
    g = torch.Generator().manual_seed(3)
    n, bs, hkv, d, t = 6, 4, 2, 16, 9
    qkv = torch.randn(t, (4 + 2 * hkv) * d, generator=g).to(dtype)  # key and value as strided views
    key = qkv[:, 4 * d:(4 + hkv) * d].view(t, hkv, d)
    value = qkv[:, (4 + hkv) * d:].view(t, hkv, d)
    slots = torch.tensor([0, 5, -1, 23, 7, -1, 12, 1, 2])
    caches = [(torch.zeros(n, bs, hkv, d, dtype=dtype), torch.zeros(n, bs, hkv, d, dtype=dtype)) for _ in range(2)]
    build_ops.store_kv(*caches[0], key, value, slots)
    reference.store_kv(key, value, *caches[1], slots)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    with pytest.raises(RuntimeError, match="outside the cache"):
        build_ops.store_kv(*caches[0], key, value, torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, n * bs]))


def test_bind_threads_puts_each_thread_of_the_callers_team_on_its_core(build_ops):
    """Run on a thread of its own: binding pins the calling thread too."""
    import os
    import threading

    cores = sorted(os.sched_getaffinity(0))
    got: list = []

    def bind():
        torch.set_num_threads(min(2, len(cores)))
        want = cores[: torch.get_num_threads()][::-1]
        got.extend([want, build_ops.bind_threads(want), sorted(os.sched_getaffinity(0))])

    before = torch.get_num_threads()
    t = threading.Thread(target=bind)
    t.start()
    t.join(10)
    torch.set_num_threads(before)
    want, bound, own = got
    assert bound == want  # thread i now runs on want[i]
    assert own == [want[0]]  # the caller is thread 0 of its team
    assert sorted(os.sched_getaffinity(0)) == cores  # other threads keep theirs
