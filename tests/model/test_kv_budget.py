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
