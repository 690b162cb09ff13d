"""Read a Hugging Face checkpoint directory: config.json, *.safetensors, tokenizer.json.

`load_checkpoint` reads configs and safetensors headers only and validates every
tensor's name and shape before any weight is read, so a wrong checkpoint fails in
milliseconds with an error naming the file and tensor. It imports no torch (the
command line and the routers check checkpoints with it); engine/models/loader.py
then streams the tensors into a model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from engine.config import ConfigError, ModelConfig, kv_cache_dtype_of
from engine.models.shapes import expected_shapes, fused_parts
from engine.quantization import scheme as quant_scheme
from engine.tokenizer import Tokenizer, TokenizerError, merged_eos_ids

INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that the model recomputes, or does not use: activation
# scales of a quantized checkpoint (tandem's activations stay in the model's dtype) and
# KV-cache scales.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".input_scale", ".k_scale", ".v_scale", ".kv_scale")
_FLOAT_DTYPES = ("F32", "BF16", "F16")


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file or holds something tandem cannot load."""


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint; its weights are read by engine/models/loader.py `iter_tensors`."""

    path: Path
    config: ModelConfig
    hf_config: dict[str, Any]
    generation_config: dict[str, Any]
    tokenizer: Tokenizer
    # tensor name -> shard file (absolute path), grouped by shard
    tensor_files: dict[str, Path]
    # the HF names of the linear layers whose weights the checkpoint stores quantized
    # (`config.quant` says how): e.g. "model.layers.0.self_attn.q_proj"; empty for an
    # unquantized checkpoint, even under --quantization (every linear layer is then)
    quantized: frozenset[str] = frozenset()


def load_checkpoint(path: str | Path, dtype: str | None = None, quantization: str | None = None,
                    kv_cache_dtype: str = "auto") -> Checkpoint:
    """Read and validate the checkpoint at `path`; `dtype` overrides config.json's;
    `quantization` ("int8", "fp8") quantizes an unquantized checkpoint as it loads
    (engine/quantization/scheme.py); `kv_cache_dtype` (--kv-cache-dtype) sets the
    config's cache dtype, and with fp8 the checkpoint's KV scales are checked.

    Raises CheckpointError naming what is wrong and where.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"model path {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(
            f"model path {path} is not a directory (expected a Hugging Face checkpoint dir)"
        )
    hf_config = _read_json(path, "config.json", required=True)
    generation_config = _read_json(path, "generation_config.json", required=False)
    config = _model_config(path, hf_config, generation_config, dtype)
    try:
        quant = quant_scheme.resolve(quant_scheme.from_hf(hf_config), quantization)
    except quant_scheme.QuantizationError as e:
        raise CheckpointError(f"{path}: {e}") from e
    config = dataclasses.replace(config, quant=quant, kv_cache_dtype=kv_cache_dtype_of(kv_cache_dtype))
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(
            f"{path}: missing tokenizer.json (tandem needs a fast-tokenizer file)"
        )
    try:
        tokenizer = Tokenizer.from_dir(path)
    except (TokenizerError, ValueError, OSError) as e:
        raise CheckpointError(f"{path}: cannot load the tokenizer: {e}") from e
    tensor_files, shapes, dtypes = _tensor_files(path)
    quantized = _check_quantized(path, config, tensor_files, shapes, dtypes)
    _check_shapes(path, config, tensor_files, shapes, quantized)
    if config.kv_cache_dtype is not None:
        _check_kv_scales(path, config, tensor_files, shapes)
    return Checkpoint(path, config, hf_config, generation_config, tokenizer, tensor_files, quantized)


# Where checkpoints quantized for an fp8 KV cache keep a layer's scales (K = stored * scale):
# the self_attn module's k_scale / v_scale (llm-compressor, AutoFP8), one kv_scale for
# both (older fp8 checkpoints), or the k/v projections' output_scale (early compressed-tensors)
KV_SCALE_NAMES = {"k": ("self_attn.k_scale", "self_attn.kv_scale", "self_attn.k_proj.output_scale"),
                  "v": ("self_attn.v_scale", "self_attn.kv_scale", "self_attn.v_proj.output_scale")}


