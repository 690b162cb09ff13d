"""bf16 linear layers on CPU with weights pre-packed once for oneDNN.

`F.linear` on a bf16 CPU tensor re-lays the weight out for the matmul kernel on every
call; at decode batch sizes (a handful of rows) that costs more than the product
itself. oneDNN can pack the weight once, at load time, into the blocked layout its
bf16 kernels (AVX512-BF16 / AMX) read, and then each call only streams the packed
bytes. Measured on the 2-core development machine (docs/performance.md): all the
linear layers of the 200M test model at batch 1 went from 20 ms to 14 ms, those of the
11M model from 1.2 ms to 0.5 ms; the results are the same bits as `F.linear`'s.

Used only where it pays and is exact: CPU, bf16 weights, a PyTorch built with oneDNN
that reports native bf16 support. `TANDEM_CPU_PACKED_WEIGHTS=0` turns it off.

Decode steps also take tandem's own kernels (engine/cpu_kernels/linear.cpp), each on a
second copy of the weights laid out for it:
- where the CPU has AMX tiles, the tile kernel for steps of up to TILE_ROWS tokens, on a
  copy in tile order. It prefetches its weight stream ahead and, like oneDNN, runs on
  the tile unit: small's 61 linear layers at one to 16 tokens took 17-22 ms against
  oneDNN's 32-36 (and the row-major kernel's 23-26 at one to four), at 200 tokens 95
  against 121, at 256 and 384 the same (docs/performance.md, twenty-first round). Its
  results equal F.linear's bits up to 32 rows, and are one bf16 step apart in about 1 in
  10,000 outputs above (oneDNN's order of additions changes there; the kernel's does
  not, so a row's result never depends on the rows beside it);
- elsewhere with AVX512-BF16, the row-major kernel for steps of one to four tokens
  (SMALL_BATCH_ROWS), on a row-major copy: 1.2-1.6x less time than oneDNN's on the
  Intel AMX machine before the tile kernel, the same at six, slower at eight.
The copies are kept when the extra memory is small: `TANDEM_CPU_SMALL_BATCH_LINEAR=auto`
(the default) keeps them when they take at most 1/8 of the machine's memory, `1`
always, `0` never. `TANDEM_CPU_TILE_LINEAR=0` takes the row-major kernel where the tile
kernel would run. A tied output head's row-major copy is the embedding itself, free.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine import envs

log = logging.getLogger(__name__)


def can_pack(model: nn.Module, device: torch.device) -> bool:
    if device.type != "cpu" or not envs.cpu_packed_weights():
        return False
    if next(model.parameters()).dtype is not torch.bfloat16:
        return False
    return native_bf16()


def native_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls natively here (AVX512-BF16 or AMX, and a torch
    built with oneDNN); elsewhere torch's bf16 matmul is emulated, and slow."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_is_mkldnn_bf16_supported") and bool(mkldnn._is_mkldnn_bf16_supported()))


SMALL_BATCH_ROWS = 4  # steps of at most this many tokens use the row-major kernel
TILE_ROWS = 256  # steps of at most this many tokens use the tile kernel (AMX)


def tileable(weight: torch.Tensor) -> bool:
    """Whether the tile kernel takes this weight: both dimensions multiples of 32."""
    return weight.dim() == 2 and weight.shape[0] % 32 == 0 and weight.shape[1] % 32 == 0


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` with W held in oneDNN's packed layout and, when `keep_copy` and
    the compiled kernels `ops` are given, a second copy for decode steps: in tile order
    when `ops.tile_linear` runs here and takes W's shape (steps of up to TILE_ROWS
    tokens), else row-major (up to SMALL_BATCH_ROWS). `ops` None or `keep_copy` False:
    oneDNN alone."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops=None, keep_copy: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        w = weight.detach().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w)
        self.bias = None if bias is None else bias.detach().clone()
        self.plain = self.tiles = None
        self._small = self._tile = None
        if ops is not None and keep_copy:
            if tile_kernel_on(ops) and tileable(w):
                self.tiles, self._tile = ops.tile_pack_linear_weight(w), ops.tile_linear
            else:
                self.plain, self._small = w, ops.small_batch_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        if self._tile is not None and rows <= TILE_ROWS:
            y = x2.new_empty(rows, self.out_features)
            self._tile(y, x2.contiguous(), self.tiles, self.bias)
        elif self._small is not None and rows <= SMALL_BATCH_ROWS:
            y = x2.new_empty(rows, self.out_features)
            self._small(y, x2.contiguous(), self.plain, self.bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def tile_kernel_on(ops) -> bool:
    """Whether linear layers take the tile kernel here: the build and the CPU have AMX
    tiles (and the kernel granted them), and TANDEM_CPU_TILE_LINEAR is not 0."""
    return envs.cpu_tile_linear() != "off" and bool(ops.tile_linear_supported())


def small_batch_ops():
    """The compiled kernels when this machine runs the small-batch linear kernel, else None."""
    from engine.cpu_kernels import build

    ops = build.load_or_none()
    return ops if ops is not None and ops.small_batch_linear_supported() else None


def keep_plain_copies(extra_bytes: int) -> bool:
    """Whether to keep second copies of `extra_bytes` for the decode-step kernels."""
    mode = envs.cpu_small_batch_linear()
    if mode != "auto":
        return mode == "on"
    return extra_bytes <= envs.physical_memory_bytes() // 8


class PlainLinear(nn.Module):
    """`y = x @ W.T + b` on the checkpoint's own row-major weight, where oneDNN has no
    packed layout to offer: fp32 weights, and bf16 weights on CPUs without native bf16
    (AVX2). Steps of up to SMALL_BATCH_ROWS tokens take the compiled row-major kernel
    (linear.cpp: fp32 as it is, bf16 widened to fp32 in registers), F.linear the rest;
    bf16 weights where oneDNN has no native bf16 take the kernel at every size (it tiles
    W through L2 above four rows), since torch's emulated bf16 matmul is several times
    slower there.
    No second copy: the kernel reads the weight where it is. `packed` and `plain` name
    that same weight, as the decode-layers operator reads them (it sends a plain weight
    to at::linear above the kernel's rows)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = weight if weight.is_contiguous() else nn.Parameter(weight.detach().contiguous(),
                                                                         requires_grad=False)
        self.bias = bias
        self.packed = self.plain = self.weight.data  # the same storage, not registered again
        self.tiles = None
        self._small = ops.small_batch_linear
        # the most rows a step sends to the kernel (decode_layers reads it too)
        self.max_rows = SMALL_BATCH_ROWS if weight.dtype != torch.bfloat16 or native_bf16() else 1 << 62

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= self.max_rows and x2.dtype == self.weight.dtype:
            y = x2.new_empty(x2.shape[0], self.out_features)
            self._small(y, x2.contiguous(), self.weight, self.bias)
            return y.reshape(*shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def plain_kernel_ops(model: nn.Module, device: torch.device):
    """The compiled kernels where linear layers that oneDNN does not pack take PlainLinear:
    a CPU, a build whose row-major kernel takes the model's dtype (fp32 in every x86-64
    build; bf16 in those too, widened), TANDEM_CPU_SMALL_BATCH_LINEAR not 0. Else None."""
    if device.type != "cpu" or envs.cpu_small_batch_linear() == "off" or not envs.cpu_fused_ops():
        return None
    from engine.cpu_kernels import build

    ops = build.load_or_none()
    if ops is None or not hasattr(ops, "small_batch_linear_kernel") or ops.small_batch_linear_kernel() == "none":
        return None
    dtype = next(model.parameters()).dtype
    return ops if dtype in (torch.float32, torch.bfloat16) else None


def plain_linears(model: nn.Module, ops, head_weight: torch.Tensor | None = None) -> int:
    """Replace every nn.Linear of `model` by a PlainLinear (and give a tied head, passed
    as `head_weight`, one under `model.lm_head`); returns how many."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear)]
    with torch.no_grad():
        for parent, name, child in swaps:
            setattr(parent, name, PlainLinear(child.weight, child.bias, ops))
        if head_weight is not None:
            model.lm_head = PlainLinear(head_weight, None, ops)
    n = len(swaps) + (head_weight is not None)
    log.info("%d %s linear layers take the row-major kernel (%s) for steps of up to %d tokens", n,
             str(next(model.parameters()).dtype).removeprefix("torch."), ops.small_batch_linear_kernel()
             if next(model.parameters()).dtype is torch.bfloat16 else "fp32", SMALL_BATCH_ROWS)
    return n


def pack_linears(model: nn.Module, head_weight: torch.Tensor | None = None, small_batch: bool = True) -> int:
    """Replace every nn.Linear of `model` by a PackedLinear; returns how many. A model
    whose output head is its (tied) embedding passes that weight as `head_weight`: the
    head gets a packed copy of its own under `model.lm_head`. `small_batch=False` keeps
    no second copies whatever the environment says (a prefill worker)."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear)]
    ops = small_batch_ops() if small_batch and envs.cpu_small_batch_linear() != "off" else None
    tiles = ops is not None and tile_kernel_on(ops)
    weights = [child.weight for _, _, child in swaps]
    if head_weight is not None and tiles and tileable(head_weight):  # a row-major head copy would be free
        weights.append(head_weight)
    extra = sum(w.numel() * w.element_size() for w in weights)
    keep = ops is not None and keep_plain_copies(extra)
    with torch.no_grad():
        for parent, name, child in swaps:
            setattr(parent, name, PackedLinear(child.weight, child.bias, ops, keep))
        if head_weight is not None:
            model.lm_head = PackedLinear(head_weight, None, ops, keep or (ops is not None and not tiles))
    n = len(swaps) + (head_weight is not None)
    if not keep:
        how = "decode-step kernels off"
    elif tiles:
        how = f"steps of up to {TILE_ROWS} tokens on the tile kernel ({extra / 2**20:.0f} MiB of tile-order copies)"
    else:
        how = f"steps of up to {SMALL_BATCH_ROWS} tokens on the row-major kernel ({extra / 2**20:.0f} MiB of copies)"
    log.info("packed %d bf16 linear layers for oneDNN; %s", n, how)
    return n
