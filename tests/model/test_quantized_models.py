"""Quantized weights end to end in one engine: with `--dtype float32` the greedy ids equal
transformers' on the dequantized weights (q * scale in fp32), for --quantization int8
and fp8 quantized as they load (Llama with its head tied, Qwen2 with its own head and
q/k/v biases), and for checkpoints quantized as published (compressed-tensors fp8 per
channel, per tensor and in blocks, int8 per channel; the fp8 format in blocks with
`weight_scale_inv` and per tensor), through chunked prefill and a prefix-cache hit; the
same at tensor-parallel size 2, whose ranks load the same numbers; and a checkpoint
whose quantization is unsupported, or whose scale is missing, fails the command at once
with one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode_worker.llm_engine import LLMEngine
from engine.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from engine.quantization.writer import write_dequantized, write_online_reference, write_quantized
from engine.sampling_params import SamplingParams
from tests.model.conftest import _write_hf
from tests.model.test_exactness import run
from tests.model.test_fail_fast import one_line, tandem
from tests.oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.model

NEW = 16
FORMATS = {  # name: (method, strategy, format); blocks of 32 x 64 over the 128/256-wide test model
    "ct-fp8-channel": ("fp8", "channel", "compressed-tensors"),
    "ct-fp8-tensor": ("fp8", "tensor", "compressed-tensors"),
    "ct-fp8-block": ("fp8", "block", "compressed-tensors"),
    "ct-int8-channel": ("int8", "channel", "compressed-tensors"),
    "fp8-block": ("fp8", "block", "fp8"),
    "fp8-tensor": ("fp8", "tensor", "fp8"),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory, builtin_dir):
    """A random Llama (2 KV heads, tied embeddings) and a random Qwen2 (q/k/v biases)."""
    root = tmp_path_factory.mktemp("quant-base")
    return {"llama": _write_hf("llama", root / "llama", builtin_dir),
            "qwen2": _write_hf("qwen2", root / "qwen2", builtin_dir),
            "phi3": _write_hf("phi3", root / "phi3", builtin_dir)}


def prompts():
    ps = random_prompts([3, 40, 90], seed=31)
    return ps + [ps[2][:70] + [11, 12, 13]]  # a prefix hit on the 90-token prompt's first blocks


def engine(path, quantization=None, tp=1, kv_cache_dtype="auto"):
    return LLMEngine.from_config(EngineConfig(
        model=str(path), dtype="float32", quantization=quantization,
        cache=CacheConfig(block_size=16, num_blocks=64, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=512),
        parallel=ParallelConfig(tensor_parallel_size=tp)))


def check(eng, reference, kv_fp8=None):
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    usage: list = []
    got = run(eng, prompts(), params, usage)
    for p, ids in zip(prompts(), got):
        assert ids == hf_greedy(reference, p, NEW, ignore_eos=True, kv_fp8=kv_fp8)
    assert usage[-1].cached_tokens >= 64
    return got


def with_kv_scales(path, k_scale, v_scale, shape=()):
    """The checkpoint at `path` given every layer's fp8 KV cache scales (self_attn.k_scale, v_scale)."""
    tensors = load_file(path / "model.safetensors")
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.full(shape, k_scale)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.full(shape, v_scale)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_an_fp8_kv_cache_equals_transformers_on_keys_and_values_rounded_to_e4m3(base, tmp_path):
    """--kv-cache-dtype fp8 with --dtype float32: every layer's keys and values stored as
    e4m3 (divided by the checkpoint's scales, or 1.0 where it has none) and read back by
    decode, chunked prefill and a prefix hit alike; the ids equal transformers' with K and
    V rounded the same way before attention, and differ from the unrounded answer. With
    fp8 weights (compressed-tensors, per channel) as published as well."""
    eng = engine(base["llama"], kv_cache_dtype="fp8")
    assert eng.runner.kv_cache.kv.dtype == torch.float8_e4m3fn
    got = check(eng, base["llama"], kv_fp8=(1.0, 1.0))
    assert got != [hf_greedy(base["llama"], p, NEW, ignore_eos=True) for p in prompts()]
    scaled = with_kv_scales(write_quantized(base["qwen2"], tmp_path / "ct-fp8", "fp8", "channel"), 0.5, 0.25)
    eng = engine(scaled, kv_cache_dtype="fp8")
    assert {layer.self_attn.kv_scales for layer in eng.runner.model.layers} == {(0.5, 0.25)}
    check(eng, write_dequantized(scaled, tmp_path / "ref"), kv_fp8=(0.5, 0.25))


def test_an_fp8_kv_cache_holds_as_many_more_blocks_as_its_bytes_are_fewer(base):
    def blocks(kv_cache_dtype):
        eng = LLMEngine.from_config(EngineConfig(model=str(base["llama"]), dtype="float32", cache=CacheConfig(
            block_size=16, kv_cache_memory_gb=0.01, kv_cache_dtype=kv_cache_dtype)))
        return eng.runner.kv_cache.num_blocks, eng.runner.kv_cache.layout.block_bytes

    (n32, b32), (n8, b8) = blocks("auto"), blocks("fp8")
    assert b32 == 4 * b8 and n8 == int(0.01 * 2**30) // b8 and n32 == int(0.01 * 2**30) // b32 and n8 >= 4 * n32


