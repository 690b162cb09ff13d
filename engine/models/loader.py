"""Build a model from a checkpoint (engine/models/checkpoint.py): parameters made
without initialising them, then the tensors streamed in, shard by shard."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from engine.models.checkpoint import Checkpoint
from engine.models.llama import LlamaForCausalLM, Rotary
from engine.parallel.shard import Shard, local_config, shard_tensor


def torch_dtype(checkpoint: Checkpoint) -> torch.dtype:
    """The dtype weights are loaded in (config.dtype as a torch.dtype)."""
    return getattr(torch, checkpoint.config.dtype)


def iter_tensors(checkpoint: Checkpoint, shard: Shard = Shard()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every tensor, file by file, in `config.dtype`: the
    part of it tensor-parallel rank `shard` holds (engine/parallel/shard.py), read
    without reading the rest."""
    dtype = torch_dtype(checkpoint)
    by_file: dict[Path, list[str]] = {}
    for name, file in checkpoint.tensor_files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                if shard.size == 1:
                    yield name, f.get_tensor(name).to(dtype)
                    continue
                part = f.get_slice(name)

                def get(rows, cols, part=part):
                    if rows is None and cols is None:
                        return part[:]
                    if cols is None:
                        return part[rows.start:rows.stop]
                    return part[:, cols.start:cols.stop]

                yield name, shard_tensor(name, get, checkpoint.config, shard).to(dtype)


def build_model(checkpoint: Checkpoint, device: str | torch.device = "cpu", shard: Shard = Shard()) -> LlamaForCausalLM:
    """Instantiate the model in the checkpoint's dtype on `device`, load it, set eval mode.
    Under tensor parallelism, rank `shard`'s part of it (engine/parallel/shard.py).

    Parameters are created on the meta device and materialised once, uninitialised, on
    `device`, so peak memory is one copy of the weights.
    """
    device = torch.device(device)
    cfg = local_config(checkpoint.config, shard)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, rotary=False).to(torch_dtype(checkpoint))
    _materialize(model, device)
    with torch.device(device):
        model.rotary = Rotary(cfg)  # its cos/sin tables are computed, not loaded
    model.load_weights(iter_tensors(checkpoint, shard))
    return model.eval()


def _materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Module.to_empty, by hand: it allocates through torch's reference ops (torch._refs),
    whose first use imports sympy and more, about 0.5 s of every worker's start-up. No
    parameter is shared in these models (a tied lm_head is None), so none is copied twice."""
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                m._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                         requires_grad=p.requires_grad)
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
