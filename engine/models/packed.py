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

Steps of one to four tokens (a few streams' decode) go to tandem's own kernel instead
(engine/cpu_kernels/linear.cpp): with its weight stream prefetched ahead, small's layers
took 1.2-1.6x less time than oneDNN's at one to four tokens on the Intel AMX machine,
about the same at six and more at eight (docs/performance.md, twentieth round). It
needs that row-major copy next to the packed one, so it is used when the extra memory
is small: `TANDEM_CPU_SMALL_BATCH_LINEAR=auto` (the default) keeps the
copies when they take at most 1/8 of the machine's memory, `1` always, `0` never. A
tied output head reads the embedding itself and costs nothing extra.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine import envs

log = logging.getLogger(__name__)


def can_pack(model: nn.Module, device: torch.device) -> bool:
    if device.type != "cpu" or not envs.cpu_packed_weights():
        return False
    if next(model.parameters()).dtype is not torch.bfloat16:
        return False
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_is_mkldnn_bf16_supported") and bool(mkldnn._is_mkldnn_bf16_supported()))


SMALL_BATCH_ROWS = 4  # steps of at most this many tokens use the small-batch kernel


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` with W held in oneDNN's packed layout, and, when `keep_plain`
    and the small-batch kernel `ops` is given, also row-major for steps of up to
    SMALL_BATCH_ROWS tokens. Otherwise the plain copy is freed."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops=None, keep_plain: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        self.bias = None if bias is None else bias.detach().clone()
        self.plain = weight.detach().contiguous() if ops is not None and keep_plain else None
        self._small = ops.small_batch_linear if self.plain is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self._small is not None and x2.shape[0] <= SMALL_BATCH_ROWS:
            y = x2.new_empty(x2.shape[0], self.out_features)
            self._small(y, x2.contiguous(), self.plain, self.bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def small_batch_ops():
    """The compiled kernels when this machine runs the small-batch linear kernel, else None."""
    from engine.cpu_kernels import build

    ops = build.load_or_none()
    return ops if ops is not None and ops.small_batch_linear_supported() else None


def keep_plain_copies(extra_bytes: int) -> bool:
    """Whether to keep row-major copies of `extra_bytes` for the small-batch kernel."""
    mode = envs.cpu_small_batch_linear()
    if mode != "auto":
        return mode == "on"
    return extra_bytes <= envs.physical_memory_bytes() // 8


def pack_linears(model: nn.Module, head_weight: torch.Tensor | None = None, small_batch: bool = True) -> int:
    """Replace every nn.Linear of `model` by a PackedLinear; returns how many. A model
    whose output head is its (tied) embedding passes that weight as `head_weight`: the
    head gets a packed copy of its own under `model.lm_head`. `small_batch=False` keeps
    no row-major copies whatever the environment says (a prefill worker)."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear)]
    extra = sum(child.weight.numel() * child.weight.element_size() for _, _, child in swaps)
    ops = small_batch_ops() if small_batch and envs.cpu_small_batch_linear() != "off" else None
    keep = ops is not None and keep_plain_copies(extra)
    with torch.no_grad():
        for parent, name, child in swaps:
            setattr(parent, name, PackedLinear(child.weight, child.bias, ops, keep))
        if head_weight is not None:  # the embedding stays anyway: its row-major copy is free
            model.lm_head = PackedLinear(head_weight, None, ops, ops is not None)
    n = len(swaps) + (head_weight is not None)
    log.info("packed %d bf16 linear layers for oneDNN; %s", n,
             f"steps of up to {SMALL_BATCH_ROWS} tokens on the small-batch kernel "
             f"({extra / 2**20:.0f} MiB of row-major copies)"
             if keep else "small-batch kernel off")
    return n
