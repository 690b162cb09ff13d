"""Which quantization a model's linear layers carry, and where it comes from: torch-free,
so the command line and the routers can check a checkpoint without loading torch.

Two sources:

* online (`--quantization int8|fp8`): a bf16/fp32/fp16 checkpoint's linear weights
  (every decoder layer's, and an LM head of its own) are quantized as they load, one
  symmetric scale per output channel (per row of W): int8 as round(w / s) with
  s = max|w| / 127, fp8 (e4m3) as e4m3(w / s) with s = max|w| / 448. The scale of a row
  comes from the whole checkpoint row, before tensor parallelism splits it, so a model
  quantizes to the same numbers at every tensor-parallel size.
* a checkpoint quantized as published, detected from its config.json's
  `quantization_config`:
  - `quant_method: fp8` (transformers' FP8 and vLLM's older serialized FP8): block-wise
    with `weight_block_size` [bn, bk] and scales named `weight_scale_inv`, else one
    scale per tensor named `weight_scale`;
  - `quant_method: compressed-tensors` (llm-compressor's), formats float-quantized and
    int-quantized (naive-quantized too): 8-bit symmetric weights, strategy channel,
    tensor, group or block, scales named `weight_scale`.
  A layer is quantized where its weight is stored in 8 bits (F8_E4M3 or I8); the rest
  (an `ignore`d LM head, say) load as plain weights.

Either way a quantized layer holds W as q [N, K] (int8 or float8_e4m3fn) and scales
[N, G]: the weight is q * scale, with scale[n, k // group] for G = ceil(K / group)
groups along K (G = 1, group = K: per channel). Per-tensor scales are spread to every
row and block scales to every row of their block as they load, so one kernel runs them
all. Activations stay in the model's dtype (weight-only): a checkpoint's activation
scales (`input_scale`) are not used; `--dtype float32` then computes in fp32 from the
exact dequantized weights, which is what the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("int8", "fp8")  # --quantization
# a checkpoint tensor's dtype (as safetensors names it) -> the method its values are
STORED = {"I8": "int8", "F8_E4M3": "fp8"}
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "qkv_proj", "gate_up_proj")  # the last two: Phi-3's fused layers


class QuantizationError(ValueError):
    """A quantization that tandem does not serve, or a checkpoint that misstates one."""


@dataclass(frozen=True)
class WeightQuant:
    """How a model's quantized linear weights are stored.

    method: "int8" or "fp8" (e4m3), what q holds;
    source: "online", "fp8" or "compressed-tensors";
    strategy: "channel", "tensor", "group" or "block", as the checkpoint stores scales;
    block: (rows, cols) of a block scale; group: the K values a group scale covers;
    scale_name: the suffix of the scale tensors in the checkpoint."""

    method: str
    source: str = "online"
    strategy: str = "channel"
    block: tuple[int, int] | None = None
    group: int | None = None
    scale_name: str = "weight_scale"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise QuantizationError(f"quantization {self.method!r}: use one of {', '.join(METHODS)}")

    @property
    def online(self) -> bool:
        return self.source == "online"

    def group_size(self, k: int) -> int:
        """The K values one scale column covers, for a weight of K columns."""
        if self.strategy == "block":
            return self.block[1]
        if self.strategy == "group":
            return self.group
        return k

    def scale_shape(self, n: int, k: int) -> tuple[int, ...]:
        """The shape of a [n, k] weight's scale as a checkpoint stores it."""
        if self.strategy == "tensor":
            return ()  # () or (1,): either is taken
        if self.strategy == "channel":
            return (n, 1)
        if self.strategy == "group":
            return (n, -(-k // self.group))
        return (-(-n // self.block[0]), -(-k // self.block[1]))

    def describe(self) -> str:
        how = {"channel": "per channel", "tensor": "per tensor", "group": f"groups of {self.group}",
               "block": f"blocks of {self.block[0]}x{self.block[1]}" if self.block else "blocks"}[self.strategy]
        where = "quantized as it loads" if self.online else f"{self.source} checkpoint"
        return f"{self.method} weights, {how} ({where})"


def online(method: str) -> WeightQuant:
    """`--quantization METHOD` on an unquantized checkpoint."""
    return WeightQuant(method=method)


def from_hf(hf_config: dict[str, Any]) -> WeightQuant | None:
    """The quantization a config.json's `quantization_config` declares; None without one.
    QuantizationError naming the field for what tandem does not serve."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise QuantizationError("quantization_config must be an object")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise QuantizationError(f"quantization_config.quant_method={method!r} is not supported; tandem loads fp8 and "
                            "compressed-tensors (8-bit float or int weights) checkpoints, or quantizes an "
                            "unquantized one with --quantization int8|fp8")


def _fp8(qc: dict) -> WeightQuant:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"quantization_config.fmt={fmt!r}: only e4m3 fp8 weights are supported")
    block = qc.get("weight_block_size")
    if block is None:
        return WeightQuant("fp8", "fp8", "tensor")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise QuantizationError(f"quantization_config.weight_block_size={block!r}: expected [rows, cols]")
    return WeightQuant("fp8", "fp8", "block", block=(block[0], block[1]), scale_name="weight_scale_inv")


def _compressed_tensors(qc: dict) -> WeightQuant:
    fmt = qc.get("format", "float-quantized")
    if fmt not in ("float-quantized", "int-quantized", "naive-quantized"):
        raise QuantizationError(f"quantization_config.format={fmt!r} is not supported (float-quantized, "
                                "int-quantized and naive-quantized 8-bit weights are)")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise QuantizationError("quantization_config.config_groups is empty")
    schemes = []
    for name, group in groups.items():
        w = (group or {}).get("weights")
        if not w:
            raise QuantizationError(f"quantization_config.config_groups.{name}: no weights scheme "
                                    "(activation-only quantization is not supported)")
        where = f"quantization_config.config_groups.{name}.weights"
        bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
        if bits != 8 or kind not in ("float", "int"):
            raise QuantizationError(f"{where}: {bits}-bit {kind} weights are not supported (8-bit float or int are)")
        if w.get("symmetric") is False:
            raise QuantizationError(f"{where}: asymmetric weights (zero points) are not supported")
        if w.get("dynamic"):
            raise QuantizationError(f"{where}: dynamic weight scales are not supported")
        method = "fp8" if kind == "float" else "int8"
        if strategy == "block":
            block = w.get("block_structure")
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                        for b in block)):
                raise QuantizationError(f"{where}.block_structure={block!r}: expected [rows, cols]")
            schemes.append(WeightQuant(method, "compressed-tensors", "block", block=(block[0], block[1])))
        elif strategy == "group":
            size = w.get("group_size")
            if not isinstance(size, int) or size <= 0:
                raise QuantizationError(f"{where}.group_size={size!r}: expected a positive integer")
            schemes.append(WeightQuant(method, "compressed-tensors", "group", group=size))
        elif strategy in ("channel", "tensor"):
            schemes.append(WeightQuant(method, "compressed-tensors", strategy))
        else:
            raise QuantizationError(f"{where}.strategy={strategy!r} is not supported "
                                    "(channel, tensor, group and block are)")
    if len(set(schemes)) > 1:
        raise QuantizationError("quantization_config.config_groups: layers quantized in different ways "
                                f"({', '.join(sorted(s.describe() for s in set(schemes)))}) are not supported")
    return schemes[0]


def resolve(declared: WeightQuant | None, requested: str | None) -> WeightQuant | None:
    """The quantization a model runs with: a checkpoint's own, or `--quantization`'s
    online one. Asking for a different method than a quantized checkpoint holds is
    refused, as vLLM does."""
    if requested in (None, "none"):
        return declared
    if requested not in METHODS:
        raise QuantizationError(f"--quantization {requested}: use one of {', '.join(METHODS)}")
    if declared is None:
        return online(requested)
    if declared.method != requested:
        raise QuantizationError(f"--quantization {requested}, but the checkpoint is quantized to {declared.method} "
                                f"({declared.describe()}); drop the flag to serve it as it is")
    return declared


def linear_name(name: str) -> bool:
    """Whether HF tensor `name` is the weight of a decoder layer's linear layer."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LINEAR_SUFFIXES
