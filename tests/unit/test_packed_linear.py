"""oneDNN pre-packed bf16 linear layers give the same bits as F.linear, and an engine
with them gives the same greedy tokens as one without (engine/models/packed.py). The
small-batch kernel (engine/cpu_kernels/linear.cpp) for steps of one to four tokens rounds
the same fp32 sums, added in another order, so it may differ from F.linear by one bf16
step in rare outputs, and never by more."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.models.packed import (
    SMALL_BATCH_ROWS,
    PackedLinear,
    can_pack,
    keep_plain_copies,
    pack_linears,
    small_batch_ops,
)

pytestmark = pytest.mark.unit

needs_bf16 = pytest.mark.skipif(
    not can_pack(nn.Linear(2, 2).bfloat16(), torch.device("cpu")),
    reason="this CPU or PyTorch build has no native oneDNN bf16",
)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 16, 77])
@pytest.mark.parametrize("shape,bias", [((384, 256), False), ((256, 704), True), ((16000, 256), False)])
def test_packed_linear_equals_f_linear_bitwise(rows, shape, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(*shape, generator=g).bfloat16()
    b = torch.randn(shape[0], generator=g).bfloat16() if bias else None
    x = torch.randn(rows, shape[1], generator=g).bfloat16()
    assert torch.equal(PackedLinear(w, b)(x), F.linear(x, w, b))


@needs_bf16
def test_pack_linears_swaps_every_linear_and_a_tied_head():
    model = nn.Module()
    model.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False))).bfloat16()
    head = torch.randn(32, 4).bfloat16()
    x = torch.randn(2, 8).bfloat16()
    before = model.body(x)
    assert pack_linears(model, head_weight=head) == 3
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert torch.equal(model.body(x), before)
    assert torch.equal(model.lm_head(before), F.linear(before, head))


def test_not_packed_off_cpu_bf16_or_when_disabled(monkeypatch):
    assert not can_pack(nn.Linear(2, 2), torch.device("cpu"))  # fp32 stays on F.linear
    monkeypatch.setenv("TANDEM_CPU_PACKED_WEIGHTS", "0")
    assert not can_pack(nn.Linear(2, 2).bfloat16(), torch.device("cpu"))


needs_small_batch = pytest.mark.skipif(small_batch_ops() is None, reason="no AVX512-BF16 build of the cpu kernels here")


def bf16_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable bf16 values lie between a and b, elementwise (same signs)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return (ia - ib).abs()


@needs_bf16
@needs_small_batch
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("shape,bias", [((384, 256), False), ((101, 1000), True), ((7, 37), True),
                                        ((16000, 256), False), ((1024, 2816), False), ((200, 512), True)])
def test_small_batch_kernel_matches_f_linear_to_one_bf16_step(rows, shape, bias):
    """Within one bf16 step of F.linear wherever the sum is not cancelled to near zero,
    and within bf16 rounding of an fp32 reference everywhere. Both are fp32 sums in
    different orders, which typically differ by about sqrt(K) fp32 steps of the terms'
    magnitudes: for an output far below its terms (cancelled) that can be many bf16 steps
    of the small result, so the one-step check keeps the outputs at least 64x that size."""
    g = torch.Generator().manual_seed(rows * 7 + shape[1])
    w = torch.randn(*shape, generator=g).bfloat16()
    b = torch.randn(shape[0], generator=g).bfloat16() if bias else None
    x = torch.randn(rows, shape[1], generator=g).bfloat16()
    lin = PackedLinear(w, b, small_batch_ops(), keep_plain=True)
    assert lin.plain is not None and rows <= SMALL_BATCH_ROWS
    got, want = lin(x), F.linear(x, w, b)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    terms = F.linear(x.float().abs(), w.float().abs(), None if b is None else b.float().abs())
    kept = ref.abs() >= 64 * shape[1] ** 0.5 * 2.0**-24 * terms
    assert float(kept.float().mean()) >= 0.9
    assert bool((torch.sign(got) == torch.sign(want))[kept].all())
    apart = bf16_steps_apart(got, want)
    assert int(apart[kept].max()) <= 1
    assert float((apart == 0).float().mean()) >= 0.99
    # and against the fp32 reference, within bf16's rounding of the result
    torch.testing.assert_close(got.float(), ref, rtol=8e-3, atol=1e-2)


@needs_bf16
@needs_small_batch
def test_small_batch_kernel_is_used_up_to_four_rows_and_onednn_from_five(monkeypatch):
    w = torch.randn(64, 96).bfloat16()
    lin = PackedLinear(w, None, small_batch_ops(), keep_plain=True)
    calls = []
    real = lin._small
    monkeypatch.setattr(lin, "_small", lambda *a: (calls.append(a[1].shape[0]), real(*a))[1])
    for rows in (1, 2, 3, 4, 5, 8):
        lin(torch.randn(rows, 96).bfloat16())
    assert calls == [1, 2, 3, 4]


@needs_bf16
@needs_small_batch
@pytest.mark.parametrize("shape", [(1024, 2816), (2816, 1024), (37, 300), (16000, 256)])
def test_small_batch_kernel_gives_a_row_the_same_bits_whatever_rows_share_its_pass(shape):
    """A row's sums run in one order however many rows of x share the pass over W (one
    to four, and past four in further passes): a decode token's result does not depend
    on the streams batched with it. Shapes with groups of 16 rows, a tail of single
    rows, and a width that is not a multiple of 32."""
    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(*shape, generator=g).bfloat16()
    b = torch.randn(shape[0], generator=g).bfloat16()
    x = torch.randn(7, shape[1], generator=g).bfloat16()
    small = small_batch_ops().small_batch_linear

    def linear(rows):
        y = torch.empty(rows.shape[0], shape[0], dtype=torch.bfloat16)
        small(y, rows.contiguous(), w, b)
        return y

    alone = torch.cat([linear(x[i:i + 1]) for i in range(7)])
    for m in (2, 3, 4, 7):
        assert torch.equal(linear(x[:m]), alone[:m]), m
    assert torch.equal(linear(x[3:7]), alone[3:7])


@needs_bf16
def test_plain_copies_kept_by_memory_rule(monkeypatch):
    from engine import envs

    monkeypatch.setattr(envs, "physical_memory_bytes", lambda: 8 * 2**30)
    assert keep_plain_copies(2**30) and not keep_plain_copies(2**30 + 1)
    monkeypatch.setenv("TANDEM_CPU_SMALL_BATCH_LINEAR", "1")
    assert keep_plain_copies(2**40)
    monkeypatch.setenv("TANDEM_CPU_SMALL_BATCH_LINEAR", "0")
    assert not keep_plain_copies(1)
    model = nn.Sequential(nn.Linear(8, 8)).bfloat16()
    pack_linears(model)
    assert model[0].plain is None
    monkeypatch.setenv("TANDEM_CPU_SMALL_BATCH_LINEAR", "1")
    model = nn.Sequential(nn.Linear(8, 8)).bfloat16()
    pack_linears(model, small_batch=False)  # a prefill worker
    assert model[0].plain is None
    monkeypatch.setenv("TANDEM_CPU_SMALL_BATCH_LINEAR", "maybe")
    with pytest.raises(ValueError, match="auto, 1 or 0"):
        keep_plain_copies(1)
