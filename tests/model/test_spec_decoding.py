"""Speculative decoding in the engine, on the trained built-in pair: greedy outputs equal
transformers' token for token with each proposer, across block boundaries, with chunked
prefill, prefix-cache hits and preemption; seeded sampling reproducible; grammar masks
on the verified positions; max_tokens, stop ids and logprobs exact; no block leaked."""

from __future__ import annotations

import json

import pytest

from decode_worker.llm import LLM
from engine.models.builtin import builtin_draft_path
from engine.models.writer import random_model_path
from engine.sampling_params import GuidedSpec, SamplingParams
from tests.oracle import hf_greedy, random_prompts

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_thread")]

METHODS = ["ngram", "suffix", "draft"]
CODE = [
    "def parse_header(line):\n    \"\"\"Split a header line into its name and value.\"\"\"\n    name, _, value =",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items."
    "append(item)\n\n    def pop(self):\n        return self.items.",
    "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n    for",
    # "edit or repeat this code": prompt lookup's best case
    "x = [1, 2, 3]\nfor i in range(len(x)):\n    print(i, x[i])\n\n# the same loop again:\nx = [1, 2, 3]\nfor",
]


@pytest.fixture(scope="module")
def prompts(builtin_dir):
    from engine.models.checkpoint import load_checkpoint

    tok = load_checkpoint(builtin_dir).tokenizer
    return [tok.encode(p) for p in CODE] + random_prompts([7, 19], seed=5)


def _llm(builtin_dir, method: str | None, k: int = 4, adaptive: bool = False, **kw) -> LLM:
    spec = None
    if method is not None:
        spec = {"method": method, "num_speculative_tokens": k, "adaptive": adaptive}
    kw = {"block_size": 8, "max_num_batched_tokens": 48, "num_threads": 1, **kw}
    return LLM(model=str(builtin_dir), speculative_config=spec, **kw)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _clean(llm: LLM) -> None:
    eng = llm.engine
    eng.check_integrity()
    assert eng.pool.num_free_blocks == eng.pool.num_blocks


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_transformers_with_chunks_blocks_and_prefix_hits(builtin_dir, prompts, method):
    llm = _llm(builtin_dir, method)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = [hf_greedy(builtin_dir, p, 40, ignore_eos=True) for p in prompts]
    assert _ids(llm.generate(prompts, greedy, use_tqdm=False)) == want
    st = llm.engine.spec.stats
    assert st.num_accepted_tokens > 0 and st.num_drafts > 0, st  # it did speculate, and some drafts were kept
    assert st.num_accepted_tokens < st.num_draft_tokens or method == "ngram", st
    # again: every prompt now hits the prefix cache
    again = llm.generate(prompts, greedy, use_tqdm=False)
    assert _ids(again) == want and all(o.num_cached_tokens > 0 for o in again[:4])
    _clean(llm)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_transformers_after_preemption(builtin_dir, prompts, method):
    # 30 blocks of 8 tokens for 6 sequences of 60-110 tokens each: they preempt each other
    llm = _llm(builtin_dir, method, num_blocks=30, enable_prefix_caching=False)
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    out = llm.generate(prompts, greedy, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert _ids(out) == [hf_greedy(builtin_dir, p, 48, ignore_eos=True) for p in prompts]
    _clean(llm)


def test_seeded_sampling_is_reproducible_and_keeps_drafting(builtin_dir, prompts):
    params = [SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    a = _ids(_llm(builtin_dir, "ngram").generate(prompts, params, use_tqdm=False))
    llm = _llm(builtin_dir, "ngram")
    b = _ids(llm.generate(prompts, params, use_tqdm=False))
    assert a == b
    assert llm.engine.spec.stats.num_accepted_tokens > 0
    other = [SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)] * len(prompts)
    assert _ids(llm.generate(prompts, other, use_tqdm=False)) != a
    _clean(llm)


def test_max_tokens_stop_ids_logprobs_and_opt_out_are_exact(builtin_dir, prompts):
    base = _llm(builtin_dir, None)
    spec = _llm(builtin_dir, "suffix")
    ref = _ids(base.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                             use_tqdm=False))
    # max_tokens lands inside a verified draft: exactly that many tokens
    for n in (1, 2, 7):
        out = _ids(spec.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                                 use_tqdm=False))
        assert out == [r[:n] for r in ref]
    # a stop id inside a kept draft ends the output right there
    stops = [r[9] for r in ref]
    for p, r, s in zip(prompts, ref, stops):
        o = spec.generate([p], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=(s,)),
                          use_tqdm=False)[0].outputs[0]
        assert o.token_ids == r[: r.index(s) + 1] and o.finish_reason == "stop"
    # logprobs of each emitted token equal the non-speculative ones
    lp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    a = base.generate(prompts[:3], lp, use_tqdm=False)
    b = spec.generate(prompts[:3], lp, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for u, v in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert u.token_id == v.token_id and abs(u.logprob - v.logprob) < 1e-4
            assert [t for t, _ in u.top] == [t for t, _ in v.top]
    # a request that opts out is never drafted for
    before = spec.engine.spec.stats.num_draft_tokens
    out = spec.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, speculative=False),
                        use_tqdm=False)
    assert _ids(out) == ref and spec.engine.spec.stats.num_draft_tokens == before
    _clean(spec)


def test_grammar_masks_the_verified_positions(builtin_dir, prompts):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "size": {"type": "integer"}}, "required": ["name", "size"],
              "additionalProperties": False}
    params = SamplingParams(max_tokens=60, temperature=0, guided=GuidedSpec.json_schema(schema))
    base = _llm(builtin_dir, None)
    for method in ("ngram", "draft"):
        spec = _llm(builtin_dir, method)
        want = base.generate(prompts, params, use_tqdm=False)
        got = spec.generate(prompts, params, use_tqdm=False)
        assert _ids(got) == _ids(want)
        for o in got:
            doc = json.loads(o.outputs[0].text)
            assert set(doc) == {"name", "size"} and isinstance(doc["size"], int)
        assert spec.engine.spec.stats.num_draft_tokens > 0
        _clean(spec)


def test_adaptive_keeps_outputs_and_speculates_at_one_stream(builtin_dir, prompts):
    llm = _llm(builtin_dir, "ngram", adaptive=True)
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    for p in prompts[:4]:  # one stream at a time
        assert _ids(llm.generate([p], greedy, use_tqdm=False)) == [hf_greedy(builtin_dir, p, 48, ignore_eos=True)]
    assert llm.engine.spec.policy.chooser.buckets[1][1] > 0  # one stream measured both ways, in pairs
    assert llm.engine.spec.stats.num_accepted_tokens > 0
    _clean(llm)


def test_the_draft_must_share_the_tokenizer(builtin_dir, llama_dir):
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match="speculative-model"):
        LLM(model=str(llama_dir), speculative_config={"method": "draft"})
    # tandem-tiny-v1 has the vocabulary's size but another tokenizer
    with pytest.raises(ConfigError, match="tokenizer differs"):
        LLM(model=str(builtin_dir), speculative_config={"method": "draft", "model": str(random_model_path())})
    assert builtin_draft_path().is_dir()
