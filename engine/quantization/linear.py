"""Quantized linear layers: W held as 8-bit values q [N, K] (int8 or float8_e4m3fn) and
fp32 scales [N, G] (engine/quantization/scheme.py), activations in the model's dtype.

On CPU the compiled kernel (engine/cpu_kernels/quant_linear.cpp) reads q and the
scales as they are and never writes a dequantized copy of W: int8 weights with bf16
activations run W8A8 (each row of x quantized to int8, exact int32 dot products; on AMX
CPUs q kept in the tile unit's order, `use_kernels`), the rest widen q to fp32 in
registers (on AMX, a panel of 32 rows made bf16 at a time in L2 above four rows).
On CUDA a bf16 layer with one scale a row runs W8A8 on the tensor cores
(`scaled_matmul`): each row of x quantized to the weight's format with its own scale,
then torch's `_scaled_mm` for fp8 (scales applied in the GEMM's epilogue, as vLLM's fp8
layers do) or `_int_mm` for int8 (exact int32 sums, scaled after). Elsewhere (group or
block scales on CUDA, CPUs without the kernels, fp16 models) the layer dequantizes W for
the call and runs F.linear: correct, and no faster than the unquantized model.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
INT8_MAX = 127.0  # symmetric: -127..127, as llama.cpp's Q8_0 and vLLM's int8 do
STORAGE = {"int8": torch.int8, "fp8": FP8}


def to_format(x: torch.Tensor, method: str) -> torch.Tensor:
    """fp32 values already divided by their scale -> int8 (round half even) or e4m3,
    clamped to the format's range."""
    if method == "int8":
        return torch.round(x).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return x.clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def quantize(w: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (q [N, K], scale [N, 1] fp32), one symmetric scale per row: the row's
    largest magnitude maps to the format's largest value. A zero row gets scale 1."""
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True) / (INT8_MAX if method == "int8" else FP8_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return to_format(w / scale, method), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [N, K] and scale [N, G] -> W [N, K] in `dtype` (the product taken in fp32)."""
    w = q.float()
    if scale.shape[1] > 1:
        scale = scale.repeat_interleave(group, dim=1)[:, :w.shape[1]]
    return (w * scale).to(dtype)


def spread_scale(scale: torch.Tensor, strategy: str, n: int, k: int, block: tuple[int, int] | None) -> torch.Tensor:
    """A checkpoint's scale of a [n, k] weight as stored -> [n, G] fp32, one row per row
    of W (G = 1 per channel or tensor)."""
    s = scale.float()
    if strategy == "tensor":
        return s.reshape(1, 1).expand(n, 1).contiguous()
    if strategy == "channel":
        return s.reshape(n, 1).contiguous()
    if strategy == "group":
        return s.contiguous()
    return s.repeat_interleave(block[0], dim=0)[:n].contiguous()  # block: each row its block's scales


def on_tiles(x: torch.Tensor, n_in: int, n_out: int, call) -> torch.Tensor:
    """A tile-order kernel's call on x's rows as contiguous bf16: `call(y, x2)` fills y
    [rows, n_out]; y comes back in x's shape and dtype."""
    x2 = x.reshape(-1, n_in).to(torch.bfloat16).contiguous()
    y = x2.new_empty(x2.shape[0], n_out)
    call(y, x2)
    return y.reshape(*x.shape[:-1], n_out).to(x.dtype)


class QuantLinear(nn.Module):
    """`y = x @ (q * scale).T + b`; `group` K values share a scale column (K: one
    scale per output channel). Built on the meta device by the loader and filled by
    `load_weights` like nn.Linear (`weight`, `weight_scale`, `bias`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, method: str, group: int,
                 bias_dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.method, self.group = in_features, out_features, method, group
        groups = -(-in_features // group)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=STORAGE[method], device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, groups, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.bias = None if not bias else nn.Parameter(torch.empty(out_features, dtype=bias_dtype, device=device),
                                                       requires_grad=False)
        self._ops = None  # the compiled CPU kernels, set by `use_kernels`
        self._sums = None  # int8, one scale a row: each row's sum of q, for the W8A8 kernel (bf16 x)
        self.tiles = False  # `weight` holds q in the tile unit's order (quant_pack_int8), not row-major

    def use_kernels(self, ops, dtype: torch.dtype | None = None) -> None:
        """Run on `ops.quant_linear` (engine/cpu_kernels) from now on; None: F.linear.
        int8 weights with one scale a row then take bf16 activations as int8 too (W8A8:
        the kernel quantizes each row of x, one scale a row); fp32 activations, fp8 or
        group-scaled weights stay weight-only. With a bf16 model (`dtype`) on a build with
        AMX or AVX512-VNNI and BF16, such a layer's q is laid out once in the tile unit's
        order, in place of the row-major one (the same bytes), which the kernel reads at
        every batch size (AMX tiles above four rows, else VNNI with the outputs in the
        vector lanes: no horizontal sums)."""
        self._ops = ops
        if ops is None or self.weight.dtype != torch.int8 or self.weight_scale.shape[1] != 1:
            return
        self._sums = self.weight.sum(dim=1, dtype=torch.int32)
        if (dtype == torch.bfloat16 and hasattr(ops, "quant_pack_int8") and ops.quant_tiles_supported()
                and self.out_features % 32 == 0 and self.in_features % 64 == 0):
            self.weight = nn.Parameter(ops.quant_pack_int8(self.weight.data), requires_grad=False)
            self.tiles = True

    def scaled_matmul_fits(self, x: torch.Tensor) -> bool:
        """Whether `scaled_matmul` takes `x`: bf16 activations, one scale a row, and sizes
        the tensor cores' 8-bit GEMMs take (multiples of 16)."""
        return (x.dtype == torch.bfloat16 and self.weight_scale.shape[1] == 1 and not self.tiles
                and self.in_features % 16 == 0 and self.out_features % 16 == 0)

    def scaled_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """W8A8 through torch's 8-bit GEMMs: each row of x quantized to the weight's format
        with one scale a row (its largest magnitude to the format's largest value), then
        fp8 x fp8 with both scales applied inside `_scaled_mm`, or int8 x int8 summed exactly
        in int32 by `_int_mm` and scaled after. The CUDA path for bf16 models; the CPU runs
        it too (the tests' check of its numbers)."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        amax = x2.abs().amax(dim=1, keepdim=True).float()
        w_scale = self.weight_scale.reshape(1, -1)
        if self.method == "fp8":
            x_scale = (amax / FP8_MAX).clamp_(min=1e-12)
            xq = (x2.float() / x_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
            bias = None if self.bias is None else self.bias.to(x.dtype)
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=w_scale, bias=bias, out_dtype=x.dtype)
        else:
            x_scale = (amax / INT8_MAX).clamp_(min=1e-12)
            xq = torch.round(x2.float() / x_scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
            m = xq.shape[0]
            if xq.is_cuda and m <= 16:  # cuBLAS's int8 GEMM wants more than 16 rows
                xq = F.pad(xq, (0, 0, 0, 17 - m))
            acc = torch._int_mm(xq, self.weight.t())[:m]
            y = acc.float() * x_scale * w_scale
            if self.bias is not None:
                y = y + self.bias.float()
            y = y.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.scaled_matmul_fits(x):
            return self.scaled_matmul(x)
        if self.tiles:
            return on_tiles(x, self.in_features, self.out_features, lambda y, x2: self._ops.quant_linear_tiles(
                y, x2, self.weight, self.weight_scale, self.bias, self._sums))
        if self._ops is not None and x.dtype in (torch.bfloat16, torch.float32) and x.is_cpu:
            shape = x.shape
            x2 = x.reshape(-1, self.in_features).contiguous()
            y = x2.new_empty(x2.shape[0], self.out_features)
            self._ops.quant_linear(y, x2, self.weight, self.weight_scale, self.group, self.bias,
                                   self._sums if x.dtype == torch.bfloat16 else None)
            return y.reshape(*shape[:-1], self.out_features)
        w = dequantize(self.weight, self.weight_scale, self.group, x.dtype)
        return F.linear(x, w, self.bias)

    def rows(self, rows: slice) -> "QuantLinear":
        """A layer of these output rows (their weights and scales copied), before
        `use_kernels` lays them out."""
        assert not self.tiles
        n = len(range(*rows.indices(self.out_features)))
        out = QuantLinear(self.in_features, n, self.bias is not None, self.method, self.group, device="meta")
        out.weight = nn.Parameter(self.weight[rows].clone(), requires_grad=False)
        out.weight_scale = nn.Parameter(self.weight_scale[rows].clone(), requires_grad=False)
        if self.bias is not None:
            out.bias = nn.Parameter(self.bias[rows].clone(), requires_grad=False)
        out._ops = self._ops
        out._sums = None if self._sums is None else self._sums[rows].clone()
        return out

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.group, dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.method}, group={self.group}")


class QuantSwiGLU(nn.Module):
    """An MLP's gate and up layers and the SwiGLU between them as one call: `silu(x Wg^T) *
    (x Wu^T)` (`quant_linear_tiles_swiglu`), for int8 layers in the tile unit's order, one
    scale a row, no bias. The two layers' tiles are interleaved 16 outputs at a time (each
    32-row panel: 16 rows of the gate, then the same 16 of the up), so one pass of the
    kernel over x has both sums of an output side by side; x is quantized once, and the
    gate's and up's outputs are never written. The bits are those of the two layers, then
    torch's silu_ and mul_ (the kernel's store_swiglu). Made by `use_cpu_kernels` from the
    layers, which it then drops (the model keeps one copy of the weights)."""

    def __init__(self, gate: QuantLinear, up: QuantLinear) -> None:
        super().__init__()
        assert gate.tiles and up.tiles and gate.bias is None and up.bias is None
        assert (gate.in_features, gate.out_features) == (up.in_features, up.out_features)
        self.in_features, self.out_features, self.method = gate.in_features, gate.out_features, gate.method
        n16 = self.out_features // 16
        # [N/32, K/64, 2, 16, 64] -> [N/16, K/64, 16, 64]: each panel's halves, in order
        halves = lambda t: t.permute(0, 2, 1, 3, 4).reshape(n16, t.shape[1], 16, 64)  # noqa: E731
        both = lambda g, u: torch.stack([g.reshape(n16, 16), u.reshape(n16, 16)], 1).reshape(-1)  # noqa: E731
        self.weight = nn.Parameter(torch.stack([halves(gate.weight.data), halves(up.weight.data)], dim=2).contiguous(),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(both(gate.weight_scale.data, up.weight_scale.data).reshape(-1, 1).contiguous(),
                                         requires_grad=False)
        self._sums = both(gate._sums, up._sums).contiguous()
        self._ops = gate._ops
        self.tiles = True  # (as a QuantLinear in tile order, for the one-call stack's checks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return on_tiles(x, self.in_features, self.out_features, lambda y, x2: self._ops.quant_linear_tiles_swiglu(
            y, x2, self.weight, self.weight_scale, self._sums))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (gate and up), {self.method}"


def fuse_swiglu(model: nn.Module) -> int:
    """Every SwiGLU MLP (a module with `gate_proj`, `up_proj` and a `gate_up` slot, not
    GeLU) whose gate and up are int8 in tile order on the compiled kernels takes a
    QuantSwiGLU in `gate_up`, and its two layers go (None); returns how many."""
    fused = 0
    for m in model.modules():
        gate, up = getattr(m, "gate_proj", None), getattr(m, "up_proj", None)
        if (not hasattr(m, "gate_up") or getattr(m, "gelu", False) or not isinstance(gate, QuantLinear)
                or not isinstance(up, QuantLinear) or not (gate.tiles and up.tiles) or gate.bias is not None
                or up.bias is not None):
            continue
        m.gate_up = QuantSwiGLU(gate, up)
        m.gate_proj = m.up_proj = None
        fused += 1
    return fused


def use_cpu_kernels(model: nn.Module, ops) -> int:
    """Point every QuantLinear of `model` at the compiled kernels `ops` (when they have
    the quantized kernel), for the model's dtype; returns how many run on it. Logs which
    path runs."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not layers:
        return 0
    if ops is None or not hasattr(ops, "quant_linear"):
        log.warning("%d quantized linear layers dequantize their weights at every call: the CPU kernels are not "
                    "available here", len(layers))
        return 0
    dtype = model.embed_tokens.weight.dtype if hasattr(model, "embed_tokens") else None
    for m in layers:
        m.use_kernels(ops, dtype)
    tiles = sum(m.tiles for m in layers)
    log.info("%d %s linear layers on the quantized kernel (%s; %d in the tile unit's order), %.0f MiB of weights and "
             "scales", len(layers), layers[0].method, ops.quant_linear_kernel(), tiles,
             sum(m.weight.nbytes + m.weight_scale.nbytes for m in layers) / 2**20)
    if fused := fuse_swiglu(model):
        log.info("%d MLPs take their gate and up layers and SwiGLU in one call (quant_linear_tiles_swiglu)", fused)
    return len(layers)
