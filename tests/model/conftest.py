"""Model-test fixtures: the built-in checkpoint (trained) and its random-weight twin,
random transformers checkpoints (Llama with GQA and tied embeddings, Qwen2 with q/k/v
bias) sharing the built-in tokenizer, and the oracle: transformers' greedy `generate` on
the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models.builtin import builtin_model_path
from engine.models.writer import copy_tokenizer_files, random_model_path


@pytest.fixture(scope="session")
def builtin_dir() -> Path:
    """The trained built-in model (package data)."""
    return builtin_model_path()


@pytest.fixture(scope="module")
def one_thread():
    """The tiny models are overhead-bound: extra intra-op threads only contend for cores
    (for a module: `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def random_dir() -> Path:
    """tandem-tiny-v1: the built-in shape with random weights (greedy output is noise)."""
    return random_model_path()


def _write_hf(kind: str, path: Path, tokenizer_src: Path, window: int | None = None, kv_heads: int = 2,
              rope: dict | None = None, layers: int = 2) -> Path:
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                  initializer_range=0.15, bos_token_id=0, eos_token_id=[1, 4])
    if kind == "llama":
        cfg = transformers.LlamaConfig(tie_word_embeddings=True, **common,
                                       rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
        cls = transformers.LlamaForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(tie_word_embeddings=False, sliding_window=window, head_dim=32, **common)
        cls = transformers.MistralForCausalLM
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(tie_word_embeddings=True, head_dim=32, rope_parameters=rope, **common)
        cls = transformers.Qwen3ForCausalLM
    elif kind == "qwen3_moe":  # layer 0 dense, layer 1 sparse; top-k weights not renormalised
        cfg = transformers.Qwen3MoeConfig(tie_word_embeddings=False, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=64, mlp_only_layers=[0], norm_topk_prob=False,
                                          **common)
        cls = transformers.Qwen3MoeForCausalLM
    elif kind == "phi3":  # q/k/v and gate/up stored fused; LongRoPE (as Phi-3-mini-128k and Phi-3.5-mini) from 64
        short = [1.0 + 0.5 * i / 15 for i in range(16)]  # head_dim 32: 16 frequencies
        long = [1.0 + 15.0 * (i / 15) ** 2 for i in range(16)]
        cfg = transformers.Phi3Config(tie_word_embeddings=False, pad_token_id=0, original_max_position_embeddings=64,
                                      rope_parameters={"rope_type": "longrope", "short_factor": short,
                                                       "long_factor": long, "rope_theta": 10000.0}, **common)
        cls = transformers.Phi3ForCausalLM
    elif kind == "gemma2":  # a windowed layer then a global one; scores capped at 5 (transformers' default: 50);
        # untied: with the tied head of a random Gemma every answer is the embedding row of largest norm
        cfg = transformers.Gemma2Config(head_dim=32, sliding_window=48, query_pre_attn_scalar=24,
                                        attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                                        tie_word_embeddings=False, **common)
        cls = transformers.Gemma2ForCausalLM
    elif kind == "gemma3":  # a windowed layer (its own rope theta) then a global one; q/k norms
        # (with more layers, Gemma 3's own pattern: five windowed, then a global one)
        types = ["full_attention" if i % 6 == 5 or (layers == 2 and i == 1) else "sliding_attention"
                 for i in range(layers)]
        cfg = transformers.Gemma3TextConfig(head_dim=32, sliding_window=48, tie_word_embeddings=False,
                                            layer_types=types, **common)
        cls = transformers.Gemma3ForCausalLM
    elif kind == "qwen2_moe":  # every layer sparse, with a shared expert; q/k/v biases
        cfg = transformers.Qwen2MoeConfig(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=64, shared_expert_intermediate_size=96,
                                          norm_topk_prob=True, **common)
        cls = transformers.Qwen2MoeForCausalLM
    elif kind == "mixtral":
        cfg = transformers.MixtralConfig(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                                         **common)
        cls = transformers.MixtralForCausalLM
    elif window is not None:  # Qwen2 with layer 0 global, layer 1 windowed
        cfg = transformers.Qwen2Config(tie_word_embeddings=False, use_sliding_window=True, sliding_window=window,
                                       max_window_layers=1, **common)
        cls = transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.Qwen2Config(tie_word_embeddings=False, **common)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(1234)
    model = cls(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    for name, data in copy_tokenizer_files(tokenizer_src).items():
        if name != "generation_config.json":
            (path / name).write_bytes(data)
    return path


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory, builtin_dir) -> Path:
    return _write_hf("llama", tmp_path_factory.mktemp("hf-llama"), builtin_dir)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory, builtin_dir) -> Path:
    return _write_hf("qwen2", tmp_path_factory.mktemp("hf-qwen2"), builtin_dir)


@pytest.fixture(scope="session")
def mistral_dir(tmp_path_factory, builtin_dir) -> Path:
    return _write_hf("mistral", tmp_path_factory.mktemp("hf-mistral"), builtin_dir)


@pytest.fixture(scope="session")
def qwen2_window_dir(tmp_path_factory, builtin_dir) -> Path:
    """Qwen2 whose second layer has a 48-token sliding window (the first sees everything)."""
    return _write_hf("qwen2", tmp_path_factory.mktemp("hf-qwen2-w48"), builtin_dir, window=48)


@pytest.fixture(scope="session")
def mistral_window_dir(tmp_path_factory, builtin_dir) -> Path:
    """Mistral with a 64-token sliding window."""
    return _write_hf("mistral", tmp_path_factory.mktemp("hf-mistral-w64"), builtin_dir, window=64)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory, builtin_dir) -> Path:
    return _write_hf("qwen3", tmp_path_factory.mktemp("hf-qwen3"), builtin_dir)


@pytest.fixture(scope="session")
def qwen3_moe_dir(tmp_path_factory, builtin_dir) -> Path:
    return _write_hf("qwen3_moe", tmp_path_factory.mktemp("hf-qwen3-moe"), builtin_dir)


@pytest.fixture(scope="session")
def phi3_dir(tmp_path_factory, builtin_dir) -> Path:
    return _write_hf("phi3", tmp_path_factory.mktemp("hf-phi3"), builtin_dir)


@pytest.fixture(scope="session")
def gemma2_dir(tmp_path_factory, builtin_dir) -> Path:
    return _write_hf("gemma2", tmp_path_factory.mktemp("hf-gemma2"), builtin_dir)


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory, builtin_dir) -> Path:
    return _write_hf("gemma3", tmp_path_factory.mktemp("hf-gemma3"), builtin_dir)


@pytest.fixture(scope="session")
def gemma3_six_dir(tmp_path_factory, builtin_dir) -> Path:
    """Gemma 3 of six layers: five windowed, then a global one (six KV groups of one layer)."""
    return _write_hf("gemma3", tmp_path_factory.mktemp("hf-gemma3-six"), builtin_dir, layers=6)


@pytest.fixture(scope="session")
def qwen2_moe_dir(tmp_path_factory, builtin_dir) -> Path:
    return _write_hf("qwen2_moe", tmp_path_factory.mktemp("hf-qwen2-moe"), builtin_dir)


@pytest.fixture(scope="session")
def mixtral_dir(tmp_path_factory, builtin_dir) -> Path:
    return _write_hf("mixtral", tmp_path_factory.mktemp("hf-mixtral"), builtin_dir)


@pytest.fixture(scope="session", params=["builtin", "llama", "qwen2", "mistral"])
def model_dir(request) -> Path:
    return request.getfixturevalue(f"{request.param}_dir")


from tests.oracle import VOCAB, hf_greedy, random_prompts  # noqa: E402,F401 (re-exported)
