"""Tensor parallelism in one engine (colocated): two CPU ranks, the second a child
process following rank 0's steps over the shared-memory all-reduce. Greedy ids equal
transformers' on random checkpoints whose KV heads split (Llama, 2 KV heads; Qwen2
with q/k/v biases; Qwen3-MoE and Mixtral, each expert split by its intermediate size; Phi-3's fused
q/k/v and gate/up, split into their weights before the ranks take their rows; Gemma 2's
soft caps, the logits' after the ranks' columns are gathered)
and replicate (Llama, 1 KV head), through chunked prefill, a
prefix-cache hit and preemptions, and on the trained built-in model with n-gram
speculation; a rank that dies fails the next step with a
reason, not a hang."""

from __future__ import annotations

import os
import signal

import pytest

from decode_worker.llm_engine import LLMEngine
from engine.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
from engine.parallel.comm import RankLost
from engine.sampling_params import SamplingParams
from tests.model.conftest import _write_hf
from tests.model.test_exactness import run as run_to_end
from tests.oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.model

NEW = 24


@pytest.fixture(scope="session")
def llama_kv1_dir(tmp_path_factory, builtin_dir):
    """Llama with one KV head: two ranks both hold it (replicated)."""
    return _write_hf("llama", tmp_path_factory.mktemp("hf-llama-kv1"), builtin_dir, kv_heads=1)


def tp_engine(path, size=2, spec=None, comm="auto", blocks=40, vocab_parallel=True, ep=False, **tiers):
    return LLMEngine.from_config(EngineConfig(
        model=str(path), cache=CacheConfig(block_size=16, num_blocks=blocks, **tiers),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=1024),
        speculative=SpeculativeConfig(method=spec, adaptive=False) if spec else SpeculativeConfig(),
        parallel=ParallelConfig(tensor_parallel_size=size, comm=comm, vocab_parallel_head=vocab_parallel,
                                enable_expert_parallel=ep)))


def run(engine: LLMEngine, prompts, params):
    """(token ids, usage) per prompt (tests/model/test_exactness.py's run, which also checks for leaks)."""
    usage: list = []
    return run_to_end(engine, prompts, params, usage), usage


def prompts_with_cases():
    """Long prompts (chunked at 64 tokens a step), one that shares 100 tokens with
    another (a prefix hit), one that repeats itself (n-gram drafts get accepted); 40
    blocks of 16 tokens cannot hold them all at once (preemptions)."""
    ps = random_prompts([5, 140, 77, 200, 33], seed=3)
    ps.append(ps[1][:100] + [7, 8, 9])
    ps.append(random_prompts([8], seed=9)[0] * 6)
    return ps


@pytest.mark.parametrize("which,spec,ep", [
    ("llama_dir", None, False), ("llama_kv1_dir", None, False), ("qwen2_dir", None, False),
    ("builtin_dir", "ngram", False), ("qwen3_moe_dir", None, False), ("mixtral_dir", None, False),
    ("phi3_dir", None, False), ("qwen3_moe_dir", None, True), ("mixtral_dir", None, True),
    ("gemma2_dir", None, False), ("qwen2_moe_dir", None, True)])
def test_two_ranks_match_transformers(which, spec, ep, request):
    """`ep`: --enable-expert-parallel, each rank holding half the experts whole."""
    path = request.getfixturevalue(which)
    # Gemma 2's blocks hold one of its two layers (KV groups, engine/kv_groups.py) and its
    # windowed layer's go back early, into the cache's LRU: 67 (66 to 68 do) keep the
    # prefix hit's window cached and still preempt
    engine = tp_engine(path, spec=spec, ep=ep, blocks=67 if which == "gemma2_dir" else 40)
    try:
        assert engine.runner.tp is not None and engine.runner.tp.size == 2
        local = engine.runner.model_config
        assert local.num_kv_heads == 1  # 2 KV heads split in two, or 1 held by both ranks
        if ep:  # rank 0 holds experts 0 and 1 of 4, each whole
            assert local.expert_range == range(0, 2) and local.moe_intermediate_size == {
                "qwen3_moe_dir": 64, "mixtral_dir": 256, "qwen2_moe_dir": 64}[which]
        prompts = prompts_with_cases()
        got, usage = run(engine, prompts, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
        for p, g in zip(prompts, got):
            assert g == hf_greedy(path, p, NEW, ignore_eos=True)
        assert engine.scheduler.num_preemptions > 0 or spec
        assert usage[5].cached_tokens >= 96  # the prompt sharing 100 tokens with prompt 1
        if spec:  # the trained built-in model repeats itself: drafts get accepted
            assert sum(u.accepted_tokens for u in usage) > 0
    finally:
        engine.runner.close()


@pytest.mark.parametrize("comm,vocab_parallel", [("torch", True), ("shm", False)], ids=["gloo", "whole-head"])
def test_gloo_and_a_head_on_every_rank_give_the_same_tokens(llama_dir, comm, vocab_parallel):
    """gloo in place of the shared-memory collectives (the comparison docs/performance.md
    makes), and the LM head whole on every rank instead of split by vocabulary; prompt
    logprobs too, which rank 0 computes from gathered logits."""
    engine = tp_engine(llama_dir, comm=comm, blocks=64, vocab_parallel=vocab_parallel)
    try:
        assert (engine.runner.model.vocab_comm is not None) == vocab_parallel
        prompts = random_prompts([9, 70], seed=5)
        got, _ = run(engine, prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert got == [hf_greedy(llama_dir, p, 8, ignore_eos=True) for p in prompts]
        got = prompt_logprobs(engine, prompts[1])
        want = prompt_logprobs(tp_engine(llama_dir, size=1, blocks=64), prompts[1])  # one rank, the same weights
        assert [lp.token_id for lp in got] == [lp.token_id for lp in want] and len(got) == len(prompts[1]) - 1
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got, want)) < 1e-4
        assert [lp.top[0][0] for lp in got] == [lp.top[0][0] for lp in want]
    finally:
        engine.runner.close()


