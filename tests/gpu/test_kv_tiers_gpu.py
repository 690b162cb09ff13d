"""KV tiers on CUDA (skipped without a GPU): pinned host slots, device copies on the
step's stream (asynchronous scheduling and decode graphs on, the defaults), disk files
written after the stream has the saves and read before a load can race them; the
tokens equal transformers' after restores from host memory, from disk and after swaps."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from decode_worker.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.config import CacheConfig, DeviceConfig, SchedulerConfig  # noqa: E402
from engine.models.builtin import builtin_model_path  # noqa: E402
from tests.model.test_kv_tiers_engine import PROMPTS, run  # noqa: E402
from tests.oracle import hf_greedy, random_prompts  # noqa: E402

MiB = 1 / 1024


def engine(num_blocks: int, budget: int = 512, **tiers) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(
        model=str(builtin_model_path()), dtype="float32",
        cache=CacheConfig(block_size=16, num_blocks=num_blocks, **tiers),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_model_len=1024),
        device=DeviceConfig(device="cuda")))


def test_host_and_disk_tiers_on_cuda(tmp_path):
    path = builtin_model_path()
    ref = [hf_greedy(path, p, 6, ignore_eos=True) for p in PROMPTS]
    e = engine(24, offload_host_gb=0.5 * MiB, offload_disk_path=str(tmp_path), offload_disk_gb=16 * MiB)
    assert e.runner.kv_store.host.is_pinned()
    for tag in "abc":
        assert run(e, PROMPTS, 6, tag) == ref
    st = e.tiers.index.stats
    assert st.host_hits > 0 and st.disk_hits > 0 and st.disk_errors == 0


def test_swap_on_cuda():
    path = builtin_model_path()
    prompts = random_prompts([60, 70, 50, 65], seed=5)
    ref = [hf_greedy(path, p, 60, ignore_eos=True) for p in prompts]
    e = engine(20, budget=256, swap_space_gb=2 * MiB)
    assert run(e, prompts, 60, "s") == ref
    assert e.scheduler.num_preemptions > 0 and e.tiers.index.stats.swap_outs > 0
