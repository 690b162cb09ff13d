"""8-bit weights (engine/quantization): the schemes read from config.json, int8 and e4m3
quantization, and the compiled kernel (engine/cpu_kernels/quant_linear.cpp) in every
build this CPU runs that the install makes, against F.linear on the dequantized weights: in fp32 (to fp32
rounding: the kernel applies a group's scale to its sum), in bf16 through the streaming
path (one to four rows) and the tiled or AMX path (more rows); a row's result does not
depend on the rows beside it."""

import pytest
import torch
import torch.nn.functional as F

from engine.cpu_kernels import build
from engine.quantization import scheme
from engine.quantization.linear import FP8, QuantLinear, QuantSwiGLU, dequantize, quantize, spread_scale

pytestmark = pytest.mark.unit

# the builds this CPU runs that the install makes (`tandem kernels build`; on x86-64 not the
# generic one, which a test would spend a minute and a half compiling)
BUILDS = [v.name for v in build.runnable() if v in build.INSTALLED]


def _ops(name):
    try:
        return build.load(name)
    except build.KernelBuildError as e:
        pytest.skip(str(e))


def test_schemes_from_config_json():
    ct = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                 "symmetric": True, "dynamic": False}}}}
    q = scheme.from_hf({"quantization_config": ct})
    assert (q.method, q.strategy, q.scale_name, q.online) == ("fp8", "channel", "weight_scale", False)
    assert q.scale_shape(96, 64) == (96, 1) and q.group_size(64) == 64
    ct["config_groups"]["g"]["weights"] |= {"strategy": "block", "block_structure": [32, 64]}
    q = scheme.from_hf({"quantization_config": ct})
    assert q.scale_shape(96, 160) == (3, 3) and q.group_size(160) == 64
    ct["config_groups"]["g"]["weights"] |= {"type": "int", "strategy": "tensor"}
    assert scheme.from_hf({"quantization_config": ct}).method == "int8"
    hf = scheme.from_hf({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    assert (hf.strategy, hf.block, hf.scale_name) == ("block", (128, 128), "weight_scale_inv")
    assert scheme.from_hf({"quantization_config": {"quant_method": "fp8"}}).strategy == "tensor"
    assert scheme.from_hf({}) is None
    assert scheme.resolve(None, "int8") == scheme.online("int8")
    assert scheme.resolve(hf, "fp8") is hf and scheme.resolve(hf, None) is hf


@pytest.mark.parametrize("qc,needle", [
    ({"quant_method": "gptq"}, "quant_method='gptq' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "only e4m3"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "pack-quantized"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}, "4-bit int weights"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": False}}}}, "asymmetric"),
])
def test_unsupported_schemes_are_named(qc, needle):
    with pytest.raises(scheme.QuantizationError) as e:
        scheme.from_hf({"quantization_config": qc})
    assert needle in str(e.value)


def test_a_different_method_than_the_checkpoints_is_refused():
    with pytest.raises(scheme.QuantizationError, match="quantized to fp8"):
        scheme.resolve(scheme.WeightQuant("fp8", "fp8", "tensor"), "int8")


def test_quantize_per_channel():
    w = torch.randn(48, 80) * torch.linspace(0.01, 3, 48)[:, None]
    w[5] = 0
    live = torch.arange(48) != 5
    q, s = quantize(w, "int8")
    assert q.dtype == torch.int8 and s.shape == (48, 1)
    assert q.abs().amax(dim=1)[live].eq(127).all() and s[5].item() == 1.0
    assert (dequantize(q, s, 80) - w).abs().le(s / 2 + 1e-6).all()  # within half a step
    q8, s8 = quantize(w, "fp8")
    assert q8.dtype == FP8 and q8.float().abs().amax(dim=1)[live].eq(448).all()
    big = w.abs() > s8 * 2  # normal e4m3 values: 3 mantissa bits, within half an ulp
    assert ((dequantize(q8, s8, 80) - w).abs() / w.abs())[big].max() <= 2 ** -4


