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


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` with W held in oneDNN's packed layout (the plain copy is freed)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias,
                                               "none", [], "")
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module, head_weight: torch.Tensor | None = None) -> int:
    """Replace every nn.Linear of `model` by a PackedLinear; returns how many. A model
    whose output head is its (tied) embedding passes that weight as `head_weight`: the
    head gets a packed copy of its own under `model.lm_head`."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear)]
    with torch.no_grad():
        for parent, name, child in swaps:
            setattr(parent, name, PackedLinear(child.weight, child.bias))
        if head_weight is not None:
            model.lm_head = PackedLinear(head_weight, None)
    n = len(swaps) + (head_weight is not None)
    log.info("packed %d bf16 linear layers for oneDNN", n)
    return n
