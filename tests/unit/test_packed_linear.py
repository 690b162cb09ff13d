"""oneDNN pre-packed bf16 linear layers give the same bits as F.linear, and an engine
with them gives the same greedy tokens as one without (engine/models/packed.py). The
row-major kernel (engine/cpu_kernels/linear.cpp) for steps of one to four tokens rounds
the same fp32 sums, added in another order, so it may differ from F.linear by one bf16
step in rare outputs, and never by more. The tile kernel (AMX, steps of up to 256
tokens) likewise, and gives the bits of oneDNN's own AMX kernels up to 32 rows; in both
kernels a row's result does not depend on the rows beside it."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.models.packed import (
    SMALL_BATCH_ROWS,
    TILE_ROWS,
    PackedLinear,
    can_pack,
    keep_plain_copies,
    pack_linears,
    small_batch_ops,
    tile_kernel_on,
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


needs_small_batch = pytest.mark.skipif(small_batch_ops() is None, reason="no row-major bf16 kernel here")
needs_tiles = pytest.mark.skipif(small_batch_ops() is None or not tile_kernel_on(small_batch_ops()),
                                 reason="no AMX tiles here (build or CPU)")


@pytest.fixture
def row_major(monkeypatch):
    """PackedLinear keeps row-major copies (the row-major kernel) even where AMX is."""
    monkeypatch.setenv("TANDEM_CPU_TILE_LINEAR", "0")


def bf16_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable bf16 values lie between a and b, elementwise (same signs)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return (ia - ib).abs()


@needs_bf16
@needs_small_batch
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("shape,bias", [((384, 256), False), ((101, 1000), True), ((7, 37), True),
                                        ((16000, 256), False), ((1024, 2816), False), ((200, 512), True)])
@pytest.mark.usefixtures("kernel_build")
def test_small_batch_kernel_matches_f_linear_to_one_bf16_step(rows, shape, bias, row_major):
    """Within one bf16 step of F.linear wherever the sum is not cancelled to near zero,
    and within bf16 rounding of an fp32 reference everywhere. Both are fp32 sums in
    different orders, which typically differ by about sqrt(K) fp32 steps of the terms'
    magnitudes: for an output far below its terms (cancelled) that can be many bf16 steps
    of the small result, so the one-step check keeps the outputs at least 64x that size."""
    g = torch.Generator().manual_seed(rows * 7 + shape[1])
    w = torch.randn(*shape, generator=g).bfloat16()
    b = torch.randn(shape[0], generator=g).bfloat16() if bias else None
    x = torch.randn(rows, shape[1], generator=g).bfloat16()
    lin = PackedLinear(w, b, small_batch_ops(), keep_copy=True)
    assert lin.plain is not None and lin.tiles is None and rows <= SMALL_BATCH_ROWS
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
def test_small_batch_kernel_is_used_up_to_four_rows_and_onednn_from_five(monkeypatch, row_major):
    w = torch.randn(64, 96).bfloat16()
    lin = PackedLinear(w, None, small_batch_ops(), keep_copy=True)
    calls = []
    real = lin._small
    monkeypatch.setattr(lin, "_small", lambda *a: (calls.append(a[1].shape[0]), real(*a))[1])
    for rows in (1, 2, 3, 4, 5, 8):
        lin(torch.randn(rows, 96).bfloat16())
    assert calls == [1, 2, 3, 4]


@pytest.mark.usefixtures("kernel_build")
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
@needs_tiles
@pytest.mark.parametrize("shape,bias", [((1536, 1024), False), ((1024, 2816), True), ((16000, 256), False),
                                        ((96, 64), True)])
def test_tile_kernel_matches_f_linear_to_one_bf16_step(shape, bias):
    """Within one bf16 step of F.linear (here oneDNN's AVX512-BF16 kernels: tests/conftest.py
    keeps oneDNN off AMX) wherever the sum is not cancelled to near zero, nearly always
    the same bits, and within bf16 rounding of an fp32 reference, at every row count the
    kernel takes (one or two row tiles, a tail block)."""
    g = torch.Generator().manual_seed(shape[0] + shape[1])
    w = torch.randn(*shape, generator=g).bfloat16()
    b = torch.randn(shape[0], generator=g).bfloat16() if bias else None
    lin = PackedLinear(w, b, small_batch_ops(), keep_copy=True)
    assert lin.tiles is not None and lin.plain is None
    for rows in (1, 2, 5, 17, 32, 33, 100, TILE_ROWS):
        x = torch.randn(rows, shape[1], generator=g).bfloat16()
        got, want = lin(x), F.linear(x, w, b)
        ref = F.linear(x.float(), w.float(), None if b is None else b.float())
        terms = F.linear(x.float().abs(), w.float().abs(), None if b is None else b.float().abs())
        kept = ref.abs() >= 64 * shape[1] ** 0.5 * 2.0**-24 * terms
        apart = bf16_steps_apart(got, want)
        assert bool((torch.sign(got) == torch.sign(want))[kept].all()), rows
        assert int(apart[kept].max()) <= 1, rows
        assert float((apart == 0).float().mean()) >= 0.99, rows
        torch.testing.assert_close(got.float(), ref, rtol=8e-3, atol=1e-2)


TILE_VS_ONEDNN_AMX = """
import torch, torch.nn.functional as F
from engine.models.packed import PackedLinear, small_batch_ops
g = torch.Generator().manual_seed(7)
for shape in ((1536, 1024), (1024, 2816), (16000, 256)):
    w = torch.randn(*shape, generator=g).bfloat16()
    lin = PackedLinear(w, None, small_batch_ops(), keep_copy=True)
    for rows in (1, 3, 16, 17, 32):
        x = torch.randn(rows, shape[1], generator=g).bfloat16()
        assert torch.equal(lin(x), F.linear(x, w)), (shape, rows)
