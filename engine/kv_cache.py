"""The paged KV cache tensor of one worker.

Layout: one contiguous tensor per worker

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
                     ^ 0 = K, 1 = V

so that
  * attention for layer l reads kv[l, 0] / kv[l, 1], each a contiguous
    [num_blocks, block_size, Hkv, D] tensor (the layout the kernels take);
  * one (layer, K|V, block) region is a contiguous run of
    block_size * Hkv * D * itemsize bytes at a computable offset, so a transport
    can describe a request's blocks, or one layer of them, as a list of
    (address, length) pairs and write them with no staging copy; and
  * the whole cache is one registration for NIXL / one buffer for TCP.

Block ownership lives in engine/block_pool.py (pure Python).
"""

from __future__ import annotations

import torch

from engine.config import CacheConfig, ModelConfig
from kv_transfer.layout import KVLayout

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def layout_for(model: ModelConfig, block_size: int, num_blocks: int = 1) -> KVLayout:
    return KVLayout(model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim, model.dtype)


class KVCache:
    def __init__(self, model: ModelConfig, cache: CacheConfig, device: torch.device) -> None:
        num_blocks = cache.resolve_num_blocks(layout_for(model, cache.block_size).block_bytes)
        self.layout = layout_for(model, cache.block_size, num_blocks)
        self.kv = torch.zeros(
            (model.num_layers, 2, num_blocks, cache.block_size, model.num_kv_heads, model.head_dim),
            dtype=TORCH_DTYPES[model.dtype],
            device=device,
        )
        self.layers = [(self.kv[i, 0], self.kv[i, 1]) for i in range(model.num_layers)]

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def block_size(self) -> int:
        return self.layout.block_size
