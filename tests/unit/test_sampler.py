"""Sampler semantics on hand-made logits: greedy, temperature, top-k / top-p / min-p,
seeds, logprobs, penalties, banned tokens."""

import math

import pytest
import torch

from engine.plan import SampleRow
from engine.sampler import Sampler, mix_seed
from engine.sampling_params import SamplingParams, SamplingParamsError

pytestmark = pytest.mark.unit


def row(output_ids=(), prompt_ids=(), banned=(), **kw):
    return SampleRow(SamplingParams(**kw), list(output_ids), list(prompt_ids), tuple(banned))


@pytest.fixture
def sampler():
    return Sampler(torch.device("cpu"), seed=0)


def test_greedy_is_argmax_first_on_ties(sampler):
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 2.0, 5.0]])
    out = sampler(logits, [row(temperature=0), row(top_k=1)])
    assert out.token_ids == [1, 0] and out.logprobs == [None, None]


def test_top_k_top_p_min_p_restrict_the_support(sampler):
    # probabilities ~ [0.64, 0.24, 0.09, 0.03]
    logits = torch.log(torch.tensor([[0.64, 0.24, 0.09, 0.03]])).repeat(400, 1)
    for params, allowed in (
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.8}, {0, 1}),
        ({"top_p": 0.5}, {0}),
        ({"min_p": 0.2}, {0, 1}),
        ({"min_p": 0.1}, {0, 1, 2}),
    ):
        out = sampler(logits, [row(temperature=1.0, **params)] * 400)
        assert set(out.token_ids) == allowed, params


def test_temperature_sampling_follows_the_distribution():
    s = Sampler(torch.device("cpu"), seed=123)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    out = s(torch.log(p).repeat(n, 1), [row(temperature=1.0)] * n).token_ids
    freq = torch.bincount(torch.tensor(out), minlength=4).float() / n
    assert torch.allclose(freq, p, atol=0.015), freq
    # temperature 0.5 sharpens: p^2 renormalised
    out = s(torch.log(p).repeat(n, 1), [row(temperature=0.5)] * n).token_ids
    freq = torch.bincount(torch.tensor(out), minlength=4).float() / n
    assert torch.allclose(freq, p**2 / (p**2).sum(), atol=0.015), freq


def test_seeded_rows_ignore_batch_composition_and_advance_by_index():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    a = Sampler(torch.device("cpu"), seed=1)(logits, [row(temperature=1.0, seed=42, output_ids=[9] * 3)])
    crowd = Sampler(torch.device("cpu"), seed=2)(
        logits.repeat(3, 1),
        [row(temperature=1.0), row(temperature=1.0, seed=42, output_ids=[7] * 3), row(temperature=0.7, seed=5)],
    )
    assert crowd.token_ids[1] == a.token_ids[0]  # same seed, same token index: same draw
    draws = {
        Sampler(torch.device("cpu"))(logits, [row(temperature=1.0, seed=42, output_ids=[0] * k)]).token_ids[0]
        for k in range(20)
    }
    assert len(draws) > 5  # each token index gets its own draw
    assert mix_seed(42, 0) != mix_seed(42, 1) != mix_seed(43, 0)


def test_logprobs_are_the_models_distribution(sampler):
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    out = sampler(logits, [row(temperature=0, logprobs=2, repetition_penalty=2.0, output_ids=[0])])
    lp = torch.log_softmax(logits, -1)[0]
    got = out.logprobs[0]
    # the penalty moved the argmax (2.0 / 2 = 1.0 ties index 1; first wins) but logprobs stay raw
    assert got.token_id == out.token_ids[0] == 0
    assert math.isclose(got.logprob, float(lp[0]), rel_tol=1e-6)
    assert [t for t, _ in got.top] == [0, 1] and math.isclose(got.top[1][1], float(lp[1]), rel_tol=1e-6)


def test_repetition_penalty_follows_transformers_semantics(sampler):
    logits = torch.tensor([[2.0, -2.0, 1.5, 0.0]])
    # token 0 (positive) is divided, token 1 (negative) multiplied: 1.0 / -4.0; 2 wins
    assert sampler(logits, [row(temperature=0, repetition_penalty=2.0, prompt_ids=[1], output_ids=[0])]).token_ids == [
        2
    ]


def test_presence_and_frequency_penalties_count_output_tokens(sampler):
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    # token 0 appeared twice: 3.0 - 0.5 - 2 * 0.1 = 2.3 < 2.9
    assert sampler(
        logits, [row(temperature=0, presence_penalty=0.5, frequency_penalty=0.1, output_ids=[0, 0])]
    ).token_ids == [1]
    # prompt tokens do not count for presence / frequency
    assert sampler(logits, [row(temperature=0, presence_penalty=2.0, prompt_ids=[0])]).token_ids == [0]


def test_banned_tokens_are_never_sampled(sampler):
    logits = torch.tensor([[9.0, 1.0, 0.5]]).repeat(200, 1)
    out = sampler(logits, [row(temperature=2.0, banned=[0])] * 200)
    assert 0 not in out.token_ids
    assert sampler(logits[:1], [row(temperature=0, banned=[0])]).token_ids == [1]


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": ("",)}, "stop"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_invalid_params_name_the_field(kw, param):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kw)
    assert e.value.param == param


def test_grammar_engine_failures_are_one_line_errors_and_size_is_bounded():
    """A panic inside the grammar engine (pyo3's PanicException, a BaseException) or any
    of its errors becomes a GrammarError of one line; a spec over the limit is refused
    before the compile runs."""
    from engine.config import GrammarLimits
    from engine.sampling_params import GrammarError, GuidedSpec
    from engine.structured import bounded

    class PanicException(BaseException):  # the name pyo3 gives a Rust panic
        pass

    def panics():
        raise PanicException("thread '<unnamed>' panicked at src/lib.rs:1:1:\nstack backtrace:\n  0: ...")

    spec, limits = GuidedSpec("regex", "a+"), GrammarLimits(max_spec_bytes=16)
    with pytest.raises(GrammarError, match=r"^the grammar engine failed on this spec") as e:
        bounded(spec, limits, panics)
    assert "\n" not in str(e.value) and "backtrace" not in str(e.value)
    with pytest.raises(GrammarError, match=r"^bad regex$"):
        bounded(spec, limits, lambda: (_ for _ in ()).throw(ValueError("bad regex\n  at char 3")))
    ran = []
    with pytest.raises(GrammarError, match=r"the spec is 20 bytes, over this server's limit of 16 \(--max-grammar"):
        bounded(GuidedSpec("regex", "a" * 20), limits, lambda: ran.append(1))
    assert ran == []
    with pytest.raises(KeyboardInterrupt):  # other BaseExceptions pass through
        bounded(spec, limits, lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
