"""Frozen, validated configs: one per component.

Each component is handed its own config object; nothing reads a global. Errors
raised here name the field and say what to change.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

from engine.kv_groups import KVGroups
from engine.quantization.scheme import WeightQuant

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
GEMMA = ("gemma2", "gemma3")
# where a family's sparse MLP block and its experts' three weights sit (HF names)
MOE_NAMING = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}

DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A config value is invalid; the message says which field and how to fix it."""


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # --kv-cache-dtype, vLLM's names
FP8_KV_DTYPE = "float8_e4m3fn"  # what fp8 and fp8_e4m3 store (torch's name)


def kv_cache_dtype_of(flag: str) -> str | None:
    """The cache dtype --kv-cache-dtype `flag` asks for; None: the model's own."""
    return None if flag == "auto" else FP8_KV_DTYPE


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class RopeScaling:
    """Rope scaling from config.json; `kind` is "llama3", "linear", "yarn", "longrope" or "default"."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (Qwen2.5 / Qwen3 long contexts): the ramp between interpolated and extrapolated
    # frequencies, and the factor cos and sin are multiplied by
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # LongRoPE (Phi-3 and Phi-3.5 long-context checkpoints): a divisor per frequency, one set
    # for sequences within original_max_position_embeddings, one for longer ones
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    @property
    def attention_scaling(self) -> float:
        """What cos and sin are multiplied by (YaRN's and LongRoPE's; 1 otherwise)."""
        if self.kind not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.kind == "longrope":  # transformers' default, from the ratio of the two lengths
            if self.factor <= 1.0:
                return 1.0
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim))
        return mscale(self.factor)

    @classmethod
    def from_hf(cls, d: dict[str, Any] | None, top: dict[str, Any] | None = None) -> "RopeScaling":
        """`d`: config.json's rope_scaling (or rope_parameters); `top`: the whole of it
        (Phi-3 keeps original_max_position_embeddings at the top level)."""
        if not d:
            return cls()
        kind = d.get("rope_type", d.get("type", "default"))
        if kind == "default":
            return cls()
        if kind == "su":  # LongRoPE's first name in Phi-3's configs
            kind = "longrope"
        if kind not in ("llama3", "linear", "yarn", "longrope"):
            raise ConfigError(
                f"rope_scaling type {kind!r} is not supported; supported: llama3, linear, yarn, longrope "
                "(or remove rope_scaling from config.json)"
            )
        if kind == "longrope":
            top = top or {}
            original = d.get("original_max_position_embeddings") or top.get("original_max_position_embeddings")
            if not original or not d.get("short_factor") or not d.get("long_factor"):
                raise ConfigError("rope_scaling longrope needs short_factor, long_factor and "
                                  "original_max_position_embeddings in config.json")
            factor = d.get("factor") or int(top.get("max_position_embeddings", original)) / int(original)
            return cls(kind=kind, factor=float(factor), original_max_position_embeddings=int(original),
                       attention_factor=None if d.get("attention_factor") is None else float(d["attention_factor"]),
                       short_factor=tuple(float(x) for x in d["short_factor"]),
                       long_factor=tuple(float(x) for x in d["long_factor"]))
        if kind == "yarn":
            if "original_max_position_embeddings" not in d or not d.get("factor"):
                raise ConfigError("rope_scaling yarn needs factor and original_max_position_embeddings in config.json")

            def opt(key):
                return None if d.get(key) is None else float(d[key])

            return cls(kind=kind, factor=float(d["factor"]),
                       original_max_position_embeddings=int(d["original_max_position_embeddings"]),
                       beta_fast=float(d.get("beta_fast") or 32), beta_slow=float(d.get("beta_slow") or 1),
                       attention_factor=opt("attention_factor"), mscale=opt("mscale"),
                       mscale_all_dim=opt("mscale_all_dim"), truncate=bool(d.get("truncate", True)))
        return cls(
            kind=kind,
            factor=float(d.get("factor", 1.0)),
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(d.get("original_max_position_embeddings", 8192)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape, read from a Hugging Face config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # sliding-window attention (Mistral, Qwen2 where configured): the layers in
    # `sliding_layers` see the last `sliding_window` positions only (the others all)
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # quantized linear weights (engine/quantization): the checkpoint's own, or made as it
    # loads under --quantization; None: weights in `dtype`
    quant: WeightQuant | None = None
    # the KV cache's dtype where it differs from `dtype`: "float8_e4m3fn" under
    # --kv-cache-dtype fp8 (engine/attention: stored as K / k_scale rounded to e4m3)
    kv_cache_dtype: str | None = None
    # Qwen3: an RMSNorm over each query and key head (head_dim wide) before the rotation
    qk_norm: bool = False
    # mixture of experts (Mixtral, Qwen3-MoE): the layers in `moe_layers` replace the MLP
    # with `num_experts` experts of `moe_intermediate_size`, `num_experts_per_tok` a token
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    # the experts this model (one rank's, under expert parallelism) holds: [first, stop)
    local_experts: tuple[int, int] | None = None
    norm_topk_prob: bool = True  # the top-k routing weights divided by their sum
    router_weights_fp32: bool = False  # Mixtral keeps them in fp32 (Qwen3-MoE: the model's dtype)
    # Qwen2-MoE: a shared expert (an MLP every token goes through) of this size, its
    # output weighted by a sigmoid gate and added to the routed experts'; 0: none
    shared_expert_intermediate_size: int = 0
    # Gemma 2 / 3: RMSNorm as x * (1 + w) in fp32; norms after attention and around the
    # MLP too ("sandwich"); the embedding times sqrt(hidden); GeGLU; attention scaled by
    # query_pre_attn_scalar^-0.5; scores and logits soft-capped (cap * tanh(x / cap));
    # Gemma 3's windowed layers rotate with their own rope
    gemma: bool = False
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh"
    attn_scale: float | None = None  # None: head_dim^-0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    local_rope_theta: float | None = None  # the windowed layers' rope theta (default rope), where it differs
    # windowed and global layers keep their KV in groups of their own, each with its own
    # block tables (engine/kv_groups.py; engine/build.py decides); False: one group
    kv_hybrid: bool = False

    def __post_init__(self) -> None:
        _require(
            self.architecture in SUPPORTED_ARCHITECTURES.values(), f"unknown architecture family {self.architecture!r}"
        )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            _require(getattr(self, name) > 0, f"config.json: {name} must be > 0")
        _require(
            self.num_heads % self.num_kv_heads == 0,
            f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
            f"num_key_value_heads ({self.num_kv_heads})",
        )
        _require(self.dtype in DTYPES, f"dtype {self.dtype!r} is not one of {DTYPES}")
        if self.moe_layers:
            _require(self.num_experts > 0 and 0 < self.num_experts_per_tok <= self.num_experts,
                     f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) must be in 1.."
                     f"{self.num_experts} (the experts)")
            _require(self.moe_intermediate_size > 0, "config.json: moe_intermediate_size must be > 0")
            _require(self.quant is None, "quantized weights are not supported for mixture-of-experts models yet "
                     "(drop --quantization, or serve a bf16 checkpoint)")
        r = self.rope_scaling
        if r.kind == "longrope":
            _require(len(r.short_factor) == len(r.long_factor) == self.head_dim // 2,
                     f"config.json: rope_scaling longrope needs short_factor and long_factor of head_dim / 2 = "
                     f"{self.head_dim // 2} values each (got {len(r.short_factor)} and {len(r.long_factor)})")
        _require(self.kv_cache_dtype in (None, FP8_KV_DTYPE), f"kv_cache_dtype {self.kv_cache_dtype!r} is not "
                 f"{FP8_KV_DTYPE!r}")

    @property
    def long_rope_from(self) -> int | None:
        """LongRoPE: the length past which a sequence takes the long factors (None: not LongRoPE).
        As transformers decides per forward pass (its longest position + 1): a prompt longer
        than it is long throughout, and a sequence that grows past it is computed again,
        whole, with the long factors (the scheduler's `_recompute_long`)."""
        r = self.rope_scaling
        return r.original_max_position_embeddings if r.kind == "longrope" else None

    def rope_row(self, position: int, long_prompt: bool) -> int:
        """The row of the rotary tables a token at `position` rotates with: LongRoPE's long
        factors are a second table after the short one (rows + max_position_embeddings).
        A position past the threshold is long even in a work without the flag (a draft
        model's: the scheduler recomputes its own sequences before they get there)."""
        start = self.long_rope_from
        if start is not None and (long_prompt or position >= start):
            return position + self.max_position_embeddings
        return position

    @functools.cached_property
    def kv_groups(self) -> KVGroups:
        """How the layers share the paged KV cache (engine/kv_groups.py)."""
        return KVGroups.plan(self.num_layers, self.window_of, self.kv_hybrid)

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it sees the whole context)."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def expert_range(self) -> range:
        """The experts whose weights this model holds (all of them but under expert parallelism)."""
        return range(*self.local_experts) if self.local_experts else range(self.num_experts)

    @property
    def cache_dtype(self) -> str:
        """The dtype the KV cache stores: `kv_cache_dtype`, else the model's."""
        return self.kv_cache_dtype or self.dtype

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layer = h * (q + 2 * kv) + q * h + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        mlp = 3 * h * i
        moe = self.num_experts * (3 * h * self.moe_intermediate_size + h)  # the experts and the router's row each
        moe += 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_intermediate_size else 0)
        total = self.num_layers * (layer + mlp) + len(self.moe_layers) * (moe - mlp)
        return v * h * (1 if self.tie_word_embeddings else 2) + total + h

    @classmethod
    def from_hf(cls, d: dict[str, Any], dtype: str | None = None) -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"config.json: architectures={archs!r} is not supported; tandem serves "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in d:
                raise ConfigError(f"config.json: missing required field {key!r}")
        gemma = family in GEMMA
        act = d.get("hidden_activation") or d.get("hidden_act") or "silu" if gemma else d.get("hidden_act", "silu")
        if act not in ("silu", "gelu_pytorch_tanh") or (act != "silu") != gemma:
            raise ConfigError(f"config.json: hidden_act={act!r} is not supported for {arch} (silu; Gemma's "
                              "gelu_pytorch_tanh)")
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // num_heads
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        # transformers >= 5 writes `rope_parameters` (theta inside); older checkpoints
        # have `rope_theta` and `rope_scaling` at the top level.
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        local_theta = d.get("rope_local_base_freq") if family == "gemma3" else None
        if "full_attention" in rope:  # transformers 5's Gemma 3: one rope a layer type
            local_theta = rope.get("sliding_attention", {}).get("rope_theta", local_theta)
            rope = rope["full_attention"]
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        partial = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0)
        if partial != 1.0:
            raise ConfigError(f"config.json: partial_rotary_factor={partial} (a rotation of part of each head) is "
                              "not supported yet")
        torch_dtype = d.get("torch_dtype") or d.get("dtype") or "float32"
        if torch_dtype not in DTYPES:
            torch_dtype = "float32"
        return cls(
            architecture=family,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=RopeScaling.from_hf(rope, d),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=family in ("qwen2", "qwen2_moe") or bool(d.get("attention_bias", False)),
            o_bias=family not in ("qwen2", "qwen2_moe") and bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            dtype=dtype if dtype not in (None, "auto") else torch_dtype,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=_sliding_window(d),
            sliding_layers=_sliding_layers(d),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
            gemma=gemma,
            hidden_act=act,
            attn_scale=float(d["query_pre_attn_scalar"]) ** -0.5 if gemma and d.get("query_pre_attn_scalar") else None,
            attn_softcap=_cap(d.get("attn_logit_softcapping")) if gemma else None,
            final_softcap=_cap(d.get("final_logit_softcapping")) if gemma else None,
            local_rope_theta=float(local_theta) if local_theta and float(local_theta) != float(rope_theta) else None,
            **_moe(family, d),
        )


