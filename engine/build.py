"""Build the parts every engine shares from an EngineConfig: checkpoint, model runner,
block pool, and the scheduler config clamped to what the model allows."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from engine.block_pool import BlockPool
from engine.config import ConfigError, EngineConfig, SchedulerConfig
from engine.kv_groups import KVGroups
from engine.memory import MemorySnapshot
from engine.runner import ModelRunner
from engine.structured import StructuredOutputs

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    checkpoint: object  # engine.models.loader.Checkpoint
    runner: ModelRunner
    pool: BlockPool
    scheduler_config: SchedulerConfig
    eos_ids: frozenset[int]
    structured: object | None = None  # engine.structured.StructuredOutputs, None without tokenizer.json


def hybrid_kv_refused(config: EngineConfig) -> str | None:
    """Why a model whose windowed and global layers are interleaved keeps one block table
    (None: it takes a table per KV group, engine/kv_groups.py)."""
    if not config.cache.hybrid_kv:
        return "--disable-hybrid-kv-cache-manager"
    if config.speculative.method == "draft":
        return "a draft model reads the whole context through the first table"
    if config.cache.has_tiers:
        return "the KV tiers keep blocks by one table's names"
    return None


def build_parts(config: EngineConfig, checkpoint=None, launcher=None) -> EngineParts:
    """`launcher`: under tensor parallelism, what starts ranks 1..N-1 (engine/parallel/ranks.py;
    default: child processes)."""
    from engine.models.builtin import builtin_model_path
    from engine.models.checkpoint import load_checkpoint
    from engine.models.loader import build_model

    t0 = time.monotonic()
    device = torch.device(config.device.device)
    snapshot = MemorySnapshot.take(device) if device.type == "cuda" else None  # before the weights
    ckpt = checkpoint or load_checkpoint(config.model or builtin_model_path(), dtype=config.dtype,
                                         quantization=config.quantization,
                                         kv_cache_dtype=config.cache.kv_cache_dtype)
    if config.dtype is None and (dtype := auto_dtype(ckpt.config.dtype, device)) != ckpt.config.dtype:
        log.info("dtype auto on %s: the %s checkpoint runs in %s (--dtype float32 keeps it)", device,
                 ckpt.config.dtype, dtype)
        ckpt = dataclasses.replace(ckpt, config=dataclasses.replace(ckpt.config, dtype=dtype))
    max_len = min(config.scheduler.max_model_len, ckpt.config.max_position_embeddings)
    window = ckpt.config.sliding_window
    if window is not None and window < max_len and ckpt.config.sliding_layers:
        log.info("sliding-window attention: %d of the %d layers see the last %d positions",
                 len(ckpt.config.sliding_layers), ckpt.config.num_layers, window)
    sched = dataclasses.replace(config.scheduler, max_model_len=max_len)
    if (window is not None and len(ckpt.config.sliding_layers) == ckpt.config.num_layers
            and config.speculative.method != "draft"):  # a draft model's layers read the whole context
        sched = dataclasses.replace(sched, free_outside_window=window)
    if KVGroups.plan(ckpt.config.num_layers, ckpt.config.window_of).hybrid and window is not None and window < max_len:
        why_not = hybrid_kv_refused(config)
        if why_not is None:
            ckpt = dataclasses.replace(ckpt, config=dataclasses.replace(ckpt.config, kv_hybrid=True))
            groups = ckpt.config.kv_groups
            sched = dataclasses.replace(sched, kv_group_windows=groups.windows[1:])
            log.info("%s: the windowed layers' blocks outside the window go back to the pool", groups.describe())
        else:
            log.info("windowed and global layers keep one block table: every block is kept (%s)", why_not)
    if ckpt.config.long_rope_from is not None and ckpt.config.long_rope_from < max_len:
        sched = dataclasses.replace(sched, long_rope_from=ckpt.config.long_rope_from)
        log.info("LongRoPE: prompts longer than %d tokens rotate with the long factors", ckpt.config.long_rope_from)
    if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_len:
        sched = dataclasses.replace(sched, max_num_batched_tokens=max_len)
    step_limits = (sched.max_num_batched_tokens, sched.max_num_seqs, max_len)
    tp = config.parallel.tensor_parallel_size
    if tp > 1:
        from engine.parallel.start import start_ranks

        ranks = start_ranks(config, ckpt, step_limits, launcher)
        model = build_model(ckpt, ranks.devices[0].device, ranks.shard)
        model.set_tensor_parallel(ranks.comm, config.parallel.vocab_parallel_head)
        t1 = time.monotonic()
        runner = ModelRunner(model, ranks.model_config, ranks.cache, ranks.devices[0], sampler_seed=config.seed,
                             step_limits=step_limits, snapshot=snapshot, comm=ranks.comm)
        ranks.join(runner)
    else:
        model = build_model(ckpt, config.device.device)
        t1 = time.monotonic()
        runner = ModelRunner(model, ckpt.config, config.cache, config.device, sampler_seed=config.seed,
                             step_limits=step_limits, snapshot=snapshot)
    t2 = time.monotonic()
    pool = BlockPool(runner.kv_cache.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
    kv_bytes = runner.kv_cache.kv.numel() * runner.kv_cache.kv.element_size()
    per_rank = f" a rank (of {tp})" if tp > 1 else ""
    log.info("engine: %s (%s) weights loaded in %.2f s; %d KV blocks of %d tokens (%.0f MiB%s) and the %s "
             "attention kernel in %.2f s", ckpt.path, ckpt.config.dtype, t1 - t0, pool.num_blocks, pool.block_size,
             kv_bytes / 2**20, per_rank, runner.backend.name, t2 - t1)
    budget = KVBudget(pool.num_blocks, pool.block_size, kv_bytes // max(1, pool.num_blocks), sched.max_num_seqs,
                      sched.expected_context_len or sched.max_model_len)
    if sched.expected_context_len is not None and not budget.fits:
        log.warning("KV budget%s: %s. Expect preemptions at full load: lower --max-num-seqs to %d, or give the "
                    "cache more memory (--kv-cache-memory-gb / --num-blocks)", per_rank, budget, budget.seqs_that_fit)
    else:
        log.info("KV budget%s: %s", per_rank, budget)
    if config.cache.has_tiers:
        open_tiers(config.cache, runner, pool, tp)
    eos = frozenset(ckpt.config.eos_token_ids)
    return EngineParts(ckpt, runner, pool, sched, eos,
                       StructuredOutputs.for_checkpoint(ckpt.path, eos, config.grammar))


def open_tiers(cache, runner: ModelRunner, pool: BlockPool, tp: int = 1) -> None:
    """The KV tiers below the device (engine/kv_tiers.py): the index on the pool, a store
    on every rank. Sizes are the worker's, all ranks together."""
    from engine.kv_tiers import TierIndex

    block_bytes = runner.kv_cache.layout.block_bytes * tp  # a block of the worker: every rank's share

    def blocks(gb: float) -> int:
        return int(gb * (1 << 30)) // block_bytes

    index = TierIndex(pool.block_size, block_bytes, blocks(cache.offload_host_gb), blocks(cache.swap_space_gb),
                      blocks(cache.offload_disk_gb), on_device=pool.holds, emit_removed=pool.emit_removed)
    if (cache.offload_host_gb and not index.host_blocks) or (cache.swap_space_gb and not index.swap_blocks) or \
            (cache.offload_disk_gb and not index.disk_blocks):
        raise ConfigError(f"a KV tier smaller than one block ({block_bytes / (1 << 20):.2f} MiB): raise it")
    runner.open_kv_tiers(index.num_slots, cache.offload_disk_path if index.disk_blocks else None)
    pool.lower = index
    log.info("KV tiers: host %d blocks (%.1f GiB), swap %d blocks (%.1f GiB), disk %d blocks (%.1f GiB%s)",
             index.host_blocks, cache.offload_host_gb, index.swap_blocks, cache.swap_space_gb, index.disk_blocks,
             cache.offload_disk_gb, f" under {cache.offload_disk_path}" if index.disk_blocks else "")


