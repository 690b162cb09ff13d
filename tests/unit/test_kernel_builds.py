"""The CPU kernels come as one build per instruction set (engine/cpu_kernels/build.py):
which builds a CPU runs, which one a process loads and how to force another, and the
row-major linear kernel's fp32 and widened-bf16 paths (every x86-64 build) against
F.linear, through PlainLinear where oneDNN packs nothing."""

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu_kernels import build
from engine.models.packed import SMALL_BATCH_ROWS, PlainLinear, plain_kernel_ops, plain_linears

pytestmark = pytest.mark.unit

X86 = build.GENERIC is not build.VARIANTS[0]
needs_x86 = pytest.mark.skipif(not X86, reason="the instruction-set builds are x86-64's")


@needs_x86
def test_a_cpu_runs_the_builds_whose_flags_it_has_best_first():
    avx2_only = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "sse4_2"})
    assert [v.name for v in build.runnable(avx2_only)] == ["avx2", "generic"]
    zen4 = avx2_only | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16", "avx512_vnni"}
    assert [v.name for v in build.runnable(zen4)] == ["avx512_bf16", "avx512", "avx2", "generic"]
    assert [v.name for v in build.runnable(zen4 | {"amx_tile", "amx_bf16", "amx_int8"})][0] == "amx"
    assert [v.name for v in build.runnable(frozenset({"avx2", "sse4_2"}))] == ["generic"]  # no FMA: not v3


def test_the_environment_picks_a_build_and_a_wrong_one_is_refused(monkeypatch):
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "auto")
    assert build.chosen()[0] == build.runnable()[0]
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "GENERIC")
    assert build.chosen() == (build.GENERIC, "TANDEM_CPU_KERNELS")
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "sse9")
    with pytest.raises(build.KernelBuildError, match="no cpu kernel build named 'sse9'"):
        build.chosen()
    lacking = next((v for v in build.VARIANTS if not v.runs_on(build.cpu_flag_set())), None)
    if lacking is not None:
        monkeypatch.setenv("TANDEM_CPU_KERNELS", lacking.name)
        with pytest.raises(build.KernelBuildError, match="this CPU lacks"):
            build.chosen()


def test_build_names_carry_the_build_and_not_this_cpu(monkeypatch):
    names = {build.extension_name(v) for v in build.VARIANTS}
    assert len(names) == len(build.VARIANTS)
    assert all(build.extension_name(v).startswith(f"tandem_cpu_{v.name}_") for v in build.VARIANTS)
    from engine.cpu_kernels import isa

    monkeypatch.setattr(isa, "cpu_flags", lambda: "some other cpu")
    isa.cpu_flag_set.cache_clear()
    try:
        assert isa.cpu_flag_set() == frozenset({"some", "other", "cpu"})
        assert {build.extension_name(v) for v in build.VARIANTS} == names  # portable: not tied to the CPU
    finally:
        isa.cpu_flag_set.cache_clear()


