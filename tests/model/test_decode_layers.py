"""A step of decode tokens only runs the decoder layers in one C++ call
(engine/cpu_kernels/decode_layers.cpp) with the same kernels and rounding as the Python
layers: tokens and logprobs bitwise equal to the same engine with the call turned off,
for one stream, a pair, four and six at once: with the tile kernel (AMX) all of them on
it; with the row-major kernel (TANDEM_CPU_TILE_LINEAR=0, or no AMX) one to four tokens
on it and six on oneDNN's packed linear layers; and fp32, or bf16 on the AVX2 build
without oneDNN's packing, on the checkpoint's own weights (PlainLinear); and Mistral
with a 64-token window, whose longer contexts pass each layer's window to the call; and
quantized weights (--quantization), each layer on the kernel its QuantLinear takes: int8
in the tile unit's order (bf16 on a VNNI or AMX build), int8 row-major W8A8 (the AVX2
build), int8 with fp32 activations and fp8 weights (the widening kernel)."""

import pytest

from decode_worker.llm_engine import EngineConfig, LLMEngine
from engine.config import CacheConfig, DeviceConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from tests.oracle import random_prompts

pytestmark = pytest.mark.model


class Counting:
    """The compiled ops, counting decode_layers calls (a wrapper, the real operator runs)."""

    def __init__(self, ops) -> None:
        self._ops, self.calls = ops, 0
        self.order: list[str] = []  # "hook" (ModelRunner.before_layers) and "layers" in turn

    def __getattr__(self, name):
        if name == "decode_layers":
            self.calls += 1
            self.order.append("layers")
        return getattr(self._ops, name)


def run(builtin_dir, fused: bool, dtype: str = "bfloat16", kv_cache_dtype: str = "auto", quantization=None):
    engine = LLMEngine.from_config(EngineConfig(
        model=str(builtin_dir), dtype=dtype, device=DeviceConfig(), quantization=quantization,
        cache=CacheConfig(num_blocks=256, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_model_len=1024)))
    model = engine.runner.model
    if model.cpu_ops is None:
        pytest.skip("no compiled CPU kernels here")
    model.cpu_ops = counting = Counting(model.cpu_ops)
    if not fused:
        model._stack_checked, model._stack = True, None
    # a decode worker's event loop takes the step before's tokens here (worker_runtime/loop.py)
    engine.runner.before_layers = lambda: counting.order.append("hook")
    forwards = 0
    params = SamplingParams(max_tokens=20, temperature=0, logprobs=2)
    out = []
    prompts = random_prompts([9, 23, 17, 40, 5, 33, 64], seed=11)
    for g, group in enumerate(([0], [1], [2, 3], [3, 4, 5, 6], [0, 1, 2, 4, 5, 6])):  # 1, 1, 2, 4, 6 at once
        for i in group:
            engine.add_request(f"g{g}r{i}", prompts[i], params)
        got = {f"g{g}r{i}": [] for i in group}
        for _ in range(1000):
            if not engine.has_work():
                break
            for ev in engine.step():
                if ev.token_id is not None:
                    got[ev.seq_id].append((ev.token_id, ev.logprobs))
            forwards += bool(engine._last_plan)
        out.append(got)
    engine.check_integrity()
    # the hook ran once a forward pass, and on the one-call path just before the call
    assert counting.order.count("hook") == forwards
    assert all(counting.order[i - 1] == "hook" for i, o in enumerate(counting.order) if o == "layers")
    tiles = None
    if quantization is not None and fused:  # the stack runs the quantized layers, in tile order where they are
        tiles = model.layers[0].mlp.down_proj.tiles
        assert model._quant and model._quant_tiles == tiles
        # in tile order the MLPs' gate and up run fused with SwiGLU (QuantSwiGLU), in the stack too
        assert all((layer.mlp.gate_up is not None) == (quantization == "int8" and tiles) for layer in model.layers)
    return out, counting.calls, model._stack is not None, tiles


@pytest.mark.parametrize("dtype,env", [
    ("bfloat16", {}),
    # an fp8 KV cache: stored quantized by store_kv_fp8 in the call, by torch's operators in Python
    ("bfloat16", {"kv_cache_dtype": "fp8"}),
    ("bfloat16", {"TANDEM_CPU_TILE_LINEAR": "0"}),
    # fp32 and bf16 without oneDNN's packing: the checkpoint's own weights (PlainLinear),
    # the row-major kernel up to four tokens, at::linear above; bf16 on the AVX2 build
    ("float32", {}),
    ("bfloat16", {"TANDEM_CPU_PACKED_WEIGHTS": "0", "TANDEM_CPU_KERNELS": "avx2"}),
    ("bfloat16", {"model": "mistral_window_dir"}),
    ("bfloat16", {"quantization": "int8"}),
    ("bfloat16", {"quantization": "int8", "TANDEM_CPU_KERNELS": "avx2"}),
    ("float32", {"quantization": "int8"}),
    ("bfloat16", {"quantization": "fp8"}),
], ids=["bf16", "bf16-fp8-kv", "bf16-row-major", "fp32", "bf16-plain-avx2", "bf16-window", "int8", "int8-avx2",
        "int8-fp32", "fp8"])
def test_fused_decode_layers_equal_the_python_layers_bitwise(builtin_dir, dtype, env, monkeypatch, request):
    from engine.cpu_kernels import build

    if env.get("TANDEM_CPU_KERNELS") and not build.variant(env["TANDEM_CPU_KERNELS"]).runs_on(build.cpu_flag_set()):
        pytest.skip(f"this CPU does not run the {env['TANDEM_CPU_KERNELS']} build")
    env = dict(env)
    kv = env.pop("kv_cache_dtype", "auto")
    quant = env.pop("quantization", None)
    model = request.getfixturevalue(env.pop("model")) if "model" in env else builtin_dir
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    build._load_once.cache_clear()
    try:
        got, calls, available, tiles = run(model, fused=True, dtype=dtype, kv_cache_dtype=kv, quantization=quant)
        if not available:
            pytest.skip("no small-batch kernel here: the layers stay in Python")
        want, python_calls, *_ = run(model, fused=False, dtype=dtype, kv_cache_dtype=kv, quantization=quant)
    finally:
        monkeypatch.undo()
        build._load_once.cache_clear()
    if quant == "int8" and dtype == "bfloat16":  # tile order where the build has it, row-major on AVX2
        assert tiles == (env.get("TANDEM_CPU_KERNELS") != "avx2" and build.load().quant_tiles_supported())
    assert calls >= 5 * 19  # every decode step of the five groups took the one call
    assert python_calls == 0
    assert got == want