def auto_dtype(checkpoint_dtype: str, device: torch.device) -> str:
    """`--dtype auto`: the checkpoint's, except fp32 on CUDA, which runs in bf16 (half
    the bytes a token reads, tensor cores; the same exponent range as fp32)."""
    if device.type == "cuda" and checkpoint_dtype == "float32":
        return "bfloat16"
    return checkpoint_dtype


@dataclass(frozen=True)
class KVBudget:
    """How many sequences of `context_len` tokens the KV cache holds at once, against
    max_num_seqs: KV bytes a token x max_num_seqs x context, against the cache's size.
    A sequence holds whole blocks, so its context is rounded up to blocks."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_num_seqs: int
    context_len: int

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.context_len // self.block_size)

    @property
    def seqs_that_fit(self) -> int:
        return self.num_blocks // self.blocks_per_seq

    @property
    def fits(self) -> bool:
        return self.seqs_that_fit >= self.max_num_seqs

    def __str__(self) -> str:
        per_token = self.bytes_per_block / self.block_size
        need = self.max_num_seqs * self.blocks_per_seq
        return (f"{per_token / 1024:.1f} KiB of KV a token x max-num-seqs {self.max_num_seqs} x {self.context_len} "
                f"tokens a sequence = {need * self.bytes_per_block / 2**30:.2f} GiB ({need} blocks) against a cache "
                f"of {self.num_blocks} blocks ({self.num_blocks * self.bytes_per_block / 2**30:.2f} GiB): "
                f"{self.seqs_that_fit} such sequences fit at once")
