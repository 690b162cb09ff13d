"""Build a model from a checkpoint (engine/models/checkpoint.py): parameters made
without initialising them, then the tensors streamed in, shard by shard."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from engine.config import ConfigError
from engine.models.checkpoint import IGNORED_SUFFIXES, Checkpoint, kv_scale_names, read_kv_scale
from engine.models.llama import LlamaForCausalLM
from engine.models.shapes import fused_parts
from engine.parallel.shard import ROW_PARALLEL, Shard, holds, local_config, shard_scale, shard_tensor
from engine.quantization.linear import QuantLinear, quantize, spread_scale
from engine.quantization.scheme import linear_name

log = logging.getLogger(__name__)


def torch_dtype(checkpoint: Checkpoint) -> torch.dtype:
    """The dtype weights are loaded in (config.dtype as a torch.dtype)."""
    return getattr(torch, checkpoint.config.dtype)


def iter_tensors(checkpoint: Checkpoint, shard: Shard = Shard()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every tensor, file by file, in `config.dtype`: the
    part of it tensor-parallel rank `shard` holds (engine/parallel/shard.py), read
    without reading the rest.

    A quantized linear layer (config.quant) yields its 8-bit weight and, as
    `<layer>.weight_scale`, its scales as [rows, groups] fp32 (per-tensor and block
    scales spread to rows, engine/quantization/linear.py). Online quantization
    quantizes the whole checkpoint tensor, then shards it."""
    dtype = torch_dtype(checkpoint)
    cfg, quant = checkpoint.config, checkpoint.config.quant
    scales = {f"{p}.{quant.scale_name}" for p in checkpoint.quantized} if quant is not None else set()
    by_file: dict[Path, list[str]] = {}
    for name, file in checkpoint.tensor_files.items():
        if name not in scales and not name.endswith(IGNORED_SUFFIXES) and holds(name, cfg, shard):
            by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                parts = fused_parts(cfg, name)
                if parts is not None:  # read whole, then each stacked weight as if stored alone
                    yield from _unfused(checkpoint, f.get_tensor(name), parts, shard)
                    continue
                prefix = name.removesuffix(".weight")
                if prefix in checkpoint.quantized or (quant is not None and quant.online and (
                        linear_name(name) or name == "lm_head.weight")):
                    yield from _quantized(checkpoint, f, name, shard)
                    continue
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

                yield name, shard_tensor(name, get, cfg, shard).to(dtype)


def _unfused(checkpoint: Checkpoint, whole: torch.Tensor, parts, shard: Shard):
    """The weights a fused tensor stacks (`parts`: engine/models/shapes.py fused_parts),
    each rank `shard`'s part, quantized under --quantization as its own layer."""
    cfg, quant = checkpoint.config, checkpoint.config.quant
    for name, row, rows in parts:
        t = whole[row:row + rows]
        if quant is not None and quant.online and linear_name(name):
            q, scale = quantize(t, quant.method)
            yield name, shard_tensor(name, lambda r, c, q=q: _part(q, r, c), cfg, shard)
            yield f"{name.removesuffix('.weight')}.weight_scale", shard_scale(
                name, scale, quant.group_size(q.shape[1]), q.shape[1], cfg, shard)
        else:
            yield name, shard_tensor(name, lambda r, c, t=t: _part(t, r, c), cfg, shard).to(torch_dtype(checkpoint))


def _quantized(checkpoint: Checkpoint, f, name: str, shard: Shard):
    """(name, q) and (`<layer>.weight_scale`, scales) of rank `shard`."""
    quant, cfg = checkpoint.config.quant, checkpoint.config
    prefix = name.removesuffix(".weight")
    if quant.online:
        q, scale = quantize(f.get_tensor(name), quant.method)
    else:
        q = f.get_tensor(name)
        with safe_open(str(checkpoint.tensor_files[f"{prefix}.{quant.scale_name}"]), framework="pt") as sf:
            stored = sf.get_tensor(f"{prefix}.{quant.scale_name}")
        scale = spread_scale(stored, quant.strategy, q.shape[0], q.shape[1], quant.block)
    group = quant.group_size(q.shape[1])
    yield name, shard_tensor(name, lambda rows, cols: _part(q, rows, cols), cfg, shard)
    yield f"{prefix}.weight_scale", shard_scale(name, scale, group, q.shape[1], cfg, shard)


