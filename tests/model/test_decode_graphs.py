"""Decode steps through engine/graphs.py's buckets and static buffers, on CPU: the
capture is `eager_capture` (a replay calls the forward again), so what is checked is
everything around the CUDA graph: bucket choice, padded rows that write nothing and
change no real row, inputs copied into the static buffers each step. Greedy tokens
equal transformers' while the batch shrinks through the buckets. The CUDA capture
itself needs a GPU (tests/gpu)."""

from __future__ import annotations

from collections import Counter

import pytest

from decode_worker.llm_engine import EngineConfig, LLMEngine
from engine.config import CacheConfig, ConfigError, DeviceConfig, SchedulerConfig
from engine.graphs import DecodeGraphs, buckets_for, eager_capture
from engine.sampling_params import SamplingParams
from tests.model.test_exactness import run
from tests.oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.model


def test_buckets():
    assert buckets_for(1) == [1]
    assert buckets_for(6) == [1, 2, 4, 6]
    assert buckets_for(256)[-3:] == [192, 224, 256]
    assert buckets_for(300)[-2:] == [256, 300]


@pytest.mark.parametrize("model", ["builtin_dir", "llama_dir"])
def test_graph_decode_steps_match_transformers(model, request):
    path = request.getfixturevalue(model)
    engine = LLMEngine.from_config(EngineConfig(
        model=str(path), cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=512, max_model_len=256)))
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_cache.layers, runner.backend, max_num_seqs=6, max_model_len=256,
                          block_size=runner.block_size, device=runner.device, capture=eager_capture)
    used: Counter[tuple[int, int]] = Counter()  # (batch, bucket)
    graph_run = graphs.run

    def counted(input_ids, positions, meta):
        used[(input_ids.shape[0], graphs.bucket(input_ids.shape[0]))] += 1
        return graph_run(input_ids, positions, meta)

    graphs.run = counted
    runner.graphs = graphs
    prompts = random_prompts([3, 16, 17, 30, 41], seed=21)
    lengths = [4, 10, 6, 12, 8]  # the batch shrinks 5 -> 4 -> 3 -> 2 -> 1 as requests finish
    got = run(engine, prompts, [SamplingParams(max_tokens=n, temperature=0) for n in lengths])
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        assert got[i] == hf_greedy(path, p, n), i
    assert {b for b, _ in used} == {1, 2, 3, 4, 5}
    assert used[(5, 6)] and used[(3, 4)]  # padded buckets ran


def test_cuda_graphs_need_a_gpu_and_the_triton_backend(builtin_dir):
    with pytest.raises(ConfigError, match="--cuda-graphs needs a CUDA device"):
        LLMEngine.from_config(EngineConfig(model=str(builtin_dir), cache=CacheConfig(num_blocks=16),
                                           device=DeviceConfig(cuda_graphs=True)))