@needs_x86
def test_a_process_loads_the_forced_build_and_says_which():
    script = textwrap.dedent("""
        import logging
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        from engine.cpu_kernels import build
        ops = build.load_or_none()
        print("LANES", ops.simd_lanes(), ops.small_batch_linear_kernel())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "TANDEM_CPU_KERNELS": "avx2"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "LANES 8 widen" in out.stdout
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("cpu kernels: avx2")]
    assert len(lines) == 1 and "TANDEM_CPU_KERNELS" in lines[0]


def fp32_bound(x, w, b):
    """|fp32 sum - exact| <= K * 2^-24 * sum |terms| for any order of the additions."""
    terms = F.linear(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
    return (w.shape[1] + 1) * 2.0**-24 * terms


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("shape,bias", [((384, 256), False), ((101, 1000), True), ((7, 37), True),
                                        ((1024, 2816), False)])
def test_the_fp32_kernel_sums_within_fp32_rounding(build_ops, rows, shape, bias):
    if build_ops.small_batch_linear_kernel() == "none":
        pytest.skip("the generic build has no row-major kernel")
    g = torch.Generator().manual_seed(rows + shape[1])
    w, x = torch.randn(*shape, generator=g), torch.randn(rows, shape[1], generator=g)
    b = torch.randn(shape[0], generator=g) if bias else None
    y = torch.empty(rows, shape[0])
    build_ops.small_batch_linear(y, x, w, b)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert bool(((y.double() - exact).abs() <= fp32_bound(x, w, b)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1024, 2816), (37, 300), (16000, 256)])
def test_a_row_has_the_same_bits_whatever_rows_share_its_pass(build_ops, dtype, shape):
    """One to four rows of x share a pass over W; a row's sums run in the same order in
    every case, so a decode token's result does not depend on the streams beside it."""
    if build_ops.small_batch_linear_kernel() == "none":
        pytest.skip("the generic build has no row-major kernel")
    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(*shape, generator=g).to(dtype)
    x = torch.randn(7, shape[1], generator=g).to(dtype)

    def linear(rows):
        y = torch.empty(rows.shape[0], shape[0], dtype=dtype)
        build_ops.small_batch_linear(y, rows.contiguous(), w, None)
        return y

    alone = torch.cat([linear(x[i:i + 1]) for i in range(7)])
    for n in (2, 3, 4, 7):
        assert torch.equal(linear(x[:n]), alone[:n])


def test_the_kernel_refuses_mixed_dtypes(build_ops):
    if build_ops.small_batch_linear_kernel() == "none":
        pytest.skip("the generic build has no row-major kernel")
    with pytest.raises(RuntimeError, match="all of the weight's dtype"):
        build_ops.small_batch_linear(torch.empty(1, 8), torch.randn(1, 4).bfloat16(), torch.randn(8, 4), None)


def test_plain_linears_take_the_kernel_up_to_four_rows_and_f_linear_above(monkeypatch):
    model = nn.Module()
    model.body = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32, bias=False))
    head = torch.randn(50, 32)
    ops = plain_kernel_ops(model, torch.device("cpu"))
    if ops is None:
        pytest.skip("no row-major kernel in the build loaded here")
    x = torch.randn(9, 64)
    before = model.body(x)
    assert plain_linears(model, ops, head_weight=head) == 3
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    first = model.body[0]
    assert isinstance(first, PlainLinear) and first.packed.data_ptr() == first.weight.data_ptr()
    calls = []
    real = first._small
    monkeypatch.setattr(first, "_small", lambda *a: (calls.append(a[1].shape[0]), real(*a))[1])
    for rows in (1, 4, 5, 9):
        got = model.body(x[:rows])
        exact = before[:rows].double()
        assert (got.double() - exact).abs().max() < 1e-4
    assert calls == [1, 4]
    assert torch.allclose(model.lm_head(before[:2]), F.linear(before[:2], head), atol=1e-5)
    assert first.max_rows == SMALL_BATCH_ROWS  # fp32: F.linear above four rows


def test_bf16_plain_linears_take_the_kernel_at_every_size_without_native_bf16(monkeypatch):
    """Where oneDNN has no native bf16, torch's bf16 matmul is emulated: a PlainLinear
    sends every step to the widening kernel (tiled through L2 above four rows), whose
    result is within one bf16 step of the fp32 sum's rounding."""
    from engine.models import packed

    ops = plain_kernel_ops(nn.Linear(8, 8).bfloat16(), torch.device("cpu"))
    if ops is None:
        pytest.skip("no row-major kernel in the build loaded here")
    monkeypatch.setattr(packed, "native_bf16", lambda: False)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 256, generator=g).bfloat16()
    lin = PlainLinear(w, None, ops)
    assert lin.max_rows > 10_000
    calls = []
    real = lin._small
    monkeypatch.setattr(lin, "_small", lambda *a: (calls.append(a[1].shape[0]), real(*a))[1])
    x = torch.randn(37, 256, generator=g).bfloat16()
    got = lin(x)
    assert calls == [37]
    exact = F.linear(x.double(), w.double())
    assert (got.double() - exact).abs().max() <= 2**-7 * exact.abs().max()