def test_spread_scales():
    assert spread_scale(torch.tensor([2.0]), "tensor", 3, 8, None).tolist() == [[2.0]] * 3
    out = spread_scale(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "block", 5, 8, (4, 4))
    assert out.shape == (5, 2) and out[3].tolist() == [1.0, 2.0] and out[4].tolist() == [3.0, 4.0]


def _case(n, k, method, group, seed=0):
    """q [n, k] and scales [n, ceil(k / group)], each group of columns quantized on its own."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    parts = [quantize(w[:, j:j + group], method) for j in range(0, k, group)]
    q = torch.cat([p[0].float() for p in parts], 1).to(parts[0][0].dtype)
    return q.contiguous(), torch.cat([p[1] for p in parts], 1).contiguous()


@pytest.mark.parametrize("variant", BUILDS)
@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("k,group", [(256, 256), (200, 200), (256, 64), (96, 40)])
def test_kernel_fp32_equals_the_dequantized_weights(variant, method, k, group):
    ops = _ops(variant)
    n = 72
    q, s = _case(n, k, method, group)
    bias = torch.randn(n)
    w = dequantize(q, s, group)
    for m in (1, 3, 4, 5, 37):
        x = torch.randn(m, k)
        y = torch.empty(m, n)
        ops.quant_linear(y, x, q, s, group, bias)
        ref = F.linear(x.double(), w.double(), bias.double()).float()
        assert torch.allclose(y, ref, rtol=1e-5, atol=1e-4), (variant, m, (y - ref).abs().max())


@pytest.mark.parametrize("variant", BUILDS)
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_kernel_bf16_rows_do_not_depend_on_their_neighbours(variant, method):
    ops = _ops(variant)
    n, k = 96, 256
    q, s = _case(n, k, method, k, seed=1)
    w = dequantize(q, s, k)
    x = torch.randn(70, k).bfloat16()
    bias = torch.randn(n).bfloat16()
    ys = {}
    for m in (1, 2, 4, 5, 33, 70):
        y = torch.empty(m, n, dtype=torch.bfloat16)
        ops.quant_linear(y, x[:m].contiguous(), q, s, k, bias)
        ys[m] = y
        ref = F.linear(x[:m].double(), w.double(), bias.double())
        assert (y.double() - ref).abs().le(ref.abs() * 2 ** -7 + 2e-2).all(), (variant, m)
    amx = "amx" in ops.quant_linear_kernel()
    for m in (2, 4, 5, 33, 70):  # the streaming order for every row at any batch (AMX's own above four)
        if m <= 4 or not amx:
            assert torch.equal(ys[m][:1], ys[1]), (variant, m)
    assert torch.equal(ys[33], ys[70][:33]) and torch.equal(ys[5], ys[70][:5])


def test_module_runs_with_and_without_the_kernels():
    layer = QuantLinear(64, 32, True, "int8", 64)
    q, s = _case(32, 64, "int8", 64, seed=2)
    with torch.no_grad():
        layer.weight.copy_(q)
        layer.weight_scale.copy_(s)
        layer.bias.normal_()
    x = torch.randn(3, 64)
    want = F.linear(x, dequantize(q, s, 64), layer.bias)
    assert torch.allclose(layer(x), want, atol=1e-5)  # no kernels: dequantized for the call
    layer.use_kernels(_ops(BUILDS[0]))
    assert torch.allclose(layer(x), want, atol=1e-4)
    head = layer.rows(slice(8, 16))
    assert torch.allclose(head(x), want[:, 8:16], atol=1e-4)


def w8a8_reference(x, q, s, bias):
    """What the W8A8 kernel computes, in torch: each row of x quantized to int8 (its
    largest magnitude / 127), exact integer dot products, then (x_q . q) * (s_x * s_w) + b
    in fp32, rounded to bf16."""
    xf = x.float()
    sx = xf.abs().amax(dim=1, keepdim=True) / 127
    sx = torch.where(sx > 0, sx, torch.ones_like(sx))
    xq = torch.round(xf / sx).clamp(-127, 127)
    dot = (xq.long() @ q.long().T).float()
    y = dot * (sx * s.T)
    return (y + bias.float() if bias is not None else y).bfloat16()


@pytest.mark.parametrize("variant", BUILDS)
@pytest.mark.parametrize("k", [256, 200, 232])  # 232: a 32-byte step and a tail past the 64s
def test_w8a8_is_exact_integer_arithmetic_on_every_path(variant, k):
    """int8 weights x bf16 activations: every build and path (integer dot products at one
    to four rows, the AMX int8 tiles above) gives the reference's bits at every batch size."""
    ops = _ops(variant)
    n = 96
    q, s = _case(n, k, "int8", k, seed=3)
    sums = q.sum(dim=1, dtype=torch.int32)
    x = (torch.randn(70, k) * torch.linspace(0.1, 4, k)).bfloat16()
    x[3] = 0  # a zero row: scale 1
    bias = torch.randn(n).bfloat16()
    for m in (1, 2, 3, 4, 5, 16, 33, 70):
        y = torch.empty(m, n, dtype=torch.bfloat16)
        ops.quant_linear(y, x[:m].contiguous(), q, s, k, bias, sums)
        assert torch.equal(y, w8a8_reference(x[:m], q, s, bias)), (variant, m)
        y2 = torch.empty(m, n, dtype=torch.bfloat16)
        ops.quant_linear(y2, x[:m].contiguous(), q, s, k, None, sums)
        assert torch.equal(y2, w8a8_reference(x[:m], q, s, None)), (variant, m)


