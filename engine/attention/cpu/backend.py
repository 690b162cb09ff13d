"""CPU attention backend: paged decode and the KV store run the C++ kernels (kernels.py,
engine/cpu_kernels). Prefill runs the C++ paged prefill kernel for bf16 models where the
CPU has AVX512-BF16 (head_dim 64 or 128; its cache bf16 or fp8 e4m3, widened as the kernel
copies a context), and the torch reference (SDPA) otherwise: fp32 models keep torch's own
attention, the same as transformers'.

Where the CPU also has AMX, the kernel's products run on AMX tiles (16 query rows of a
head at a time; `TANDEM_CPU_AMX_ATTENTION=0` keeps them on AVX512-BF16). Before it did,
torch's flash kernel (AMX tiles) was 1.8-3x faster than the kernel's AVX512-BF16 dot
products on long chunks, and chunks of SDPA_MIN_ROWS tokens or more went to SDPA; on
tiles the kernel is the faster of the two (docs/performance.md, nineteenth round), so
that split is now only taken with `TANDEM_CPU_AMX_PREFILL_SDPA=1`: a fresh chunk (no
cached context before it) on its own keys and values, a chunk over a cached context on
its context gathered from the cache with a causal mask (as the reference does), shorter
chunks on the kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import envs
from engine.attention import FP8, AttentionBackend, reference
from engine.attention.cpu import kernels
from engine.cpu_kernels import build

# chunks shorter than this stay on the kernel (on the AMX machine it beat SDPA at 16 fresh
# tokens and at 48 over a context of 300; SDPA was 10% faster at 64 fresh, 2x over a context)
SDPA_MIN_ROWS = 64


def beyond(window: int | None, longest: int | None) -> bool:
    """Whether a sliding window hides any position of a context of `longest` tokens
    (None: unknown, so it may)."""
    return window is not None and (longest is None or longest > window)


class CpuAttention(AttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        self.ops = build.load()  # compile (or load the cached build) now, not on the first step
        self._bf16_prefill = envs.cpu_prefill_kernel() and bool(self.ops.paged_prefill_attention_supported())
        self.prefill_tensors = self._bf16_prefill  # the runner then builds the int32 lengths
        self.long_chunks_sdpa = self._bf16_prefill and envs.cpu_amx_prefill_sdpa() == "on"
        self.bf16_pairs = envs.cpu_decode_pairs()  # bf16 decode: p.v on the dot-product instruction
        # bf16 decode and prefill on AMX tiles where the CPU has them (process-wide
        # switches of the kernels)
        self.ops.set_decode_amx(envs.cpu_amx_attention())
        self.ops.set_prefill_amx(envs.cpu_amx_attention())

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        fits = (key.dtype == k_cache.dtype and value.dtype == k_cache.dtype and k_cache.is_contiguous()
                and v_cache.is_contiguous() and key.stride(-1) == 1 and value.stride(-1) == 1
                and key.stride(-2) == key.shape[-1] and value.stride(-2) == value.shape[-1]
                and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous())
        if not fits:
            reference.store_kv(key, value, k_cache, v_cache, slot_mapping)
            return
        self.ops.store_kv(k_cache, v_cache, key, value, slot_mapping)

    def _fp8_store_fits(self, key, value, k_cache, v_cache, slot_mapping, op: str) -> bool:
        """The compiled fp8 store takes these: [T, Hkv, D] rows with contiguous heads, one
        dtype, contiguous caches and int64 slots."""
        return (k_cache.dtype == FP8 and hasattr(self.ops, op) and key.dtype == value.dtype
                and k_cache.is_contiguous() and v_cache.is_contiguous() and key.stride(-1) == 1
                and value.stride(-1) == 1 and key.stride(-2) == key.shape[-1] and value.stride(-2) == value.shape[-1]
                and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous())

    def store_for_decode(self, key, value, k_cache, v_cache, slot_mapping, kv_scales=(1.0, 1.0)) -> None:
        if self._fp8_store_fits(key, value, k_cache, v_cache, slot_mapping, "store_kv_fp8"):
            # quantized as they are stored, one pass (the bits of quantize_kv's torch operators)
            self.ops.store_kv_fp8(k_cache, v_cache, key, value, slot_mapping, *kv_scales)
            return
        super().store_for_decode(key, value, k_cache, v_cache, slot_mapping, kv_scales)

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping, kv_scales=(1.0, 1.0)):
        if self._fp8_store_fits(key, value, k_cache, v_cache, slot_mapping, "store_kv_fp8_rounded"):
            # a prefill's rows quantized as stored and given back as stored, in one pass
            # (quantize_kv, store_kv and dequantize_kv's bits, without their six passes)
            k_out = torch.empty(key.shape, dtype=key.dtype)
            v_out = torch.empty(value.shape, dtype=value.dtype)
            self.ops.store_kv_fp8_rounded(k_cache, v_cache, key, value, slot_mapping, *kv_scales, k_out, v_out)
            return k_out, v_out
        return super().write_kv(key, value, k_cache, v_cache, slot_mapping, kv_scales)

    def decode(self, query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len,
               kv_scales=(1.0, 1.0), window=None, softcap=None) -> torch.Tensor:
        # the kernel walks D in 16-lane steps; with a window it reads the blocks the window
        # touches alone (a window that hides nothing is not passed: the tile path has none)
        if query.shape[-1] % 16 or query.stride(-1) != 1:
            return reference.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len,
                                                    kv_scales, window, softcap)
        window = window if beyond(window, max_seq_len) else None
        if k_cache.dtype == FP8:  # the K scale folded into the softmax's, the V scale into the output's
            return kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens,
                                                  scale * kv_scales[0], v_scale=kv_scales[1], window=window,
                                                  softcap=softcap)
        return kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale,
                                              bf16_pairs=self.bf16_pairs, window=window, softcap=softcap)

    def prefill(self, query, key, value, k_cache, v_cache, meta, scale: float, kv_scales=(1.0, 1.0),
                window=None, softcap=None) -> torch.Tensor:
        window = window if beyond(window, max(meta.prefill_seq_lens, default=0)) else None
        if (self._bf16_prefill and query.dtype == torch.bfloat16 and k_cache.dtype in (torch.bfloat16, FP8)
                and query.shape[-1] in (64, 128) and query.stride(-1) == 1 and k_cache.is_contiguous()
                and v_cache.is_contiguous() and meta.prefill_query_start_loc is not None):
            if (self.long_chunks_sdpa and window is None and not softcap
                    and max(meta.prefill_query_lens) >= SDPA_MIN_ROWS):
                return self._prefill_split(query, key, value, k_cache, v_cache, meta, scale, kv_scales)
            # an fp8 cache: widened to bf16 as the kernel copies it, the K scale in the softmax's
            return kernels.paged_prefill_attention(query, k_cache, v_cache, meta.prefill_block_tables,
                                                   meta.prefill_query_start_loc, meta.prefill_seq_lens_tensor,
                                                   scale * kv_scales[0], v_scale=kv_scales[1], window=window,
                                                   softcap=softcap)
        return super().prefill(query, key, value, k_cache, v_cache, meta, scale, kv_scales, window, softcap)

    def _prefill_split(self, query, key, value, k_cache, v_cache, meta, scale: float,
                       kv_scales=(1.0, 1.0)) -> torch.Tensor:
        """Chunks of SDPA_MIN_ROWS tokens or more through SDPA (a run of fresh neighbours
        of one length in one batched call), shorter ones through the paged kernel, one
        call each."""
        out = torch.empty_like(query)
        heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[2]
        lens = list(zip(meta.prefill_query_lens, meta.prefill_seq_lens))
        starts = meta.prefill_query_start_loc.tolist()
        i = 0
        while i < len(lens):
            q_len, s_len = lens[i]
            lo, hi = starts[i], starts[i + 1]
            if q_len < SDPA_MIN_ROWS:
                out[lo:hi] = kernels.paged_prefill_attention(
                    query[lo:hi], k_cache, v_cache, meta.prefill_block_tables[i:i + 1],
                    torch.tensor([0, q_len], dtype=torch.int32), meta.prefill_seq_lens_tensor[i:i + 1],
                    scale * kv_scales[0], v_scale=kv_scales[1])
                i += 1
                continue
            if q_len != s_len:  # over a cached context: gathered, with a causal mask
                out[lo:hi] = reference.varlen_attention(
                    query[lo:hi], key[lo:hi], value[lo:hi], k_cache, v_cache,
                    meta.prefill_block_tables[i:i + 1], [q_len], [s_len], scale, kv_scales)
                i += 1
                continue
            j = i + 1
            while j < len(lens) and lens[j] == (q_len, q_len):
                j += 1
            n, hi = j - i, starts[j]
            q = query[lo:hi].view(n, q_len, heads, dim).transpose(1, 2)
            k = key[lo:hi].view(n, q_len, kv_heads, dim).transpose(1, 2)
            v = value[lo:hi].view(n, q_len, kv_heads, dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            out[lo:hi] = o.transpose(1, 2).reshape(hi - lo, heads, dim)
            i = j
        return out
