"""The paged KV cache tensor of one worker.

Layout: one contiguous tensor per worker

    kv: [slots, 2, num_blocks, block_size, num_kv_heads, head_dim]
                ^ 0 = K, 1 = V

where `slots` is the number of layers (or, where windowed and global layers keep their KV
in groups with tables of their own, the layers of a group: engine/kv_groups.py; layer l
then uses slot ModelConfig.kv_groups.place(l)[1]), so that
  * attention for layer l reads kv[l, 0] / kv[l, 1] (kv[slot of l]), each a contiguous
    [num_blocks, block_size, Hkv, D] tensor (the layout the kernels take);
  * one (layer, K|V, block) region is a contiguous run of
    block_size * Hkv * D * itemsize bytes at a computable offset, so a transport
    can describe a request's blocks, or one layer of them, as a list of
    (address, length) pairs and write them with no staging copy; and
  * the whole cache is one registration for NIXL / one buffer for TCP.

Block ownership lives in engine/block_pool.py (pure Python).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from engine.config import CacheConfig, ModelConfig
from kv_transfer.layout import KVLayout

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float8_e4m3fn": torch.float8_e4m3fn}


def sized_for(cache: CacheConfig, device: torch.device) -> CacheConfig:
    """`cache` with its size in GiB where a CPU cache takes `cpu_kv_fraction` of the
    memory available now (no size given), logged; else `cache` as it is."""
    if device.type != "cpu" or cache.num_blocks is not None or cache.kv_cache_memory_gb is not None \
            or cache.cpu_kv_fraction is None:
        return cache
    gb, avail = cache.cpu_kv_gb()
    log.info("kv cache: %.1f GiB, %.0f%% of the %.1f GiB available at start (at least 1; --cpu-kv-fraction, "
             "or --kv-cache-memory-gb for a size)", gb, 100 * cache.cpu_kv_fraction, avail)
    return dataclasses.replace(cache, kv_cache_memory_gb=gb)


def layout_for(model: ModelConfig, block_size: int, num_blocks: int = 1) -> KVLayout:
    return KVLayout(model.kv_groups.slots, num_blocks, block_size, model.num_kv_heads, model.head_dim,
                    model.cache_dtype)


class KVCache:
    def __init__(self, model: ModelConfig, cache: CacheConfig, device: torch.device) -> None:
        cache = sized_for(cache, device)
        num_blocks = cache.resolve_num_blocks(layout_for(model, cache.block_size).block_bytes)
        self.layout = layout_for(model, cache.block_size, num_blocks)
        groups = model.kv_groups
        self.kv = torch.zeros(
            (groups.slots, 2, num_blocks, cache.block_size, model.num_kv_heads, model.head_dim),
            dtype=TORCH_DTYPES[model.cache_dtype],
            device=device,
        )
        slots = [groups.place(i)[1] for i in range(model.num_layers)]
        self.layers = [(self.kv[s, 0], self.kv[s, 1]) for s in slots]

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def block_size(self) -> int:
        return self.layout.block_size