def _quotient_rows(k):
    """Rows of bf16 x whose quantization is hard to get right: for each of the 128 bf16
    largest magnitudes in [1, 2) (column 0), every bf16 value whose quotient by the row's
    scale rounds to 1..127, both signs, k - 1 to a row; then the same rows scaled by
    2^-64 and 2^-70 (the kernels divide below a largest magnitude of 2^-60)."""
    rows = []
    for top in (1 + torch.arange(128, dtype=torch.float32) / 128).tolist():
        bits = torch.arange(0x3B80, 0x4000, dtype=torch.int32)  # bf16 from 2^-8 to 2
        vals = (bits << 16).view(torch.float32)
        vals = vals[vals <= top]
        vals = torch.cat([vals, -vals])
        for i in range(0, len(vals), k - 1):
            row = torch.zeros(k)
            row[0] = top
            row[1:1 + len(vals[i:i + k - 1])] = vals[i:i + k - 1]
            rows.append(row)
    x = torch.stack(rows)
    return torch.cat([x, x[::40] * 2.0**-64, x[::40] * 2.0**-70]).bfloat16()


@pytest.mark.parametrize("variant", BUILDS)
def test_w8a8_quantizes_x_as_torch_divides(variant):
    """Each row of x becomes round(x / scale) as torch computes it, at every value whose
    quotient could round the other way: the AVX-512 paths multiply by the scale's inverse
    and correct the product with its residual (quantize_row). The weights are the identity,
    so y is x_q times the row's scale, and one step of x_q changes y's bits."""
    ops = _ops(variant)
    for k in (128, 144, 150):  # the 64-wide loop; 16 values; one at a time
        x = _quotient_rows(k)
        q, s = torch.eye(k, dtype=torch.int8), torch.ones(k, 1)
        sums = q.sum(dim=1, dtype=torch.int32)
        y = torch.empty(len(x), k, dtype=torch.bfloat16)
        ops.quant_linear(y, x, q, s, k, None, sums)
        assert torch.equal(y, w8a8_reference(x, q, s, None)), (variant, k)
    if ops.quant_tiles_supported():  # one to four rows on VNNI, more on the AMX tiles
        x = _quotient_rows(128)
        tiles = ops.quant_pack_int8(q[:128, :128].contiguous())
        for m in (3, len(x)):
            y = torch.empty(m, 128, dtype=torch.bfloat16)
            ops.quant_linear_tiles(y, x[:m].contiguous(), tiles, s[:128], None, sums[:128])
            assert torch.equal(y, w8a8_reference(x[:m], q[:128, :128], s[:128], None)), (variant, m)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("k", [192, 640])  # 640: ten steps of 64 inputs, two passes of kTileSteps on AMX
