"""Which part of the model each tensor-parallel rank holds (Megatron-style).

Per decoder layer, rank r of N holds:

* attention: query heads [r*H/N, (r+1)*H/N) and the KV heads they read. With N <= Hkv,
  KV heads [r*Hkv/N, (r+1)*Hkv/N); with N > Hkv (N a multiple of Hkv), the one KV head
  r // (N / Hkv), so N / Hkv ranks hold each KV head (replicated, as vLLM does). q, k
  and v are column-parallel (rows of their weights), o_proj row-parallel (its columns);
* the MLP: gate and up column-parallel, down row-parallel, over the intermediate size
  I/N; a mixture of experts the same way inside every expert (each rank holds 1/N of each
  expert's intermediate size; the router whole);
* the embedding and the norms: whole, on every rank; the LM head is split by vocabulary
  after loading (engine/models/llama.py `set_tensor_parallel`) and its logits gathered
  on rank 0, which alone samples (engine/runner.py).

A row-parallel output is a partial sum: the layer all-reduces it (engine/models/llama.py),
and its bias is added once, on rank 0. The KV cache of a rank holds its KV heads only, so
a block is 1/N of the bytes (1/Hkv of them when replicated).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of a `size`-way tensor-parallel group."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # a mixture of experts: whole experts per rank, not a slice of each

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of {self.size}")


def check_divisible(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """Raise ConfigError, naming the numbers, when `size` ranks cannot split the model."""
    if size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    problems = []
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads (nor is {size} a multiple of them)")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate size {cfg.intermediate_size}")
    if cfg.shared_expert_intermediate_size % size:
        problems.append(f"shared expert's intermediate size {cfg.shared_expert_intermediate_size}")
    if cfg.moe_layers and expert_parallel and cfg.num_experts % size:
        problems.append(f"{cfg.num_experts} experts")
    elif cfg.moe_layers and not expert_parallel and cfg.moe_intermediate_size % size:
        problems.append(f"experts' intermediate size {cfg.moe_intermediate_size}")
    if problems:
        raise ConfigError(f"--tensor-parallel-size {size} does not divide the model's {', '.join(problems)}")


def kv_heads_per_rank(cfg: ModelConfig, size: int) -> int:
    return max(1, cfg.num_kv_heads // size)



def kv_heads_of(cfg: ModelConfig, shard: Shard) -> range:
    """The model's KV heads that `shard` holds, in the order its cache stores them."""
    return kv_heads_for(cfg.num_kv_heads, shard.size, shard.rank)


def kv_heads_for(num_kv_heads: int, size: int, rank: int) -> range:
    """`kv_heads_of` from the numbers alone."""
    if size <= num_kv_heads:
        n = num_kv_heads // size
        return range(rank * n, (rank + 1) * n)
    first = rank // (size // num_kv_heads)
    return range(first, first + 1)


def local_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The shape one rank's modules and KV cache take."""
    if shard.size == 1:
        return cfg
    check_divisible(cfg, shard.size, shard.expert_parallel)
    experts = {}
    if shard.expert_parallel and cfg.moe_layers:
        n = cfg.num_experts // shard.size
        experts = dict(local_experts=(shard.rank * n, (shard.rank + 1) * n))
    elif cfg.moe_layers:
        experts = dict(moe_intermediate_size=cfg.moe_intermediate_size // shard.size)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // shard.size,
                               num_kv_heads=kv_heads_per_rank(cfg, shard.size),
                               intermediate_size=cfg.intermediate_size // shard.size,
                               shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // shard.size,
                               **experts)


def holds(name: str, cfg: ModelConfig, shard: Shard) -> bool:
    """Whether rank `shard` loads checkpoint tensor `name` at all: under expert
    parallelism another rank's experts are not read."""
    if not (shard.expert_parallel and shard.size > 1 and ".experts." in name):
        return True
    e = int(name.split(".experts.", 1)[1].split(".", 1)[0])
    n = cfg.num_experts // shard.size
    return shard.rank * n <= e < (shard.rank + 1) * n


ROW_PARALLEL = ("o_proj", "down_proj")  # row-parallel: a rank holds columns of their weights
EXPERT_COLUMN, EXPERT_ROW = ("gate_proj", "up_proj", "w1", "w3"), ("down_proj", "w2")  # Qwen3-MoE's, Mixtral's


def shard_tensor(name: str, get, cfg: ModelConfig, shard: Shard) -> torch.Tensor:
    """Rank `shard`'s part of the checkpoint tensor `name` (HF naming).
    `get(rows, cols)` reads a slice (ranges, or None for all) without reading the rest,
    as safetensors' `get_slice` does."""
    if shard.size == 1:
        return get(None, None)
    parts = name.split(".")
    proj, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
    hd = cfg.head_dim
    if ".experts." in name and shard.expert_parallel:
        return get(None, None)  # a whole expert (`holds` said it is this rank's)
    if ".experts." in name:
        n = cfg.moe_intermediate_size // shard.size
        part = range(shard.rank * n, (shard.rank + 1) * n)
        if proj in EXPERT_COLUMN:
            return get(part, None)
        if proj in EXPERT_ROW:
            return get(None, part)
    if proj == "q_proj":
        n = cfg.num_heads // shard.size * hd
        rows = range(shard.rank * n, (shard.rank + 1) * n)
        return get(rows, None)
    if proj in ("k_proj", "v_proj"):
        heads = kv_heads_of(cfg, shard)
        return get(range(heads.start * hd, heads.stop * hd), None)
    size = cfg.shared_expert_intermediate_size if ".shared_expert." in name else cfg.intermediate_size
    if proj in ("gate_proj", "up_proj"):
        n = size // shard.size
        return get(range(shard.rank * n, (shard.rank + 1) * n), None)
    if proj in ROW_PARALLEL:
        if kind == "bias":  # added once, after the all-reduce's sum
            t = get(None, None)
            return t if shard.rank == 0 else torch.zeros_like(t)
        n = (cfg.num_heads * hd if proj == "o_proj" else size) // shard.size
        return get(None, range(shard.rank * n, (shard.rank + 1) * n))
    return get(None, None)  # embedding, norms, LM head: every rank holds them whole


def shard_scale(name: str, scale: torch.Tensor, group: int, k: int, cfg: ModelConfig, shard: Shard) -> torch.Tensor:
    """Rank `shard`'s part of the scales [N, G] of the quantized weight `name` (a [N, k]
    weight, `group` columns a scale): the rows it holds of a column-parallel layer; of a
    row-parallel one, the scale columns of the weight columns it holds (with one scale a
    row, the whole of it)."""
    def get(rows, cols):
        if rows is not None:
            return scale[rows.start:rows.stop]
        if cols is None or scale.shape[1] == 1:
            return scale
        if cols.start % group:
            raise ConfigError(f"--tensor-parallel-size {shard.size} splits {name}'s {k} columns at {cols.start}, "
                              f"inside a group of {group} that shares a scale")
        return scale[:, cols.start // group:-(-cols.stop // group)]

    return shard_tensor(name, get, cfg, shard).contiguous()
