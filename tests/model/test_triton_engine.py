"""The whole engine on the Triton attention backend (KV store, paged decode and the
varlen paged prefill kernel), greedy tokens equal to transformers': a paged batch of
ragged prompts, chunked prefill (chunks after a cached part of the prompt), and prefix
hits. Without CUDA the kernels run on CPU under the Triton interpreter (slow: small
sizes), so this is the CPU check of the path a GPU worker takes by default."""

from __future__ import annotations

import pytest

from decode_worker.llm_engine import EngineConfig, LLMEngine
from engine.config import CacheConfig, DeviceConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from tests import triton_env
from tests.model.test_exactness import run
from tests.oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.model

_, DEVICE = triton_env.kernels_or_skip()
DEVICE = DEVICE.type

NEW = 6


def make_engine(path, **sched):
    sched = {"max_num_batched_tokens": 4096, "max_model_len": 512, **sched}
    engine = LLMEngine.from_config(EngineConfig(
        model=str(path), cache=CacheConfig(num_blocks=64),
        device=DeviceConfig(device=DEVICE, attention_backend="triton"), scheduler=SchedulerConfig(**sched)))
    assert engine.runner.backend.name == "triton"
    return engine


@pytest.fixture(params=["builtin", "llama"])
def triton_model(request):
    return request.getfixturevalue(f"{request.param}_dir")


def test_triton_backend_matches_transformers(triton_model):
    prompts = random_prompts([1, 15, 17, 33], seed=11)
    got = run(make_engine(triton_model), prompts, SamplingParams(max_tokens=NEW, temperature=0))
    for p, g in zip(prompts, got):
        assert g == hf_greedy(triton_model, p, NEW)


def test_triton_chunked_prefill_and_prefix_hits_match_transformers(llama_dir):
    [prefix] = random_prompts([35], seed=12)
    prompts = [prefix + s for s in random_prompts([3, 14], seed=13)]
    engine = make_engine(llama_dir, max_num_batched_tokens=20)  # chunks of 20 after a cached part
    first = run(engine, prompts[:1], SamplingParams(max_tokens=NEW, temperature=0))
    rest = run(engine, prompts[1:], SamplingParams(max_tokens=NEW, temperature=0))
    assert engine.pool.hits >= 32  # the second prompt took the prefix's two full blocks from the cache
    for p, g in zip(prompts, first + rest):
        assert g == hf_greedy(llama_dir, p, NEW)


def test_triton_sliding_window_with_released_blocks(mistral_window_dir):
    """Contexts past Mistral's 64-token window, chunked prefill over a cached part, and
    decodes whose blocks before the window went back to the pool (released table
    entries the kernels must never read)."""
    prompts = random_prompts([90], seed=14)  # past 64, and its first block released by token 6
    engine = make_engine(mistral_window_dir, max_num_batched_tokens=48)
    n = 16
    got = run(engine, prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    for p, g in zip(prompts, got):
        assert g == hf_greedy(mistral_window_dir, p, n, ignore_eos=True)
    assert engine.scheduler.window == 64 and engine.pool.num_free_blocks == engine.pool.num_blocks


def test_triton_gemma2_soft_caps_and_a_window(gemma2_dir):
    """Gemma 2 on the Triton kernels: scores soft-capped in both kernels, a 48-token window
    on its first layer, contexts past it; the windowed layer in a KV group of its own
    (engine/kv_groups.py) whose blocks before the window go back between prompt chunks
    (released entries in its tables, which the kernels never read)."""
    prompts = random_prompts([70, 9], seed=15)
    engine = make_engine(gemma2_dir, max_num_batched_tokens=32)
    assert len(engine.runner.model.cfg.kv_groups) == 2
    released = []
    cache = engine.scheduler.cache
    release = cache.release_outside_windows
    cache.release_outside_windows = lambda seq: released.append(release(seq)) or released[-1]
    got = run(engine, prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p, g in zip(prompts, got):
        assert g == hf_greedy(gemma2_dir, p, 12, ignore_eos=True)
    assert sum(released) > 0 and engine.pool.num_free_blocks == engine.pool.num_blocks