def _cap(value: Any) -> float | None:
    return float(value) if value else None


def _moe(family: str, d: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral or Qwen3-MoE config.json; {} otherwise."""
    if family not in MOE_NAMING:
        return {}
    experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
    layers = int(d["num_hidden_layers"])
    if family == "mixtral":
        sparse, size = range(layers), int(d["intermediate_size"])
    else:  # Qwen2/3-MoE: every `decoder_sparse_step`-th layer not listed in mlp_only_layers
        step, dense = int(d.get("decoder_sparse_step", 1) or 1), set(d.get("mlp_only_layers") or ())
        sparse = [i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0]
        size = int(d.get("moe_intermediate_size") or 0)
    shared = int(d.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
    return dict(num_experts=experts, num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
                shared_expert_intermediate_size=shared,
                moe_intermediate_size=size, moe_layers=tuple(sparse),
                norm_topk_prob=family == "mixtral" or bool(d.get("norm_topk_prob", False)),
                router_weights_fp32=family == "mixtral")


def _sliding_layers(d: dict[str, Any]) -> tuple[int, ...]:
    """The layers with a sliding window: those `layer_types` calls so (transformers 5
    writes it; Qwen2 from max_window_layers on), else every layer when there is a window."""
    if _sliding_window(d) is None:
        return ()
    n = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if types:
        return tuple(i for i, t in enumerate(types[:n]) if t == "sliding_attention")
    if "max_window_layers" in d and d.get("model_type") == "qwen2":
        return tuple(range(int(d["max_window_layers"]), n))
    return tuple(range(n))


def _sliding_window(d: dict[str, Any]) -> int | None:
    """The attention window a checkpoint really uses (Qwen2 lists one but disables it)."""
    window = d.get("sliding_window")
    if not window or d.get("use_sliding_window") is False:
        return None
    return int(window)


DEFAULT_CPU_KV_GB = 1.0


def default_block_size(device: str) -> int:
    """Tokens per KV block where none is asked for: 16 on CUDA; 64 on CPU, where decode
    attention reads a sequence's blocks from memory one run at a time and each new run
    starts cold: at small's shape (200 sequences of 320 tokens, blocks scattered) a layer's
    decode attention takes 2.0-2.1 ms in blocks of 64 against 2.3-2.5 ms in blocks of 16
    (docs/performance.md, twelfth round). vLLM's CPU build defaults to 128."""
    return 64 if str(device).startswith("cpu") else 16


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing.

    `num_blocks` wins when given, then `kv_cache_memory_gb`. Without either a CUDA
    worker sizes the cache from the device (`gpu_memory_utilization`, engine/memory.py);
    a CPU engine takes `cpu_kv_fraction` of the memory available when its cache is
    made (at least DEFAULT_CPU_KV_GB) where that is set, as served workers set it
    (`--cpu-kv-fraction`), else DEFAULT_CPU_KV_GB (offline engines, tests).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    cpu_kv_fraction: float | None = None
    # --kv-cache-dtype: "auto" (the model's dtype) or "fp8" / "fp8_e4m3" (float8 e4m3, with
    # the checkpoint's per-layer k/v scales where it has them, else 1.0, as vLLM)
    kv_cache_dtype: str = "auto"
    # KV tiers below the device (engine/kv_tiers.py), per worker: host memory for blocks the
    # prefix cache evicts (--kv-offload-host-gb), files under a local path fed from it
    # (--kv-offload-disk-path, --kv-offload-disk-gb), and host memory for preempted
    # sequences' blocks (--swap-space, vLLM's name). 0: no such tier.
    offload_host_gb: float = 0.0
    offload_disk_path: str | None = None
    offload_disk_gb: float = 0.0
    swap_space_gb: float = 0.0
    # where windowed and global layers are interleaved (Gemma 2 / 3), a table per group of
    # layers so that the windowed layers give back blocks outside their window
    # (engine/kv_groups.py); False (--disable-hybrid-kv-cache-manager, vLLM's flag): one table
    hybrid_kv: bool = True

    @property
    def has_tiers(self) -> bool:
        return bool(self.offload_host_gb or self.swap_space_gb)

    def __post_init__(self) -> None:
        _require(min(self.offload_host_gb, self.offload_disk_gb, self.swap_space_gb) >= 0,
                 "KV offload and swap sizes must be >= 0")
        _require(not self.offload_disk_gb or self.offload_disk_path,
                 "--kv-offload-disk-gb needs --kv-offload-disk-path (a local directory for the files)")
        _require(not self.offload_disk_path or self.offload_disk_gb,
                 "--kv-offload-disk-path needs --kv-offload-disk-gb (the tier's size)")
        _require(not self.offload_disk_gb or self.offload_host_gb,
                 "the disk tier is fed from host memory: give --kv-offload-host-gb too")
        _require(self.enable_prefix_caching or not (self.offload_host_gb or self.offload_disk_gb),
                 "KV offload keeps blocks by their prefix-cache hash: it needs prefix caching on")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype={self.kv_cache_dtype!r}: use one of {', '.join(KV_CACHE_DTYPES)}")
        _require(
            self.block_size in (8, 16, 32, 64, 128), f"block_size={self.block_size}: use one of 8, 16, 32, 64, 128"
        )
        _require(self.num_blocks is None or self.num_blocks >= 2, "num_blocks must be at least 2")
        _require(self.kv_cache_memory_gb is None or self.kv_cache_memory_gb > 0, "kv_cache_memory_gb must be > 0")
        _require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]")
        _require(self.cpu_kv_fraction is None or 0 < self.cpu_kv_fraction < 1, "cpu_kv_fraction must be in (0, 1)")

    def resolve_num_blocks(self, bytes_per_block: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        gb = DEFAULT_CPU_KV_GB if self.kv_cache_memory_gb is None else self.kv_cache_memory_gb
        n = int(gb * (1 << 30)) // bytes_per_block
        _require(n >= 2, f"kv_cache_memory_gb={gb} holds fewer than 2 blocks; raise it")
        return n


    def cpu_kv_gb(self, available: int | None = None) -> tuple[float, float]:
        """(GiB the cache takes, GiB available) for `cpu_kv_fraction` of the memory
        available now (psutil's estimate: free plus reclaimable), at least DEFAULT_CPU_KV_GB."""
        if available is None:
            import psutil

            available = psutil.virtual_memory().available
        avail_gb = available / (1 << 30)
        return max(DEFAULT_CPU_KV_GB, (self.cpu_kv_fraction or 0.0) * avail_gb), avail_gb


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets of one engine step (Orca / Sarathi-Serve style)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # Fraction of blocks kept free at admission so running sequences can grow.
    watermark: float = 0.01
    policy: str = "continuous"  # or "static", to measure what continuous batching buys
    # The context (prompt + output tokens) a sequence of the traffic this engine was
    # tuned for reaches; the start-up KV budget check warns when max_num_seqs of them do
    # not fit in the cache. None: no expectation given (the check only reports).
    expected_context_len: int | None = None
    # Asynchronous scheduling (decode_worker/llm_engine.py `_step_ahead`): plan and launch step
    # n+1 while the device runs step n. None: on where steps run apart from the host (CUDA)
    # and no speculative decoding; False: off (`--no-async-scheduling`); True: on (on CPU
    # it only reorders the same work: for tests).
    async_scheduling: bool | None = None
    # Every layer of the model has this sliding window (engine/build.py sets it): a
    # decoding sequence's blocks wholly before its window go back to the pool (into the
    # prefix cache, where they were named) as it grows. None: every block is kept.
    free_outside_window: int | None = None
    # KV groups (engine/kv_groups.py) after the first: their layers' windows (engine/build.py
    # sets them where windowed and global layers are interleaved); empty: one group
    kv_group_windows: tuple[int | None, ...] = ()
    # LongRoPE (engine/build.py sets it): prompts longer than this rotate with the long
    # factors throughout (ModelConfig.rope_row), so their blocks' content hashes differ
    # from a shorter prompt's blocks of the same tokens (KVCacheManager salts them)
    long_rope_from: int | None = None

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _require(self.expected_context_len is None or self.expected_context_len >= 1,
                 "expected_context_len must be >= 1")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        _require(self.max_model_len >= 1, "max_model_len must be >= 1")
        _require(0.0 <= self.watermark < 0.5, "watermark must be in [0, 0.5)")
        _require(
            self.policy in ("continuous", "static"), f"scheduler policy {self.policy!r}: use 'continuous' or 'static'"
        )
        if not self.enable_chunked_prefill:
            _require(
                self.max_num_batched_tokens >= self.max_model_len,
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}); raise it or enable chunked prefill",
            )


