"""Write quantized checkpoints in the formats tandem loads, from an unquantized one, and
the dequantized twin of a quantized one (its weights q * scale, in fp32) that
transformers runs as the reference. No hub here: the tests and the quality benchmark
make their FP8 and int8 checkpoints with this, laid out as the published ones are.

Formats (engine/quantization/scheme.py reads them back):
  compressed-tensors  llm-compressor's: `weight` (F8_E4M3 or I8) and `weight_scale`
                      ([N, 1] channel, [1] tensor, [N/bn, K/bk] block), `ignore: [lm_head]`
  fp8                 transformers' FP8 (block-wise, `weight_scale_inv`) or vLLM's older
                      per-tensor FP8 (`weight_scale`)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.quantization.linear import FP8, FP8_MAX, INT8_MAX, dequantize, quantize, spread_scale, to_format
from engine.quantization.scheme import from_hf, linear_name


def _quantize_blocks(w: torch.Tensor, method: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per [bn, bk] block: (q [N, K], scale [ceil(N/bn), ceil(K/bk)])."""
    n, k = w.shape
    bn, bk = block
    w = w.float()
    pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    pad[:n, :k] = w
    blocks = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)) / (INT8_MAX if method == "int8" else FP8_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    return to_format(w / full, method), scale


def _quantize_tensor(w: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax() / (INT8_MAX if method == "int8" else FP8_MAX)).clamp_min(1e-12)
    return to_format(w.float() / scale, method), scale.reshape(1)


def _copy_other_files(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)


def _read_all(src: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def _write(dst: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def write_quantized(src: str | Path, dst: str | Path, method: str = "fp8", strategy: str = "channel",
                    fmt: str = "compressed-tensors", block: tuple[int, int] = (128, 128)) -> Path:
    """Copy checkpoint `src` to `dst` with every decoder linear weight quantized (the
    embedding, norms and LM head as they are, as llm-compressor's recipes leave them).
    Returns `dst`."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    scale_name = "weight_scale_inv" if fmt == "fp8" and strategy == "block" else "weight_scale"
    out: dict[str, torch.Tensor] = {}
    for name, t in _read_all(src).items():
        if not linear_name(name):
            out[name] = t.contiguous()
            continue
        if strategy == "channel":
            q, scale = quantize(t, method)
        elif strategy == "tensor":
            q, scale = _quantize_tensor(t, method)
        elif strategy == "block":
            q, scale = _quantize_blocks(t, method, block)
        else:
            raise ValueError(f"strategy {strategy!r}")
        out[name] = q.contiguous()
        out[name.removesuffix(".weight") + "." + scale_name] = scale.float().contiguous()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _config(method, strategy, fmt, block)
    _write(dst, out, config)
    _copy_other_files(src, dst)
    return dst


def _config(method: str, strategy: str, fmt: str, block: tuple[int, int]) -> dict:
    if fmt == "fp8":
        if method != "fp8" or strategy not in ("tensor", "block"):
            raise ValueError("the fp8 format holds fp8 weights per tensor or in blocks")
        cfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
        if strategy == "block":
            cfg["weight_block_size"] = list(block)
        return cfg
    kind = "float" if method == "fp8" else "int"
    weights = {"num_bits": 8, "type": kind, "strategy": strategy, "symmetric": True, "dynamic": False}
    if strategy == "block":
        weights["block_structure"] = list(block)
    return {"quant_method": "compressed-tensors", "format": f"{kind}-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": {
                "num_bits": 8, "type": kind, "strategy": "token", "dynamic": True, "symmetric": True}}},
            "ignore": ["lm_head"], "quantization_status": "compressed"}


def write_dequantized(src: str | Path, dst: str | Path) -> Path:
    """The reference twin of quantized checkpoint `src`: every quantized weight replaced
    by q * scale in fp32, the other tensors in fp32, no quantization_config. What
    transformers runs to check a quantized model's tokens."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    quant = from_hf(config)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = _read_all(src)
    out = {}
    for name, t in tensors.items():
        prefix = name.removesuffix(".weight")
        if t.dtype in (torch.int8, FP8) and name.endswith(".weight"):
            scale = spread_scale(tensors[f"{prefix}.{quant.scale_name}"], quant.strategy, t.shape[0], t.shape[1],
                                 quant.block)
            out[name] = dequantize(t, scale, quant.group_size(t.shape[1])).contiguous()
        elif not name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
            out[name] = t.float().contiguous()
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    _write(dst, out, config)
    _copy_other_files(src, dst)
    return dst


def write_online_reference(src: str | Path, dst: str | Path, method: str) -> Path:
    """The reference twin of `src` served with `--quantization METHOD`: each decoder
    linear weight and an untied LM head quantized per channel as the loader does, then
    dequantized, in fp32."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, t in _read_all(src).items():
        if linear_name(name) or name == "lm_head.weight":
            q, scale = quantize(t, method)
            t = dequantize(q, scale, t.shape[1])
        out[name] = t.float().contiguous()
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = "float32"
    _write(dst, out, config)
    _copy_other_files(src, dst)
    return dst
