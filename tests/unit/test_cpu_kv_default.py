"""A served CPU worker sizes its KV cache from the memory available when it starts
(--cpu-kv-fraction, as --gpu-memory-utilization does on CUDA), at least 1 GiB; an
explicit size wins, and offline engines keep the fixed 1 GiB."""

import pytest
import torch

from engine.config import DEFAULT_CPU_KV_GB, CacheConfig, ConfigError
from engine.kv_cache import sized_for

pytestmark = pytest.mark.unit

GiB = 1 << 30
CPU = torch.device("cpu")


def test_a_fraction_of_what_is_available_and_never_under_one_gib():
    cfg = CacheConfig(cpu_kv_fraction=0.2)
    assert cfg.cpu_kv_gb(available=20 * GiB) == (pytest.approx(4.0), pytest.approx(20.0))
    assert cfg.cpu_kv_gb(available=2 * GiB)[0] == DEFAULT_CPU_KV_GB
    with pytest.raises(ConfigError):
        CacheConfig(cpu_kv_fraction=1.5)


def test_the_cache_takes_the_fraction_unless_a_size_is_given(monkeypatch, caplog):
    import psutil

    class Memory:
        available = 12 * GiB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    with caplog.at_level("INFO", logger="engine.kv_cache"):
        auto = sized_for(CacheConfig(cpu_kv_fraction=0.25), CPU)
    assert auto.kv_cache_memory_gb == pytest.approx(3.0)  # a quarter of 12 GiB
    assert any("25% of the 12.0 GiB available" in r.getMessage() for r in caplog.records)
    for given in (CacheConfig(cpu_kv_fraction=0.25, kv_cache_memory_gb=0.5), CacheConfig(cpu_kv_fraction=0.25,
                                                                                          num_blocks=64)):
        assert sized_for(given, CPU) == given
    offline = CacheConfig()
    assert sized_for(offline, CPU) == offline and offline.resolve_num_blocks(4096) == DEFAULT_CPU_KV_GB * GiB // 4096


def test_served_workers_take_a_fifth_by_default():
    import argparse

    from worker_runtime.engine_args import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).cache.cpu_kv_fraction == 0.2
    assert engine_config_from_args(p.parse_args(["--cpu-kv-fraction", "0.5"])).cache.cpu_kv_fraction == 0.5