@dataclass(frozen=True)
class DeviceConfig:
    """Where a worker runs: device, torch threads and CPU cores it owns."""

    device: str = "cpu"
    num_threads: int | None = None
    cpu_affinity: tuple[int, ...] | None = None
    attention_backend: str = "auto"  # auto | torch | triton | cpu
    # CPU: a step whose tokens x weight parameters are at most this runs on one thread
    # (0: never; None: the serving layer decides). For a worker whose cores the router
    # and clients share: a small step gains little from a second thread, and each time
    # the serving path preempts one, the whole parallel region waits (docs/performance.md).
    serial_step_work: int | None = None
    # CPU bf16: decode steps on tandem's own linear kernels (the tile kernel where the CPU has
    # AMX, up to 256 tokens; else the row-major kernel, up to four), which keep a second copy
    # of the weights (engine/models/packed.py). Prefill workers, whose steps are whole
    # prompts, turn it off and keep only oneDNN's packed copy.
    small_batch_linear: bool = True
    # CPU, several workers on one host's cores (router/pool.py): a step also runs threads on
    # the cores of `shared_cores` whose owners are idle, as the ledger file at `core_table`
    # says (engine/cores.py). None: the worker uses its own cores only.
    core_table: str | None = None
    shared_cores: tuple[int, ...] | None = None
    # CUDA: replay decode steps from graphs captured per batch-size bucket (engine/graphs.py).
    # None: on wherever they can run (a CUDA device with the triton attention backend);
    # False: every step eager (`--enforce-eager`); True: required (`--cuda-graphs`).
    cuda_graphs: bool | None = None

    def __post_init__(self) -> None:
        _require(
            self.device == "cpu" or self.device.startswith("cuda"), f"device {self.device!r}: use 'cpu' or 'cuda[:N]'"
        )
        _require(
            self.attention_backend in ("auto", "torch", "triton", "cpu"),
            "attention_backend: use auto, torch, triton or cpu",
        )
        _require(self.num_threads is None or self.num_threads >= 1, "num_threads must be >= 1")
        _require(self.serial_step_work is None or self.serial_step_work >= 0, "serial_step_work must be >= 0")


