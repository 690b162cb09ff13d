"""The families beyond Llama's: Qwen3 (per-head q/k norms, a tied head), Phi-3 (q/k/v
and gate/up stored as two fused tensors), Gemma 2 (a 48-token window on its first layer,
sandwich norms, GeGLU, scaled embeddings, scores soft-capped at 5, logits at 30), Gemma 3
(q/k norms, its windowed layer rotating with its own theta), Qwen3-MoE (a
dense layer then a sparse one, top-k weights not renormalised), Qwen2-MoE (a shared
expert beside the routed ones, its output gated by a sigmoid) and Mixtral (every layer
sparse, renormalised top-k weights kept in fp32). Greedy ids equal transformers' on
random checkpoints made from transformers' own config classes, in one engine through
chunked prefill, a prefix hit and preemptions; the MoE families on the torch operators
too, and the router's choices are spread over the experts (the oracle is not one
expert)."""

from __future__ import annotations

import math

import pytest

from decode_worker.llm_engine import EngineConfig, LLMEngine
from engine.config import CacheConfig, ConfigError, SchedulerConfig
from engine.models.checkpoint import load_checkpoint
from engine.models.moe import SparseMoe
from engine.sampling_params import SamplingParams
from tests.model.test_exactness import run
from tests.oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.model

NEW = 16


def cases():
    """Prompts chunked at 48 tokens a step: the 130-token one alone, then one sharing its
    first 96 tokens (a prefix hit), then four at once that 16 blocks of 16 tokens cannot
    hold together (preemptions)."""
    ps = random_prompts([3, 130, 61, 17], seed=81)
    return [[ps[1]], [ps[1][:96] + [11, 12]], ps]


@pytest.mark.parametrize("kind,fused", [("qwen3", True), ("phi3", True), ("qwen3_moe", True), ("mixtral", True),
                                        ("gemma2", True), ("gemma3", True), ("qwen3_moe", False), ("mixtral", False),
                                        ("gemma3", False), ("qwen2_moe", True)])
def test_families_match_transformers(kind, fused, monkeypatch, request):
    if not fused:
        monkeypatch.setenv("TANDEM_CPU_FUSED_OPS", "0")
    path = request.getfixturevalue(f"{kind}_dir")
    # a Gemma block holds one of its two layers (its windowed and global layers keep
    # tables of their own: engine/kv_groups.py), and the windowed layer's table gives its
    # blocks back, so that 32 (the others' memory) hold the four prompts without a
    # preemption; 24 (22 to 26 do) preempt
    blocks = 24 if kind.startswith("gemma") else 16
    engine = LLMEngine.from_config(EngineConfig(
        model=str(path), cache=CacheConfig(block_size=16, num_blocks=blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=8, max_model_len=1024)))
    greedy = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    seen: set[int] = set()
    for i, prompts in enumerate(cases()):
        usage: list = []
        for p, got in zip(prompts, run(engine, prompts, greedy, usage)):
            assert got == hf_greedy(path, p, NEW, ignore_eos=True), f"batch {i}"
            seen |= set(got)
        if i == 1:
            assert usage[0].cached_tokens == 96
    assert len(seen) > NEW  # the answers vary: the oracle is not one token
    assert engine.scheduler.num_preemptions > 0
    assert len(engine.runner.model.cfg.kv_groups) == (2 if kind.startswith("gemma") else 1)
    assert (engine.runner.model.cpu_ops is not None) == fused
    moe = [layer.mlp for layer in engine.runner.model.layers if isinstance(layer.mlp, SparseMoe)]
    assert len(moe) == {"qwen3_moe": 1, "mixtral": 2, "qwen2_moe": 2}.get(kind, 0)
    for block in moe:  # the last step's routing used more than one expert
        assert sum(n > 0 for n in block.tokens_per_expert) >= 2


def test_quantization_of_experts_is_refused_with_a_reason(mixtral_dir):
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        load_checkpoint(mixtral_dir, quantization="int8")


def test_a_partial_rotation_is_refused_with_a_reason(tmp_path):
    from engine.config import ModelConfig

    cfg = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 1, "num_attention_heads": 4, "hidden_act": "silu",
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}}
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        ModelConfig.from_hf(cfg)


