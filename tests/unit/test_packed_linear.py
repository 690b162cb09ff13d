"""oneDNN pre-packed bf16 linear layers give the same bits as F.linear, and an engine
with them gives the same greedy tokens as one without (engine/models/packed.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.models.packed import PackedLinear, can_pack, pack_linears

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