def test_kv_tiers_under_two_ranks(llama_dir, tmp_path):
    """Every rank keeps its share of a block in its own host slots and files, moved in
    rank 0's order: prefixes back from host memory and disk, swapped preemptions, and
    the tokens transformers gives."""
    block = 2 * 2 * 16 * 2 * 32 * 4  # the worker's bytes a block: layers, K and V, tokens, KV heads, dims, fp32
    engine = tp_engine(llama_dir, blocks=24, offload_host_gb=6 * block / 2**30, swap_space_gb=8 * block / 2**30,
                       offload_disk_path=str(tmp_path), offload_disk_gb=64 * block / 2**30)
    try:
        index = engine.tiers.index
        assert (index.host_blocks, index.swap_blocks, index.disk_blocks) == (6, 8, 64)
        prompts = prompts_with_cases()
        params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
        want = [hf_greedy(llama_dir, p, NEW, ignore_eos=True) for p in prompts]
        for _ in range(2):
            got, _ = run(engine, prompts, params)
            assert got == want
        st = index.stats
        assert engine.scheduler.num_preemptions > 0 and st.swap_outs > 0
        assert st.host_hits > 0 and st.disk_hits > 0 and st.disk_errors == 0
        assert {p.name for p in tmp_path.iterdir()} == {"r0", "r1"}  # each rank's files
    finally:
        engine.runner.close()


def prompt_logprobs(engine: LLMEngine, prompt: list[int]):
    engine.add_request("lp", prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    out = None
    for _ in range(1000):
        if not engine.has_work():
            break
        for ev in engine.step():
            out = ev.prompt_logprobs or out
    return [lp for lp in out if lp is not None]


def test_a_rank_that_dies_fails_the_next_step_with_its_reason(llama_dir):
    engine = tp_engine(llama_dir, blocks=64)
    try:
        (pid,) = engine.runner.tp_ranks.pids()
        os.kill(pid, signal.SIGKILL)
        engine.runner.tp_ranks.procs[0].wait(10)
        assert engine.runner.tp.check() is not None  # the health check sees it without a step
        engine.add_request("x", random_prompts([20], seed=1)[0], SamplingParams(max_tokens=4, temperature=0))
        with pytest.raises(RankLost, match="rank 1"):
            for _ in range(10):
                engine.step()
    finally:
        engine.runner.close()


def test_a_model_the_ranks_cannot_split_is_refused_with_the_numbers(llama_dir):
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match="does not divide the model's 4 attention heads"):
        tp_engine(llama_dir, size=3)


def test_planned_ahead_steps_and_a_grammar_under_two_ranks(builtin_dir):
    """Asynchronous scheduling (steps planned on tokens not yet read back: rank 1 gets
    them with the plan) gives transformers' tokens; a regex-constrained request, masked
    on rank 0 alone, gives text the regex matches."""
    import re

    from engine.sampling_params import GuidedSpec

    engine = LLMEngine.from_config(EngineConfig(
        model=str(builtin_dir), cache=CacheConfig(block_size=16, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=1024,
                                  async_scheduling=True),
        parallel=ParallelConfig(tensor_parallel_size=2)))
    try:
        assert engine.async_scheduling
        prompts = random_prompts([12, 40, 70], seed=8)
        got, _ = run(engine, prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        assert got == [hf_greedy(builtin_dir, p, 20, ignore_eos=True) for p in prompts]
        assert engine.steps_ahead > 0
        spec = GuidedSpec("regex", r"[0-9]{3}-[a-z]{2,5}")
        [ids], _ = run(engine, [prompts[0]], SamplingParams(max_tokens=20, temperature=0, guided=spec))
        assert re.fullmatch(spec.value, engine.checkpoint.tokenizer.decode(ids)), ids
    finally:
        engine.runner.close()
