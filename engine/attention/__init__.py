"""Attention backends behind one small ABC, chosen by name with lazy imports.

An fp8 KV cache (--kv-cache-dtype fp8) holds float8 e4m3 values: each layer's keys
divided by its K scale and rounded (saturating at +-448), its values likewise by its V
scale. Every path then attends over those rounded keys and values, the step's own new
rows included (`AttentionBackend.forward` rounds them before a prefill reads them), so a
prompt's answer is the same whether its K/V came from this step, a cached prefix or a
transfer. The kernels fold the K scale into the softmax scale and the V scale into the
output's normalisation.

`torch` (engine/attention/reference.py) runs anywhere; `triton` (engine/attention/triton/)
runs the KV store, paged decode and ragged (varlen) paged prefill as Triton kernels on
CUDA; `cpu` (engine/attention/cpu/) runs paged decode as a C++ kernel compiled on first
use and prefill on the reference. `auto` picks triton on CUDA and cpu on CPU when they import (and build),
else torch, and says so once.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass

import torch

from engine.attention import reference
from engine.quantization.linear import FP8, to_format

log = logging.getLogger(__name__)


@dataclass
class KeptRows:
    """The rows of a step that leave the last layer: those sampled from. A prefill
    chunk's other rows need only their keys and values from the last layer, not its
    attention output, o_proj or MLP, so the model runs those on the kept rows alone.
    Every kept row is the last token of its sequence so far, so its attention is one
    paged decode over these tables and lengths."""

    rows: torch.Tensor  # [K] int64, ascending indices into the step's T tokens
    block_tables: torch.Tensor  # [K, M] int32
    seq_lens: torch.Tensor  # [K] int32, context incl. the row's own token
    max_seq_len: int


@dataclass
class AttentionMetadata:
    """Where one step's tokens live. Built once per step by ModelRunner.

    Tokens are ordered decodes first (one query token each), then prefill chunks.
    """

    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [Bd, M] int32
    decode_seq_lens: torch.Tensor  # [Bd] int32, context incl. the new token
    decode_max_seq_len: int
    prefill_block_tables: torch.Tensor  # [Bp, M] int32
    prefill_query_lens: list[int]
    prefill_seq_lens: list[int]
    # the same prefill lengths on the device, for kernels (None: not built; the reference needs none)
    prefill_query_start_loc: torch.Tensor | None = None  # [Bp + 1] int32, cumulative new tokens
    prefill_seq_lens_tensor: torch.Tensor | None = None  # [Bp] int32
    # the rows the last layer computes in full (None: all of them; see KeptRows)
    kept: KeptRows | None = None
    # KV groups (engine/kv_groups.py): this metadata for each group, the first being this
    # one; the others differ in their slots and block tables. None: one group
    groups: tuple[AttentionMetadata, ...] | None = None


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """`x / scale` rounded to e4m3 (to nearest even), saturating at +-FP8_MAX."""
    y = x.float()
    if scale != 1.0:
        y = y / scale
    return to_format(y, "fp8")


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """An fp8 cache's values times `scale`, in `dtype`."""
    y = x.float()
    if scale != 1.0:
        y = y * scale
    return y.to(dtype)


class AttentionBackend(abc.ABC):
    name: str = ""
    # whether `prefill` reads the metadata's device-side prefill lengths (ModelRunner
    # builds them only then)
    prefill_tensors: bool = False

    @abc.abstractmethod
    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        """Write new keys/values [T, Hkv, D] into cache slots [T] (negative = skip)."""

    @abc.abstractmethod
    def decode(self, query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len,
               kv_scales: tuple[float, float] = (1.0, 1.0), window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """Paged attention for one query token per sequence: [B, H, D] -> [B, H, D].
        `kv_scales`: an fp8 cache's (K, V) scales; `window`: a sliding window's tokens
        (each query sees the last `window` positions, itself included); `softcap`: the
        scaled scores soft-capped as softcap * tanh(s / softcap) (Gemma 2)."""

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping,
                 kv_scales: tuple[float, float] = (1.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new rows; returns them as the cache now holds them (an fp8 cache's
        rounding, back in the key's dtype), for a prefill to attend over."""
        if k_cache.dtype != FP8:
            self.store_kv(key, value, k_cache, v_cache, slot_mapping)
            return key, value
        k8, v8 = quantize_kv(key, kv_scales[0]), quantize_kv(value, kv_scales[1])
        self.store_kv(k8, v8, k_cache, v_cache, slot_mapping)
        return dequantize_kv(k8, kv_scales[0], key.dtype), dequantize_kv(v8, kv_scales[1], value.dtype)

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        nd = meta.num_decode_tokens
        if nd == query.shape[0]:
            self.store_for_decode(key, value, k_cache, v_cache, meta.slot_mapping, kv_scales)
            return self.decode(query, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
                               meta.decode_max_seq_len, kv_scales, window, softcap)
        key, value = self.write_kv(key, value, k_cache, v_cache, meta.slot_mapping, kv_scales)
        prefill = self.prefill(query[nd:], key[nd:], value[nd:], k_cache, v_cache, meta, scale, kv_scales, window,
                               softcap)
        if nd == 0:
            return prefill
        out = torch.empty_like(query)
        out[:nd] = self.decode(query[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
                               meta.decode_max_seq_len, kv_scales, window, softcap)
        out[nd:] = prefill
        return out

    def store_for_decode(self, key, value, k_cache, v_cache, slot_mapping,
                         kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
        """Store the new rows of a step of decodes, which read them back from the cache
        only (quantized first for an fp8 cache)."""
        if k_cache.dtype == FP8:
            key, value = quantize_kv(key, kv_scales[0]), quantize_kv(value, kv_scales[1])
        self.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def prefill(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                kv_scales: tuple[float, float] = (1.0, 1.0), window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """Ragged causal attention of the step's prefill chunks, their K/V already stored
        (`key`, `value`: as stored, see write_kv); `window` and `softcap` as decode's."""
        return reference.varlen_attention(
            query, key, value, k_cache, v_cache,
            meta.prefill_block_tables, meta.prefill_query_lens, meta.prefill_seq_lens, scale, kv_scales, window,
            softcap,
        )


class TorchAttention(AttentionBackend):
    name = "torch"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def decode(self, query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, kv_scales=(1.0, 1.0),
               window=None, softcap=None):
        return reference.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len,
                                                kv_scales, window, softcap)


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """Resolve `auto|torch|triton|cpu` to a backend instance, logging the choice once.

    An explicitly named backend that cannot be had raises; `auto` falls back to torch.
    """
    if name == "torch":
        return TorchAttention()
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        return _cpu_backend(name, device)
    if name == "auto" and device.type != "cuda":
        return TorchAttention()
    try:
        from engine.attention.triton.backend import TritonAttention
    except ImportError as e:
        if name == "triton":
            raise
        log.warning("attention: triton unavailable (%s); using the torch reference", e)
        return TorchAttention()
    log.info("attention: using triton kernels on %s", device)
    return TritonAttention()


def _cpu_backend(name: str, device: torch.device) -> AttentionBackend:
    if device.type != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on CPU tensors, not {device}; use auto or triton")
    try:
        from engine.attention.cpu.backend import CpuAttention

        backend = CpuAttention()  # builds the kernel on first use per machine
    except Exception as e:  # a missing compiler/ninja or a build error must not stop the engine
        if name == "cpu":
            raise RuntimeError(f"attention_backend 'cpu' is unavailable ({e}); use auto or torch") from e
        log.warning("attention: cpu kernel unavailable (%s); using the torch reference", e)
        return TorchAttention()
    log.info("attention: using the cpu kernel")
    return backend