def test_yarn_rope_scaling(builtin_dir, tmp_path):
    """Qwen3 with YaRN (factor 4 over an original 64 positions: the long-context setting
    Qwen publishes): its frequencies and cos/sin factor as transformers computes them,
    contexts past the original length; the same weights without it answer otherwise."""
    from tests.model.conftest import _write_hf

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    path = _write_hf("qwen3", tmp_path / "yarn", builtin_dir, rope=yarn)
    plain = _write_hf("qwen3", tmp_path / "plain", builtin_dir)
    prompts = random_prompts([20, 150], seed=83)
    engine = LLMEngine.from_config(EngineConfig(model=str(path), cache=CacheConfig(block_size=16, num_blocks=64),
                                                scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    assert engine.runner.model.cfg.rope_scaling.kind == "yarn"
    got = run(engine, prompts, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    want = [hf_greedy(path, p, NEW, ignore_eos=True) for p in prompts]
    assert got == want
    assert [hf_greedy(plain, p, NEW, ignore_eos=True) for p in prompts] != want


def test_longrope_switches_a_sequence_to_the_long_factors_as_transformers_does(phi3_dir, tmp_path):
    """Phi-3's LongRoPE (short factors up to 64 positions here, long ones past): a prompt
    longer than 64 rotates with the long factors throughout; a shorter one that grows past
    64 is computed again, whole, with them (transformers drops its cache there), once; a
    long prompt gets no prefix hit from a short one's blocks of the same tokens (rotated
    otherwise), a long one's do. Greedy ids equal transformers'; without the scaling
    the answers differ (the oracle sees it)."""
    import json
    import shutil

    from engine.config import ModelConfig

    engine = LLMEngine.from_config(EngineConfig(
        model=str(phi3_dir), cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_model_len=1024)))
    assert engine.scheduler.long_rope_from == 64
    short, long_, grows = random_prompts([50, 100, 60], seed=85)
    long_ = short[:48] + long_[48:]  # the short prompt's first three blocks, then its own
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    brief = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)  # 58 tokens: short throughout
    usage: list = []
    assert run(engine, [short], brief, usage) == [hf_greedy(phi3_dir, short, 8, ignore_eos=True)]
    assert run(engine, [long_], greedy, usage) == [hf_greedy(phi3_dir, long_, 24, ignore_eos=True)]
    assert usage[1].cached_tokens == 0  # the short prompt's blocks, rotated with the short factors: no hit
    # a peer asking for the first three blocks of a long prompt gets the long prompt's,
    # not the short one's of the same tokens (worker_runtime/kv_pull.py)
    from worker_runtime.kv_pull import hold_for_push, release_push
    held = {}
    for flag in (True, False):
        held[flag] = hold_for_push(engine, f"push-{flag}", long_[:48], 0, long_rope=flag)
        release_push(engine, f"push-{flag}")
    assert len(held[True]) == len(held[False]) == 3 and not set(held[True]) & set(held[False])
    again = long_[:96] + [7, 8]
    assert run(engine, [again], greedy, usage) == [hf_greedy(phi3_dir, again, 24, ignore_eos=True)]
    assert usage[2].cached_tokens == 96  # a long prompt's blocks: hit
    got = run(engine, [grows], greedy)  # 60 + 24 tokens: computed again at position 64
    assert got == [hf_greedy(phi3_dir, grows, 24, ignore_eos=True)]
    assert engine.scheduler.num_preemptions == 0  # (that recompute is not a preemption)
    engine.check_integrity()
    plain = tmp_path / "plain"
    shutil.copytree(phi3_dir, plain)
    cfg = json.loads((plain / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (plain / "config.json").write_text(json.dumps(cfg))
    assert [hf_greedy(plain, p, 24, ignore_eos=True) for p in (long_, grows)] != [
        hf_greedy(phi3_dir, p, 24, ignore_eos=True) for p in (long_, grows)]

    base = json.loads((phi3_dir / "config.json").read_text())
    bad = dict(base, rope_parameters=dict(base["rope_parameters"], short_factor=[1.0] * 3))
    with pytest.raises(ConfigError, match="short_factor and long_factor of head_dim / 2"):
        ModelConfig.from_hf(bad)
    with pytest.raises(ConfigError, match="longrope needs short_factor"):
        ModelConfig.from_hf(dict(base, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0}))
    su = dict(base, rope_parameters=dict(base["rope_parameters"], rope_type="su"))  # the factors' older name
    factor = ModelConfig.from_hf(su).rope_scaling.attention_scaling
    assert factor == pytest.approx((1 + math.log(16) / math.log(64)) ** 0.5)  # transformers' default
