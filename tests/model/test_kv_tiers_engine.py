"""KV tiers on a real engine (the built-in model): blocks the device evicts come back
from host memory and from disk, damaged files are misses, preempted sequences swap;
the tokens equal transformers' on every path, and no block or slot leaks."""

from __future__ import annotations

import pytest

from decode_worker.llm_engine import LLMEngine
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from tests.oracle import hf_greedy, random_prompts

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_thread")]

BS = 16
MiB = 1 / 1024  # GiB


def engine(path, num_blocks: int, budget: int = 512, **tiers) -> LLMEngine:
    cache = CacheConfig(block_size=BS, num_blocks=num_blocks, **tiers)
    return LLMEngine.from_config(EngineConfig(model=str(path), cache=cache,
                                              scheduler=SchedulerConfig(max_num_batched_tokens=budget)))


def run(e: LLMEngine, prompts, n: int, tag: str) -> list[list[int]]:
    """All prompts at once; checks the pool and the tiers after every step."""
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        e.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    for _ in range(10_000):
        if not e.has_work():
            break
        for ev in e.step():
            outs.setdefault(ev.seq_id, []).append(ev.token_id)
        e.check_integrity()
    assert not e.has_work()
    return [outs[f"{tag}{i}"] for i in range(len(prompts))]


# a working set of about 50 blocks of 16 tokens against a device cache of 24
PROMPTS = random_prompts([100, 120, 90, 110, 100, 97, 130, 85], seed=3)


def test_prefixes_come_back_from_host_memory(builtin_dir):
    ref = [hf_greedy(builtin_dir, p, 6, ignore_eos=True) for p in PROMPTS]
    e = engine(builtin_dir, 24, offload_host_gb=4 * MiB)  # 64 blocks of 64 KiB
    assert run(e, PROMPTS, 6, "a") == ref
    assert e.tiers.index.stats.host_hits == 0
    assert run(e, PROMPTS, 6, "b") == ref  # every prompt's blocks were evicted by the others
    stats = e.tiers.index.stats
    assert stats.host_hits >= 30 and stats.host_saves >= stats.host_hits
    assert e.pool.hits >= stats.host_hits * BS  # counted as prefix-cache hits
    e.runner.close()


def test_prefixes_come_back_from_disk_and_damaged_files_are_misses(builtin_dir, tmp_path):
    ref = [hf_greedy(builtin_dir, p, 6, ignore_eos=True) for p in PROMPTS]
    # host memory holds 8 blocks: most of the working set spills to disk
    e = engine(builtin_dir, 24, offload_host_gb=0.5 * MiB, offload_disk_path=str(tmp_path), offload_disk_gb=16 * MiB)
    assert run(e, PROMPTS, 6, "a") == ref
    store, stats = e.runner.kv_store, e.tiers.index.stats
    store.flush()
    assert stats.disk_spills >= 10 and len(list((tmp_path / "r0").glob("*.kv"))) == stats.disk_spills
    assert run(e, PROMPTS, 6, "b") == ref
    assert stats.disk_fetches > 0 and stats.disk_hits > 0 and stats.disk_errors == 0
    # damage every file under the live engine: one bit flipped in each payload, or cut short
    store.flush()
    files = sorted((tmp_path / "r0").glob("*.kv"))
    assert files
    for i, f in enumerate(files):
        raw = bytearray(f.read_bytes())
        if i % 2:
            f.write_bytes(raw[: len(raw) // 2])
        else:
            raw[-7] ^= 0x10
            f.write_bytes(bytes(raw))
    assert run(e, PROMPTS, 6, "c") == ref  # the damaged blocks were computed again
    assert 0 < stats.disk_errors <= len(files)
    e.runner.close()


def test_preempted_sequences_swap_out_and_back_in(builtin_dir):
    prompts = random_prompts([60, 70, 50, 65], seed=5)
    ref = [hf_greedy(builtin_dir, p, 60, ignore_eos=True) for p in prompts]
    e = engine(builtin_dir, 20, budget=256, swap_space_gb=2 * MiB)
    assert run(e, prompts, 60, "s") == ref
    stats = e.tiers.index.stats
    assert e.scheduler.num_preemptions > 0 and stats.swap_outs > 0 and stats.host_hits > 0
    assert e.tiers.index.num_pinned == 0  # every swapped sequence resumed or ended
    e.runner.close()