print("same bits")
"""


@needs_bf16
@needs_tiles
def test_tile_kernel_gives_onednn_amx_bits_up_to_32_rows():
    """Where oneDNN itself runs on AMX (serving: nothing caps it), its sums for up to 32
    rows run in the tile kernel's order: the same bits as F.linear. A fresh interpreter
    without the suite's cap on oneDNN's instruction set."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    out = subprocess.run([sys.executable, "-c", TILE_VS_ONEDNN_AMX], env=env, capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0 and "same bits" in out.stdout, out.stderr[-2000:]


@needs_bf16
@needs_tiles
def test_tile_kernel_gives_a_row_the_same_bits_whatever_rows_share_its_call():
    """A row's sums run in one order whatever the step's other rows (a block of 32, a
    tail block of 1 to 31, one or two row tiles): a decode token's result does not
    depend on the streams batched with it, up to TILE_ROWS of them."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(1024, 2816, generator=g).bfloat16()
    b = torch.randn(1024, generator=g).bfloat16()
    lin = PackedLinear(w, b, small_batch_ops(), keep_copy=True)
    x = torch.randn(70, 2816, generator=g).bfloat16()
    alone = torch.cat([lin(x[i:i + 1]) for i in range(70)])
    for lo, hi in ((0, 2), (0, 17), (5, 37), (0, 64), (3, 70)):
        assert torch.equal(lin(x[lo:hi]), alone[lo:hi]), (lo, hi)


@needs_bf16
@needs_tiles
def test_tile_kernel_is_used_up_to_256_rows_then_onednn(monkeypatch):
    w = torch.randn(64, 96).bfloat16()
    lin = PackedLinear(w, None, small_batch_ops(), keep_copy=True)
    calls = []
    real = lin._tile
    monkeypatch.setattr(lin, "_tile", lambda *a: (calls.append(a[1].shape[0]), real(*a))[1])
    for rows in (1, 4, 5, 33, TILE_ROWS, TILE_ROWS + 1, 2048):
        lin(torch.randn(rows, 96).bfloat16())
    assert calls == [1, 4, 5, 33, TILE_ROWS]


@needs_bf16
@needs_tiles
def test_tile_kernel_takes_multiples_of_32_and_says_what_it_needs():
    """A weight whose dimensions are not multiples of 32 keeps a row-major copy (the
    row-major kernel); the operators refuse bad input with a message, never a crash."""
    ops = small_batch_ops()
    odd = PackedLinear(torch.randn(48, 96).bfloat16(), None, ops, keep_copy=True)
    assert odd.tiles is None and odd.plain is not None
    x = torch.randn(3, 96).bfloat16()
    assert odd(x).shape == (3, 48)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        ops.tile_pack_linear_weight(torch.randn(48, 96).bfloat16())
    tiles = ops.tile_pack_linear_weight(torch.randn(64, 96).bfloat16())
    with pytest.raises(RuntimeError, match=r"x must be \[M, 96\]"):
        ops.tile_linear(torch.empty(3, 64, dtype=torch.bfloat16), torch.randn(3, 64).bfloat16(), tiles, None)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.tile_linear(torch.empty(2, 64, dtype=torch.bfloat16), x, tiles, None)
    with pytest.raises(RuntimeError, match="tile_pack_linear_weight"):
        ops.tile_linear(torch.empty(3, 64, dtype=torch.bfloat16), x, torch.randn(64, 96).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.tile_linear(torch.empty(3, 64, dtype=torch.bfloat16), x, tiles, torch.randn(63).bfloat16())
    empty = torch.empty(0, 64, dtype=torch.bfloat16)
    ops.tile_linear(empty, torch.randn(0, 96).bfloat16(), tiles, None)  # no rows: nothing to do


@needs_bf16
def test_plain_copies_kept_by_memory_rule(monkeypatch):
    from engine import envs

    monkeypatch.setattr(envs, "physical_memory_bytes", lambda: 8 * 2**30)
    assert keep_plain_copies(2**30) and not keep_plain_copies(2**30 + 1)
    monkeypatch.setenv("TANDEM_CPU_SMALL_BATCH_LINEAR", "1")
    assert keep_plain_copies(2**40)
    monkeypatch.setenv("TANDEM_CPU_SMALL_BATCH_LINEAR", "0")
    assert not keep_plain_copies(1)
    model = nn.Sequential(nn.Linear(32, 32)).bfloat16()
    pack_linears(model)
    assert model[0].plain is None and model[0].tiles is None
    monkeypatch.setenv("TANDEM_CPU_SMALL_BATCH_LINEAR", "1")
    model = nn.Sequential(nn.Linear(32, 32)).bfloat16()
    pack_linears(model, small_batch=False)  # a prefill worker
    assert model[0].plain is None and model[0].tiles is None
    if small_batch_ops() is not None:  # the copy's kind: tile order where AMX is, else row-major
        model = nn.Sequential(nn.Linear(32, 32)).bfloat16()
        pack_linears(model)
        tiles = tile_kernel_on(small_batch_ops())
        assert (model[0].tiles is not None) == tiles and (model[0].plain is not None) == (not tiles)
        monkeypatch.setenv("TANDEM_CPU_TILE_LINEAR", "0")
        model = nn.Sequential(nn.Linear(32, 32)).bfloat16()
        pack_linears(model)
        assert model[0].tiles is None and model[0].plain is not None
    monkeypatch.setenv("TANDEM_CPU_SMALL_BATCH_LINEAR", "maybe")
    with pytest.raises(ValueError, match="auto, 1 or 0"):
        keep_plain_copies(1)