def test_bad_kv_scales_fail_at_once(base, tmp_path):
    import shutil

    per_head = with_kv_scales(Path(shutil.copytree(base["llama"], tmp_path / "per-head")), 0.5, 0.5, shape=(2,))
    one_line(*tandem("serve", "--port", "0", "--model", str(per_head), "--kv-cache-dtype", "fp8"), "serve",
             "model.layers.0.self_attn.k_scale has shape [2]", "one scale per layer")
    negative = with_kv_scales(Path(shutil.copytree(base["llama"], tmp_path / "negative")), -1.0, 0.5)
    one_line(*tandem("serve", "--port", "0", "--model", str(negative), "--kv-cache-dtype", "fp8"), "serve",
             "model.layers.0.self_attn.k_scale = -1.0", "must be positive")


@pytest.mark.parametrize("name", list(FORMATS))
def test_published_checkpoints_match_their_dequantized_weights(base, tmp_path, name):
    method, strategy, fmt = FORMATS[name]
    q = write_quantized(base["llama"], tmp_path / name, method, strategy, fmt, block=(32, 64))
    eng = engine(q)
    layer = eng.runner.model.layers[0]
    assert type(layer.mlp.down_proj).__name__ == "QuantLinear" and layer.self_attn.qkv_proj.weight.element_size() == 1
    check(eng, write_dequantized(q, tmp_path / f"{name}-ref"))


@pytest.mark.parametrize("family,method", [("llama", "int8"), ("qwen2", "int8"), ("qwen2", "fp8"), ("phi3", "int8")])
def test_quantized_as_it_loads(base, tmp_path, family, method):
    """Phi-3's fused q/k/v and gate/up tensors: each weight they stack quantized per row."""
    eng = engine(base[family], method)
    # Qwen2's and Phi-3's own heads are quantized too; Llama's is its (tied) embedding, left as it is
    assert (type(eng.runner.model.lm_head).__name__ == "QuantLinear") == (family != "llama")
    check(eng, write_online_reference(base[family], tmp_path / f"{family}-{method}-ref", method))


def test_tensor_parallel_ranks_load_the_same_numbers(base, tmp_path):
    """int8 as it loads: each row's scale comes from the whole row, so two ranks (o_proj and
    down_proj split by columns, the head by rows) compute the one-rank model; fp8 in blocks
    of 32 x 64 the same."""
    check(engine(base["qwen2"], "int8", tp=2), write_online_reference(base["qwen2"], tmp_path / "ref", "int8"))
    q = write_quantized(base["llama"], tmp_path / "block", "fp8", "block", "compressed-tensors", block=(32, 64))
    check(engine(q, tp=2), write_dequantized(q, tmp_path / "block-ref"))


def test_bad_quantized_checkpoints_fail_at_once(base, tmp_path):
    q = write_quantized(base["llama"], tmp_path / "no-scale", "fp8", "channel")
    tensors = load_file(q / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, str(q / "model.safetensors"))
    one_line(*tandem("serve", "--port", "0", "--model", str(q)), "serve",
             "missing tensor 'model.layers.1.mlp.up_proj.weight_scale'", "F8_E4M3 weight")
    g = write_quantized(base["llama"], tmp_path / "gptq", "int8", "channel")
    cfg = json.loads((g / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (g / "config.json").write_text(json.dumps(cfg))
    one_line(*tandem("serve", "--port", "0", "--model", str(g)), "serve", "quant_method='gptq' is not supported")
    f = write_quantized(base["llama"], tmp_path / "fp8", "fp8", "channel")
    one_line(*tandem("serve", "--port", "0", "--model", str(f), "--quantization", "int8"), "serve",
             "--quantization int8, but the checkpoint is quantized to fp8")


def test_int8_in_bf16_gives_each_prompt_the_same_tokens_alone_or_in_a_batch(builtin_dir):
    """bf16 activations with int8 weights run W8A8, integer dot products whose sums are
    exact, on whichever path a step's size takes (engine/cpu_kernels/quant_linear.cpp):
    a prompt's greedy tokens do not depend on what runs beside it. On the trained model,
    whose answers also stay close to the unquantized bf16 model's."""
    ps = random_prompts([6, 30, 50, 12, 70, 9, 41], seed=33)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def make(quantization):
        return LLMEngine.from_config(EngineConfig(
            model=str(builtin_dir), dtype="bfloat16", quantization=quantization,
            cache=CacheConfig(block_size=16, num_blocks=128),
            scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=512)))

    eng = make("int8")
    together = run(eng, ps, params)
    alone = [run(eng, [p], params)[0] for p in ps]
    assert together == alone
    plain = run(make(None), ps, params)
    same = sum(a == b for x, y in zip(together, plain) for a, b in zip(x, y))
    assert same >= 0.8 * sum(len(x) for x in plain), (same, together, plain)
