"""The grouped Triton expert kernels (engine/models/moe_triton.py) against a loop over
experts: the pairs laid out by expert with padding, experts that get no token, a token
whose experts are another rank's (expert parallelism: skipped, zero), the SwiGLU between
the two grouped matmuls and the routing weights. Without CUDA they run under the Triton
interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests import triton_env

pytestmark = pytest.mark.unit

_, DEVICE = triton_env.kernels_or_skip()


def loop(x, w13, w2, experts, weights):
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for e, w in zip(experts[t].tolist(), weights[t].tolist()):
            if 0 <= e < w13.shape[0]:
                h = w13[e].float() @ x[t].float()
                out[t] += (w2[e].float() @ (F.silu(h[:inter]) * h[inter:])) * w
    return out


def test_align_groups_pairs_by_expert_in_padded_blocks():
    from engine.models.moe_triton import align

    experts = torch.tensor([2, 0, 2, 5, 2, 0])  # 5: not an expert held here
    sorted_ids, block_expert, counts = align(experts, 3, 4)
    assert counts.tolist() == [2, 0, 3]
    assert sorted_ids.tolist()[:8] == [1, 5, -1, -1, 0, 2, 4, -1]  # expert 0's pairs, then expert 2's
    assert block_expert.tolist()[:2] == [0, 2] and all(b == -1 for b in block_expert.tolist()[2:])


@pytest.mark.parametrize("tokens,block_m,use_dot", [(1, 16, False), (7, 16, False), (40, 32, False), (7, 16, True)])
def test_fused_experts_equal_a_loop_over_experts(tokens, block_m, use_dot):
    from engine.models.moe_triton import fused_experts

    g = torch.Generator().manual_seed(tokens)
    e, h, i, k = 6, 48, 40, 2
    x = torch.randn(tokens, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    experts = torch.stack([torch.randperm(e + 2, generator=g)[:k] for _ in range(tokens)])  # ids 6, 7: elsewhere
    weights = torch.rand(tokens, k, generator=g)
    got, _ = fused_experts(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), experts.to(DEVICE), weights.to(DEVICE),
                        block_m=block_m, use_dot=use_dot)
    torch.testing.assert_close(got.cpu(), loop(x, w13, w2, experts, weights), atol=1e-4, rtol=1e-4)
