"""Build the parts every engine shares from an EngineConfig: checkpoint, model runner,
block pool, and the scheduler config clamped to what the model allows."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from engine.block_pool import BlockPool
from engine.config import EngineConfig, SchedulerConfig
from engine.runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    checkpoint: object  # engine.models.loader.Checkpoint
    runner: ModelRunner
    pool: BlockPool
    scheduler_config: SchedulerConfig
    eos_ids: frozenset[int]


def build_parts(config: EngineConfig, checkpoint=None) -> EngineParts:
    from engine.models.builtin import builtin_model_path
    from engine.models.loader import build_model, load_checkpoint

    t0 = time.monotonic()
    ckpt = checkpoint or load_checkpoint(config.model or builtin_model_path(), dtype=config.dtype)
    model = build_model(ckpt, config.device.device)
    t1 = time.monotonic()
    runner = ModelRunner(model, ckpt.config, config.cache, config.device, sampler_seed=config.seed)
    t2 = time.monotonic()
    max_len = min(config.scheduler.max_model_len, ckpt.config.max_position_embeddings)
    window = ckpt.config.sliding_window
    if window is not None and window < max_len:
        log.warning("model uses sliding-window attention (%d tokens), which tandem does not implement: "
                    "max_model_len is capped at %d so every answer is exact", window, window)
        max_len = window
    sched = dataclasses.replace(config.scheduler, max_model_len=max_len)
    if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_len:
        sched = dataclasses.replace(sched, max_num_batched_tokens=max_len)
    pool = BlockPool(runner.kv_cache.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
    kv_bytes = runner.kv_cache.kv.numel() * runner.kv_cache.kv.element_size()
    log.info("engine: %s (%s) weights loaded in %.2f s; %d KV blocks of %d tokens (%.0f MiB) and the %s "
             "attention kernel in %.2f s", ckpt.path, ckpt.config.dtype, t1 - t0, pool.num_blocks, pool.block_size,
             kv_bytes / 2**20, runner.backend.name, t2 - t1)
    return EngineParts(ckpt, runner, pool, sched, frozenset(ckpt.config.eos_token_ids))