def _part(t: torch.Tensor, rows, cols) -> torch.Tensor:
    if rows is not None:
        t = t[rows.start:rows.stop]
    return t if cols is None else t[:, cols.start:cols.stop]


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
        if cfg.quant is not None:
            quantize_modules(model, checkpoint, shard)
    _materialize(model, device)
    with torch.device(device):
        model.set_rotary(cfg)  # its cos/sin tables are computed, not loaded
    model.load_weights(iter_tensors(checkpoint, shard))
    if cfg.kv_cache_dtype is not None:
        set_kv_scales(model, checkpoint)
    if device.type == "cuda" and cfg.moe_layers:  # the grouped Triton kernels read stacked experts
        for layer in model.layers:
            if hasattr(layer.mlp, "stack_experts"):
                layer.mlp.stack_experts()
    return model.eval()


def set_kv_scales(model: LlamaForCausalLM, checkpoint: Checkpoint) -> None:
    """Each attention layer's fp8 KV cache scales (K, V): the checkpoint's where it has
    them (engine/models/checkpoint.py KV_SCALE_NAMES), else 1.0, as vLLM does. Every
    tensor-parallel rank holds the same ones (a scale covers the whole layer)."""
    shapes = {n: () for n in checkpoint.tensor_files}
    missing = 0
    for layer, found in zip(model.layers, kv_scale_names(checkpoint.config, shapes)):
        scales = []
        for which in ("k", "v"):
            name = found.get(which)
            if name is None:
                scales.append(1.0)
                missing += 1
                continue
            scales.append(read_kv_scale(checkpoint.tensor_files, name))  # checked by load_checkpoint
        layer.self_attn.kv_scales = (scales[0], scales[1])
    if missing:
        log.warning("fp8 KV cache: %d of the %d K/V scales are not in the checkpoint and are 1.0 (as vLLM's "
                    "default; values beyond +-448 saturate)", missing, 2 * len(model.layers))


def quantize_modules(model: LlamaForCausalLM, checkpoint: Checkpoint, shard: Shard = Shard()) -> int:
    """Make the linear layers that load quantized QuantLinears (on the meta device, before
    the weights): under --quantization every decoder linear layer and an LM head of its
    own (a tied one is the embedding, which stays as it is), else those the checkpoint
    stores in 8 bits. Returns how many; sets `model.quantized`, their HF names."""
    quant = checkpoint.config.quant
    names = set()
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        for hf, parent, attr in ((p + "self_attn.q_proj", layer.self_attn, "qkv_proj"),
                                 (p + "self_attn.o_proj", layer.self_attn, "o_proj"),
                                 (p + "mlp.gate_proj", layer.mlp, "gate_proj"),
                                 (p + "mlp.up_proj", layer.mlp, "up_proj"),
                                 (p + "mlp.down_proj", layer.mlp, "down_proj")):
            if not (quant.online or hf in checkpoint.quantized):
                continue
            module = getattr(parent, attr)
            k = module.in_features
            whole = k * (shard.size if attr in ROW_PARALLEL else 1)  # the checkpoint row's columns
            group = quant.group_size(whole)
            if group >= whole:
                group = k  # one scale a row: the rank's columns of it share the row's scale
            elif k % group:
                raise ConfigError(f"--tensor-parallel-size {shard.size} splits {hf}'s {whole} input columns into "
                                  f"runs of {k}, which do not hold whole groups of {group} sharing a scale")
            setattr(parent, attr, QuantLinear(k, module.out_features, module.bias is not None, quant.method, group,
                                              bias_dtype=None if module.bias is None else module.bias.dtype))
            names.add(hf)
            if attr == "qkv_proj":
                names |= {p + "self_attn.k_proj", p + "self_attn.v_proj"}
    head = model.lm_head
    if head is not None and (quant.online or "lm_head" in checkpoint.quantized):
        model.lm_head = QuantLinear(head.in_features, head.out_features, False, quant.method,
                                    quant.group_size(head.in_features))
        names.add("lm_head")
    model.quantized = frozenset(names)
    return len(names)


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
