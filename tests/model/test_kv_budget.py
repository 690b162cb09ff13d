"""The start-up KV budget check: KV bytes a token x max_num_seqs x the expected context,
against the cache the worker built, with the numbers in the log line."""

from __future__ import annotations

import logging

import pytest

from engine.build import KVBudget, build_parts
from engine.config import CacheConfig, EngineConfig, SchedulerConfig

pytestmark = pytest.mark.model


def test_the_budget_arithmetic():
    b = KVBudget(num_blocks=100, block_size=16, bytes_per_block=16 * 1024, max_num_seqs=8, context_len=200)
    assert b.blocks_per_seq == 13  # 200 tokens take 13 blocks of 16
    assert b.seqs_that_fit == 7 and not b.fits
    text = str(b)
    assert "1.0 KiB of KV a token x max-num-seqs 8 x 200 tokens" in text
    assert "(104 blocks) against a cache of 100 blocks" in text and "7 such sequences fit" in text
    assert KVBudget(104, 16, 16 * 1024, 8, 200).fits


def _build(builtin_dir, caplog, **sched) -> str:
    cfg = EngineConfig(model=str(builtin_dir), cache=CacheConfig(num_blocks=64),
                       scheduler=SchedulerConfig(max_model_len=512, **sched))
    with caplog.at_level(logging.INFO, logger="engine.build"):
        build_parts(cfg)
    return "\n".join(f"{r.levelname} {r.getMessage()}" for r in caplog.records if "KV budget" in r.getMessage())


def test_a_worker_warns_when_max_num_seqs_cannot_fit_at_the_expected_context(builtin_dir, caplog):
    line = _build(builtin_dir, caplog, max_num_seqs=16, expected_context_len=256)
    # 256 tokens = 16 blocks a sequence; 64 blocks hold 4 of them, not 16
    assert line.startswith("WARNING KV budget:"), line
    assert "max-num-seqs 16 x 256 tokens" in line and "4 such sequences fit" in line
    assert "lower --max-num-seqs to 4" in line


def test_without_an_expectation_the_budget_is_reported_at_max_model_len(builtin_dir, caplog):
    line = _build(builtin_dir, caplog, max_num_seqs=16)
    assert line.startswith("INFO KV budget:"), line
    assert "x 512 tokens a sequence" in line and "2 such sequences fit" in line


def test_a_budget_that_fits_is_not_a_warning(builtin_dir, caplog):
    line = _build(builtin_dir, caplog, max_num_seqs=4, expected_context_len=256)
    assert line.startswith("INFO KV budget:") and "4 such sequences fit" in line


GiB = 1 << 30