@dataclass(frozen=True)
class ParallelConfig:
    """`--tensor-parallel-size`: how many ranks (processes, one device or a run of CPU
    cores each) hold one worker's model between them (engine/parallel/)."""

    tensor_parallel_size: int = 1
    # the ranks' all-reduce: auto (shared memory on CPU, NCCL on CUDA), shm, or torch
    # (torch.distributed: gloo on CPU, NCCL on CUDA)
    comm: str = "auto"
    # the LM head's rows split across the ranks and its logits gathered on rank 0, which
    # samples (when the ranks divide the vocabulary); False: every rank holds it whole
    # and rank 0 alone computes it (docs/performance.md has both)
    vocab_parallel_head: bool = True
    # --enable-expert-parallel: a mixture of experts' experts spread whole over the ranks
    # (E/N each) instead of every expert split N ways; attention stays tensor parallel
    enable_expert_parallel: bool = False
    rank_timeout_s: float = 60.0  # the longest one collective waits for a rank
    start_timeout_s: float = 600.0  # the longest rank 0 waits for the others to load their shards

    def __post_init__(self) -> None:
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1")
        _require(self.comm in ("auto", "shm", "torch"), "tensor-parallel comm: use auto, shm or torch")
        _require(self.rank_timeout_s > 0 and self.start_timeout_s > 0, "tensor-parallel timeouts must be > 0")


