"""The compiled greedy argmax (engine/cpu_kernels/argmax.cpp) against torch's max over the
last dim, which the sampler used before: the same index on every row, ties to the first
maximum, a NaN row to its first NaN, all -inf rows to index 0, and rows that are not a
multiple of the kernel's 32-wide chunks. The sampler's greedy path takes it on CPU."""

import pytest
import torch

from engine.plan import SampleRow
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(200, 32000), (1, 16000), (3, 31), (5, 33), (7, 1000), (2, 64), (4, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_greedy_argmax_equals_torch_max_indices(build_ops, dtype, rows, vocab):
    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=g).to(dtype)
    top = x[0].max()
    for at in (vocab // 2, vocab // 3, vocab - 1):  # ties in the first row: the first wins
        x[0, at] = top
    assert torch.equal(build_ops.greedy_argmax(x), x.max(dim=-1).indices)
    # a strided row view (the logits of a step's last rows): rows need only be contiguous
    wide = torch.randn(rows, vocab + 7, generator=g).to(dtype)
    assert torch.equal(build_ops.greedy_argmax(wide[:, 3:3 + vocab]), wide[:, 3:3 + vocab].max(dim=-1).indices)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [16000, 45, 3])
def test_nan_rows_answer_their_first_nan_and_flat_rows_their_first_index(build_ops, dtype, vocab):
    x = torch.randn(4, vocab).to(dtype)
    x[1, vocab - 1] = float("nan")
    x[1, vocab // 2] = float("nan")
    x[2] = float("-inf")
    x[3] = 2.5
    got = build_ops.greedy_argmax(x)
    assert torch.equal(got, x.max(dim=-1).indices)
    assert got[1:].tolist() == [vocab // 2, 0, 0]


def test_greedy_argmax_rejects_what_it_cannot_read(build_ops):
    with pytest.raises(RuntimeError, match="rows contiguous"):
        build_ops.greedy_argmax(torch.randn(8, 4).t())
    with pytest.raises(RuntimeError, match="fp32/bf16/fp16"):
        build_ops.greedy_argmax(torch.zeros(2, 4, dtype=torch.int32))


def test_the_samplers_greedy_path_uses_the_kernel_and_answers_the_same(build_ops):
    sampler = Sampler(torch.device("cpu"), seed=0)
    assert sampler.cpu_ops is not None
    logits = torch.randn(6, 5000).bfloat16()
    logits[2, 17] = logits[2, 4000] = logits[2].max() + 1  # a tie
    rows = [SampleRow(SamplingParams(temperature=0.0), []) for _ in range(6)]
    assert sampler(logits, rows).token_ids == logits.max(dim=-1).indices.tolist()