def kv_scale_names(config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> list[dict[str, str]]:
    """Per layer, the checkpoint tensors holding its K and V cache scales (\"k\", \"v\"
    to a name), where it has them."""
    out = []
    for i in range(config.num_layers):
        found = {}
        for which, names in KV_SCALE_NAMES.items():
            for n in names:
                if f"model.layers.{i}.{n}" in shapes:
                    found[which] = f"model.layers.{i}.{n}"
                    break
        out.append(found)
    return out


def read_kv_scale(files: dict[str, Path], name: str) -> float:
    with safe_open(str(files[name]), framework="pt") as f:
        return float(f.get_tensor(name).float().reshape(-1)[0])


def _check_kv_scales(path: Path, config: ModelConfig, files: dict[str, Path],
                     shapes: dict[str, tuple[int, ...]]) -> None:
    """A KV scale is one positive, finite number a layer (per tensor); per-head or
    per-channel ones are refused."""
    for found in kv_scale_names(config, shapes):
        for name in found.values():
            if math.prod(shapes[name]) != 1:
                raise CheckpointError(f"{path}: {name} has shape {list(shapes[name])}: tandem's fp8 KV cache "
                                      "takes one scale per layer for K and one for V")
            value = read_kv_scale(files, name)
            if not 0 < value < math.inf:
                raise CheckpointError(f"{path}: {name} = {value}: a KV cache scale must be positive and finite")


def _read_json(path: Path, name: str, required: bool) -> dict[str, Any]:
    file = path / name
    if not file.is_file():
        if required:
            raise CheckpointError(
                f"{path}: missing {name} (is this a Hugging Face checkpoint directory?)"
            )
        return {}
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON: {e}") from e


def _model_config(
    path: Path, hf_config: dict, generation_config: dict, dtype: str | None
) -> ModelConfig:
    try:
        config = ModelConfig.from_hf(hf_config, dtype)
    except ConfigError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from e
    eos = tuple(sorted(merged_eos_ids(hf_config, generation_config)))
    bos = (
        config.bos_token_id
        if config.bos_token_id is not None
        else generation_config.get("bos_token_id")
    )
    return dataclasses.replace(config, eos_token_ids=eos, bos_token_id=bos)


def _tensor_files(path: Path) -> tuple[dict[str, Path], dict[str, tuple[int, ...]], dict[str, str]]:
    """Map every tensor name to its shard (from the index when there is one), shape and
    dtype (as safetensors names it: F32, BF16, F8_E4M3, I8, ...)."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(path, INDEX_FILE, required=True).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) not in {path}: {', '.join(missing)}")
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
        if not shards:
            bins = sorted(p.name for p in path.glob("*.bin"))
            hint = f" (found {', '.join(bins)}: convert them to safetensors)" if bins else ""
            raise CheckpointError(f"{path}: no *.safetensors weight files{hint}")
    files: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for shard in shards:
        for name, (shape, dt) in _shard_shapes(path / shard).items():
            files[name], shapes[name], dtypes[name] = path / shard, shape, dt
    if index.is_file():
        absent = sorted(n for n, s in weight_map.items() if files.get(n) != path / s)
        if absent:
            raise CheckpointError(
                f"{index}: tensor(s) not found in the shard it names: {_some(absent)}"
            )
    return files, shapes, dtypes


def _shard_shapes(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    try:
        with safe_open(str(file), framework="numpy") as f:  # headers only: no torch needed
            out = {}
            for name in f.keys():
                part = f.get_slice(name)
                out[name] = tuple(part.get_shape()), part.get_dtype()
            return out
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file: {e}") from e


def _check_quantized(path: Path, config: ModelConfig, files: dict[str, Path], shapes: dict[str, tuple[int, ...]],
                     dtypes: dict[str, str]) -> frozenset[str]:
    """The linear layers a checkpoint stores in 8 bits, each checked: a quantization_config
    that says so, the same method, a scale of the right shape beside it. Names the tensor
    at fault."""
    quant = config.quant
    quantized = set()
    for name, dt in dtypes.items():
        if dt not in quant_scheme.STORED:
            continue
        where = f"{files[name]}: tensor {name!r} is stored as {dt}"
        if fused_parts(config, name) is not None:
            raise CheckpointError(f"{where}: a quantized fused weight is not supported yet (serve the unquantized "
                                  "checkpoint with --quantization, which quantizes each weight it stacks)")
        if not (quant_scheme.linear_name(name) or name == "lm_head.weight"):
            raise CheckpointError(f"{where}; only linear layers (and the LM head) may be quantized")
        if quant is None or quant.online:
            raise CheckpointError(f"{where} but config.json has no quantization_config saying how to read it")
        if quant_scheme.STORED[dt] != quant.method:
            raise CheckpointError(f"{where} but quantization_config declares {quant.method} weights")
        prefix = name.removesuffix(".weight")
        scale = f"{prefix}.{quant.scale_name}"
        if scale not in shapes:
            raise CheckpointError(f"{path}: missing tensor {scale!r}, the scale of the {dt} weight {name!r}")
        n, k = shapes[name]
        want = quant.scale_shape(n, k)
        if not (shapes[scale] == want or (want == () and shapes[scale] == (1,))):
            raise CheckpointError(f"{files[scale]}: tensor {scale!r} has shape {shapes[scale]}, expected {want} "
                                  f"for {quant.describe()} of a {n}x{k} weight")
        if dtypes[scale] not in _FLOAT_DTYPES:
            raise CheckpointError(f"{files[scale]}: tensor {scale!r} is stored as {dtypes[scale]}; a scale must be "
                                  f"one of {', '.join(_FLOAT_DTYPES)}")
        quantized.add(prefix)
    if quant is not None and not quant.online:
        for i in range(config.num_layers):  # q, k and v are one fused layer: all quantized or none
            qkv = [f"model.layers.{i}.self_attn.{p}_proj" in quantized for p in "qkv"]
            if any(qkv) and not all(qkv):
                raise CheckpointError(f"{path}: layer {i}'s q, k and v projections are not all quantized alike")
        if not quantized:
            raise CheckpointError(f"{path}: config.json declares {quant.describe()} but no tensor is stored in 8 bits")
    return frozenset(quantized)


def _check_shapes(
    path: Path, config: ModelConfig, files: dict[str, Path], shapes: dict[str, tuple[int, ...]],
    quantized: frozenset[str] = frozenset(),
) -> None:
    """Every expected tensor present with its expected shape, nothing unexpected."""
    expected = expected_shapes(config)
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if config.quant is not None:
        optional |= {f"{p}.{config.quant.scale_name}" for p in quantized}
    unexpected = sorted(
        n
        for n in shapes
        if n not in expected and n not in optional and not n.endswith(IGNORED_SUFFIXES)
    )
    if unexpected:
        raise CheckpointError(
            f"{path}: unexpected tensor(s) for a {config.architecture} model: {_some(unexpected)}"
        )
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s): {_some(missing)}")
    for name, want in expected.items():
        if shapes[name] != want:
            raise CheckpointError(
                f"{files[name]}: tensor {name!r} has shape {shapes[name]}, "
                f"expected {want} from config.json"
            )


def _some(names: list[str], limit: int = 5) -> str:
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