SPECULATIVE_METHODS = ("ngram", "suffix", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-method`, `--num-speculative-tokens`, `--speculative-model`."""

    method: str | None = None
    num_speculative_tokens: int = 4
    model: str | None = None  # the draft model's checkpoint (method "draft"; default: the built-in draft)
    adaptive: bool = True  # measure whether speculating pays, and size each request's draft (engine/spec_policy.py)
    # ngram: the n-gram lengths looked up, longest first (vLLM's prompt_lookup_min/max)
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            raise ConfigError("prompt_lookup_min and prompt_lookup_max: 1 <= min <= max <= 16")
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative method {self.method!r}: use one of {', '.join(SPECULATIVE_METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("num_speculative_tokens must be in 1..16")
        if self.model is not None and self.method != "draft":
            raise ConfigError("--speculative-model needs --speculative-method draft")

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass(frozen=True)
class GrammarLimits:
    """What one request's structured-output spec may cost to compile."""

    max_spec_bytes: int = 256 * 1024  # its text: a JSON schema, a regex, a choice list or a grammar
    compile_timeout_s: float = 10.0  # a worker's compile of it (the router has its own, of the same value)

    def __post_init__(self) -> None:
        if self.max_spec_bytes < 1:
            raise ValueError(f"max_spec_bytes must be positive, got {self.max_spec_bytes}")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s must be positive, got {self.compile_timeout_s}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs; each part goes to its own component."""

    model: str | None = None  # local HF checkpoint dir; None = the built-in model
    dtype: str | None = None  # None/"auto": the checkpoint's
    quantization: str | None = None  # --quantization int8|fp8 (None: as the checkpoint is)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    seed: int | None = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    grammar: GrammarLimits = field(default_factory=GrammarLimits)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