def test_the_device_sizing_arithmetic_and_its_refusals():
    from engine.config import ConfigError
    from engine.memory import KVSizing

    s = KVSizing(0.9, total=80 * GiB, free_at_start=79 * GiB, weights=16 * GiB, peak_activations=2 * GiB,
                 non_torch_growth=GiB)
    assert s.requested == int(72 * GiB) and s.kv_bytes == 53 * GiB
    assert s.num_blocks(2 * 1024 * 1024) == 53 * 512
    assert "0.90 of 80.00 GiB = 72.00 GiB" in str(s) and "KV cache 53.00 GiB" in str(s)
    # another process holds half the device: 0.9 of it was never free
    with pytest.raises(ConfigError, match="only 40.00 GiB was free"):
        KVSizing(0.9, 80 * GiB, 40 * GiB, 16 * GiB, 2 * GiB, 0).num_blocks(1 << 20)
    # weights and activations leave nothing for the cache
    with pytest.raises(ConfigError, match="fewer than 2 blocks"):
        KVSizing(0.3, 80 * GiB, 79 * GiB, 22 * GiB, 2 * GiB, 0).num_blocks(1 << 20)
    # decode graphs' pool is set aside like the activations, and named when it is what leaves nothing
    g = KVSizing(0.9, 80 * GiB, 79 * GiB, 16 * GiB, 2 * GiB, GiB, decode_graphs=GiB // 2)
    assert g.kv_bytes == 52.5 * GiB and "decode graphs 0.50 GiB, KV cache 52.50 GiB" in str(g)
    with pytest.raises(ConfigError, match="0.50 GiB for decode graphs: fewer than 2 blocks.*--enforce-eager"):
        KVSizing(0.3, 80 * GiB, 79 * GiB, 21.5 * GiB, 2 * GiB, 0, decode_graphs=GiB // 2).num_blocks(1 << 20)


@pytest.mark.parametrize("tokens,seqs,max_len", [(2048, 256, 2048), (4096, 1, 1024), (100, 256, 2048), (17, 4, 8)])
def test_the_profile_step_is_the_largest_the_scheduler_can_plan(tokens, seqs, max_len):
    from engine.memory import profile_plan

    plan, blocks = profile_plan(tokens, seqs, max_len, 16)
    works = plan.works()
    assert plan.num_tokens == tokens
    assert all(len(w.token_ids) <= max_len and w.sample is not None for w in works)
    assert len(works) <= max(seqs, -(-tokens // max_len))
    used = [b for w in works for b in w.block_table]
    assert sorted(used) == list(range(blocks))  # every block once
    assert all(len(w.block_table) == -(-len(w.token_ids) // 16) for w in works)


def test_the_profile_run_leaves_the_worker_cache_alone(builtin_dir):
    """The sizing step runs on a scratch cache (on CPU here, where nothing else of the
    sizing applies): the worker's own cache keeps its tensor and its contents."""
    parts = build_parts(EngineConfig(model=str(builtin_dir), cache=CacheConfig(num_blocks=8),
                                     scheduler=SchedulerConfig(max_model_len=512)))
    runner = parts.runner
    kv = runner.kv_cache.kv
    kv.fill_(0.5)
    scratch = runner.profile_run(600, 8, 512)
    assert runner.kv_cache.kv is kv and bool((kv == 0.5).all())
    per_block = runner.kv_cache.layout.block_bytes
    assert scratch == per_block * (8 * 5)  # 8 sequences of 75 tokens, 5 blocks each


def test_dtype_auto_is_bf16_for_an_fp32_checkpoint_on_cuda_only():
    import torch

    from engine.build import auto_dtype

    assert auto_dtype("float32", torch.device("cuda")) == "bfloat16"
    assert auto_dtype("float16", torch.device("cuda:1")) == "float16"
    assert auto_dtype("bfloat16", torch.device("cuda")) == "bfloat16"
    assert auto_dtype("float32", torch.device("cpu")) == "float32"


class StandInDevice:
    """The memory counters ModelRunner sizes a CUDA worker's cache from (engine/memory.py
    CudaMemory), stood in for on CPU: an 8 GiB device, 1 GiB used before the worker came,
    0.5 GiB of weights, 0.25 GiB of peak activations, nothing reserved beyond them."""

    def settle(self):
        pass

    def reset_peak(self):
        pass

    def allocated(self):
        return GiB // 2

    def peak(self):
        return GiB // 2 + 256 * (1 << 20)

    def reserved(self):
        return GiB // 2

    def snapshot(self):
        from engine.memory import MemorySnapshot

        return MemorySnapshot(free=7 * GiB, total=8 * GiB, torch_reserved=0)


def test_a_worker_sized_from_device_memory_runs_the_profile_step_first(builtin_dir, caplog, monkeypatch):
    """ModelRunner's start-up path for a CUDA worker without a cache size, on CPU: the
    device's memory counters are stood in for (there is no device here), everything
    else is the real path: the profile step runs before the cache exists, then the
    cache gets what the arithmetic leaves, and the log line says so."""
    from engine.config import DeviceConfig
    from engine.models.checkpoint import load_checkpoint
    from engine.models.loader import build_model
    from engine.runner import ModelRunner

    class Counters(StandInDevice):
        runs = 0

        def peak(self):
            Counters.runs += 1
            return GiB // 2 + scratch_bytes[0] + 256 * (1 << 20)

    scratch_bytes = [0]
    ckpt = load_checkpoint(builtin_dir)
    real_profile = ModelRunner.profile_run

    def profile_run(self, *limits):
        scratch_bytes[0] = real_profile(self, *limits)
        return scratch_bytes[0]

    monkeypatch.setattr(ModelRunner, "profile_run", profile_run)  # to learn the scratch cache's size
    with caplog.at_level(logging.INFO, logger="engine.runner"):
        runner = ModelRunner(build_model(ckpt), ckpt.config, CacheConfig(gpu_memory_utilization=0.5),
                             DeviceConfig(), step_limits=(512, 16, 256), memory=Counters())
    assert Counters.runs == 1 and scratch_bytes[0] > 0
    # 0.5 x 8 GiB - 0.5 GiB weights - 0.25 GiB activations = 3.25 GiB of KV
    block = runner.kv_cache.layout.block_bytes
    assert runner.kv_cache.num_blocks == int(3.25 * GiB) // block
    assert "KV cache from --gpu-memory-utilization 0.50 of 8.00 GiB" in caplog.text
    assert f"{runner.kv_cache.num_blocks} blocks of 16 tokens" in caplog.text


def test_a_worker_with_decode_graphs_sets_their_memory_aside_before_sizing_the_cache(builtin_dir, caplog,
                                                                                     monkeypatch):
    """The same start-up path with decode graphs: they are captured once on a scratch
    cache first and what that took comes off the KV cache. The device is stood in for as
    above, and so is the capture (eager, each bucket's capture counted as 8 MiB reserved);
    the real capture's memory is checked on a GPU (tests/gpu)."""
    import engine.runner as runner_mod
    from engine.config import DeviceConfig
    from engine.graphs import eager_capture
    from engine.models.checkpoint import load_checkpoint
    from engine.models.loader import build_model
    from engine.runner import ModelRunner

    MiB = 1 << 20
    captured = []

    def capture(fn, pool, stream):
        captured.append(fn)
        return eager_capture(fn, pool, stream)

    class Counters(StandInDevice):
        def reserved(self):
            return GiB // 2 + 8 * MiB * len(captured)

    monkeypatch.setattr(runner_mod, "cuda_capture", capture)
    monkeypatch.setattr(ModelRunner, "_wants_graphs", lambda self, setting: True)
    monkeypatch.setattr(ModelRunner, "profile_run", lambda self, *limits: 0)
    ckpt = load_checkpoint(builtin_dir)
    with caplog.at_level(logging.INFO, logger="engine.runner"):
        runner = ModelRunner(build_model(ckpt), ckpt.config, CacheConfig(gpu_memory_utilization=0.5),
                             DeviceConfig(), step_limits=(512, 16, 256), memory=Counters())
    assert len(captured) == 10  # buckets 1, 2, 4, 8, 16: once on the scratch cache, once for real
    assert runner.kv_sizing.decode_graphs == 40 * MiB and runner.graph_bytes == 40 * MiB
    assert runner.graphs is not None and runner.graphs.buckets == [1, 2, 4, 8, 16]
    # 0.5 x 8 GiB - 0.5 GiB weights - 0.25 GiB activations - 40 MiB of graphs
    assert runner.kv_cache.num_blocks == (int(3.25 * GiB) - 40 * MiB) // runner.kv_cache.layout.block_bytes
    assert "decode graphs 0.04 GiB" in caplog.text
    assert "decode graphs for batch sizes 1,2,4,8,16 captured" in caplog.text
    assert "40 MiB of device memory (40 MiB set aside at sizing)" in caplog.text