def test_w8a8_on_weights_in_tile_order_gives_the_same_bits(bias, k):
    """AMX CPUs keep a bf16 model's int8 weights in the tile unit's order: one to four rows
    on VNNI with the rows in the lanes, more on the int8 tiles in blocks of 32 rows (the
    last one partial or not); the bits of the row-major kernel at every batch size."""
    ops = _ops(BUILDS[0])
    if not ops.quant_tiles_supported():
        pytest.skip("no AMX tiles here")
    n = 96
    q, s = _case(n, k, "int8", k, seed=4)
    sums = q.sum(dim=1, dtype=torch.int32)
    tiles = ops.quant_pack_int8(q)
    assert tiles.shape == (3, k // 64, 2, 16, 64) and tiles.nbytes == q.nbytes
    x = torch.randn(300, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    for m in (1, 2, 3, 4, 5, 17, 32, 64, 70, 100, 128, 160, 164, 300):  # 300: passes of 256 rows and 44
        y = torch.empty(m, n, dtype=torch.bfloat16)
        ops.quant_linear_tiles(y, x[:m].contiguous(), tiles, s, b, sums)
        assert torch.equal(y, w8a8_reference(x[:m], q, s, b)), m
    layer = QuantLinear(k, n, bias, "int8", k)
    with torch.no_grad():
        layer.weight.copy_(q)
        layer.weight_scale.copy_(s)
        if bias:
            layer.bias = torch.nn.Parameter(b, requires_grad=False)
    layer.use_kernels(ops, torch.bfloat16)
    assert layer.tiles and torch.equal(layer(x[:9]), w8a8_reference(x[:9], q, s, b))


@pytest.mark.parametrize("variant", BUILDS)
@pytest.mark.parametrize("k", [192, 640])
def test_gate_and_up_fused_with_swiglu_give_the_unfused_bits(variant, k):
    """quant_linear_tiles_swiglu (an MLP's int8 gate and up in tile order, interleaved 16
    outputs at a time, and SwiGLU in the epilogue) gives the bits of the two layers followed
    by torch's silu_ and mul_, on every path: one to four rows streamed on VNNI, more on the
    AMX tiles (or VNNI's 8-row blocks where the build has no AMX). The weight scales span
    five decades, so the gate's values run from subnormal products to ones where exp(-g)
    overflows; a zero row and a row of huge values are among x's."""
    ops = _ops(variant)
    if not ops.quant_tiles_supported():
        pytest.skip("this build keeps no weights in tile order")
    n = 96
    g = torch.Generator().manual_seed(5)
    qg = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    qu = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    sg = 10 ** (torch.rand(n, 1, generator=g) * 5 - 7)
    su = 10 ** (torch.rand(n, 1, generator=g) * 5 - 7)
    x = (torch.randn(300, k, generator=g) * 4).bfloat16()
    x[7], x[8] = 0, 3e4
    layers = []
    for q, sc in ((qg, sg), (qu, su)):
        layer = QuantLinear(k, n, False, "int8", k)
        with torch.no_grad():
            layer.weight.copy_(q)
            layer.weight_scale.copy_(sc)
        layer.use_kernels(ops, torch.bfloat16)
        assert layer.tiles
        layers.append(layer)
    fused = QuantSwiGLU(*layers)
    assert fused.weight.shape == (6, k // 64, 2, 16, 64)
    for m in (1, 2, 3, 4, 5, 9, 17, 32, 70, 100, 300):
        xm = x[:m].contiguous()
        want = F.silu(layers[0](xm), inplace=True).mul_(layers[1](xm))
        assert torch.equal(fused(xm).view(torch.int16), want.view(torch.int16)), (variant, m)


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("bias", [True, False])
def test_the_scaled_matmul_path_is_w8a8_on_torchs_8_bit_gemms(method, bias):
    """The CUDA path of a bf16 layer (torch's _scaled_mm for fp8, _int_mm for int8), run on
    the CPU, which has both: each row of x quantized to the weight's format with its own
    scale, then the 8-bit product scaled by both; against that arithmetic in fp32."""
    layer = QuantLinear(64, 48, bias, method, 64)
    q, s = _case(48, 64, method, 64, seed=4)
    with torch.no_grad():
        layer.weight.copy_(q)
        layer.weight_scale.copy_(s)
        if bias:
            layer.bias.normal_()
    x = torch.randn(2, 5, 64).bfloat16()
    x[0, 1] = 0  # a zero row: scale clamped, output the bias
    assert layer.scaled_matmul_fits(x) and not layer.scaled_matmul_fits(x.float())
    top = 127.0 if method == "int8" else 448.0
    xf = x.reshape(-1, 64).float()
    sx = (xf.abs().amax(dim=1, keepdim=True) / top).clamp(min=1e-12)
    xq = torch.round(xf / sx) if method == "int8" else (xf / sx).to(FP8).float()
    want = (xq @ q.float().T) * sx * s.T + (layer.bias.float() if bias else 0)
    got = layer.scaled_matmul(x)
    assert got.shape == (2, 5, 48) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.reshape(-1, 48).float(), want, atol=3e-2, rtol=1e-2)


@pytest.mark.parametrize("variant", BUILDS)
def test_weight_streams_on_a_contended_core_give_every_output_once(variant):
    """One to four rows stream the weights in chunks that a thread done with its own share
    takes from the other's (cpu_kernels/steal.h). With a busy process on the same two
    cores (so that threads are preempted and chunks change hands), every output of each
    stream is written once, with the bits of a single thread's run (the outputs start as
    NaN: a chunk left out would show): int8 in tile order (where the build has it), int8
    row-major W8A8, int8 widened for fp32 activations, and the bf16 linear layer's
    row-major kernel (the widening one on the AVX2 build)."""
    import subprocess
    import sys
    import time

    ops = _ops(variant)
    n, k = 2048, 1024
    q, s = _case(n, k, "int8", k, seed=5)
    sums = q.sum(dim=1, dtype=torch.int32)
    tiles = ops.quant_pack_int8(q) if ops.quant_tiles_supported() else None
    w = (torch.randn(n, k) / 32).bfloat16()
    x = torch.randn(4, k).bfloat16()
    x32 = x.float()

    def run(m):
        out = []

        def fresh(dtype=torch.bfloat16):
            out.append(torch.full((m, n), float("nan"), dtype=dtype))
            return out[-1]

        if tiles is not None:
            ops.quant_linear_tiles(fresh(), x[:m], tiles, s, None, sums)
        ops.quant_linear(fresh(), x[:m], q, s, k, None, sums)
        ops.quant_linear(fresh(torch.float32), x32[:m], q, s, k, None, None)
        ops.small_batch_linear(fresh(), x[:m], w, None)
        return out

    threads = torch.get_num_threads()
    was = ops.set_work_stealing(True)
    try:
        torch.set_num_threads(1)
        want = {m: run(m) for m in (1, 4)}
        torch.set_num_threads(2)
        burner = subprocess.Popen([sys.executable, "-c", "import time\nprint(flush=True)\nt = time.time() + 20\n"
                                   "while time.time() < t: pass"], stdout=subprocess.PIPE)
        try:
            burner.stdout.readline()  # it is running
            end, i = time.monotonic() + 0.5, 0
            while time.monotonic() < end:
                m = 1 if i % 2 else 4
                for j, (got, ref) in enumerate(zip(run(m), want[m])):
                    assert torch.equal(got, ref), (i, m, j)
                i += 1
        finally:
            burner.kill()
            burner.wait(10)
    finally:
        torch.set_num_threads(threads)
        ops.set_work_stealing(was)
