"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a paged KV cache.

Numerics follow Hugging Face transformers' implementation so greedy outputs match
it token for token: RMSNorm in fp32, RoPE tables in fp32 cast to the activation
dtype, logits in the model dtype then fp32.

Input is a flat batch of T tokens (decodes first, then prefill chunks) with their
positions; attention reads and writes the paged cache through an AttentionBackend.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig, RopeScaling
from engine.models.moe import SparseMoe
from engine.models.packed import SMALL_BATCH_ROWS, TILE_ROWS
from engine.models.shapes import expected_shapes  # noqa: F401 - re-exported
from engine.quantization.linear import STORAGE, QuantLinear, QuantSwiGLU


class WeightError(ValueError):
    """A checkpoint tensor is missing, unexpected or of the wrong shape."""


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling, long: bool = False) -> torch.Tensor:
    """The rotation's frequencies (`long`: LongRoPE's long factors, else its short ones)."""
    if scaling.kind == "longrope":  # transformers' arithmetic, so that the bits agree
        ext = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32)
        return 1.0 / (ext * theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if scaling.kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    return inv_freq


def _yarn_inv_freq(dim: int, base: float, s: RopeScaling) -> torch.Tensor:
    """YaRN's frequencies (the paper's, as transformers computes them): interpolated by
    `factor` below the correction range, kept above it, a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return interpolation * (1 - keep) + extrapolation * keep


class RMSNorm(nn.Module):
    """RMSNorm; with `ops` (the compiled CPU kernels, engine/cpu_kernels/fused.cpp) one
    operator instead of eight, rounding at the same points."""

    def __init__(self, dim: int, eps: float, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.gemma = gemma  # Gemma's: x * (1 + w) in fp32, then the dtype (the kernels do Llama's)

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        if self.gemma:
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        if ops is not None:
            out = torch.empty_like(x)
            ops.rms_norm(out, x, self.weight, self.eps)
            return out
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor, ops=None) -> torch.Tensor:
        """`residual += delta` in place (the decoder's skip connection), then its norm."""
        if ops is not None and not self.gemma:
            out = torch.empty_like(residual)
            ops.add_rms_norm(out, residual, delta, self.weight, self.eps)
            return out
        return self.forward(residual.add_(delta), ops)


class Rotary(nn.Module):
    """Precomputed cos/sin tables indexed by position (non-interleaved, rotate-half). With
    LongRoPE, the long factors' table follows the short one: the runner passes each token's
    row (ModelConfig.rope_row) as its position."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        kinds = (False, True) if cfg.rope_scaling.kind == "longrope" else (False,)
        freqs = torch.cat([pos[:, None] * rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, long)[None, :]
                           for long in kinds])
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D] ([2P, D] with LongRoPE)
        scaling = cfg.rope_scaling.attention_scaling  # YaRN's (1 otherwise: the same bits)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype, ops=None) -> Callable[[torch.Tensor], torch.Tensor]:
        """The function that rotates x [T, heads, D] at `positions` [T], made once per
        step and shared by every layer. With `ops`, one compiled operator rotating x in
        place; else torch over cos, sin rows gathered once ([T, 1, D] in `dtype`)."""
        if ops is not None:
            cos, sin = self.cos, self.sin

            def rotate_(x: torch.Tensor) -> torch.Tensor:
                ops.rotary_(x, positions, cos, sin)
                return x

            return rotate_
        cos_t, sin_t = self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]
        return lambda x: rotate(x, cos_t, sin_t)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos, sin [T, 1, D]."""
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        self.window = window  # a sliding window's tokens (None: the whole context)
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.nh * self.hd, self.nkv * self.hd
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.attn_scale or self.hd**-0.5
        self.softcap = cfg.attn_softcap  # Gemma 2: scores as cap * tanh(s / cap)
        self.kv_scales = (1.0, 1.0)  # an fp8 KV cache's K and V scales (engine/models/loader.py)
        self.tp = None  # under tensor parallelism, the group's Communicator: o_proj's output is a partial sum

    def forward(
        self,
        x,
        rope: Callable[[torch.Tensor], torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta,
        backend: AttentionBackend,
    ):
        q, k, v = self._project(x, rope)
        o = backend.forward(q, k, v, kv[0], kv[1], meta, self.scale, self.kv_scales, self.window, self.softcap)
        out = self.o_proj(o.reshape(x.shape[0], self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)

    def forward_kept(self, x, rope, kv, meta, backend):
        """Every row's key and value into the cache, the output of `meta.kept`'s rows only
        ([K, hidden]), each row attending as the last token of its sequence; None when
        no row is kept."""
        q, k, v = self._project(x, rope)
        backend.write_kv(k, v, kv[0], kv[1], meta.slot_mapping, self.kv_scales)
        kept = meta.kept
        if kept.rows.numel() == 0:
            return None
        q = q.index_select(0, kept.rows)  # [K, H, D], contiguous
        o = backend.decode(q, kv[0], kv[1], kept.block_tables, kept.seq_lens, self.scale, kept.max_seq_len,
                           self.kv_scales, self.window, self.softcap)
        out = self.o_proj(o.reshape(q.shape[0], self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)

    def _project(self, x, rope):
        t = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads sit side by side: one rotation for both (the same elementwise
        # math per head as rotating each, half the operator calls)
        qk = rope(self._norm_heads(qk.view(t, self.nh + self.nkv, self.hd)))
        q, k = qk.split([self.nh, self.nkv], dim=1)
        return q, k, v.view(t, self.nkv, self.hd)

    def _norm_heads(self, qk: torch.Tensor) -> torch.Tensor:
        return qk


class QKNormAttention(Attention):
    """Qwen3's attention: an RMSNorm over each query head and each key head (weights of
    head_dim, one for the queries and one for the keys) before the rotation."""

    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        super().__init__(cfg, window)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps, cfg.gemma)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps, cfg.gemma)

    def _norm_heads(self, qk: torch.Tensor) -> torch.Tensor:
        t = qk.shape[0]
        q, k = qk.split([self.nh, self.nkv], dim=1)
        q = self.q_norm(q.reshape(t * self.nh, self.hd))
        k = self.k_norm(k.reshape(t * self.nkv, self.hd))
        return torch.cat((q.view(t, self.nh, self.hd), k.view(t, self.nkv, self.hd)), dim=1)


class MLP(nn.Module):
    # gate and up stay two matmuls: on CPU one fused [2I, H] matmul measured 8-10% slower
    # than two [I, H] ones at hidden 768 (and no faster at 256). q/k/v are fused. An int8
    # model's gate and up in the tile unit's order are the exception (gate_up, below): one
    # call with SwiGLU in its epilogue, which writes neither layer's output.
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.tp = None  # as Attention's: down_proj's output is a partial sum under tensor parallelism
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"  # Gemma's GeGLU
        # int8 gate and up in the tile unit's order: both and SwiGLU in one call, in place of
        # gate_proj and up_proj (engine/quantization/linear.py's fuse_swiglu)
        self.gate_up = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            out = self.down_proj(self.gate_up(x))
            return out if self.tp is None else self.tp.all_reduce(out)
        g = self.gate_proj(x)
        g = F.gelu(g, approximate="tanh") if self.gelu else F.silu(g, inplace=True)
        out = self.down_proj(g.mul_(self.up_proj(x)))
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    """One decoder layer; the config picks its parts: Qwen3's per-head q/k norms, a
    mixture of experts in place of the MLP on Mixtral's and Qwen3-MoE's sparse layers."""

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)
        self.self_attn = (QKNormAttention if cfg.qk_norm else Attention)(cfg, cfg.window_of(index))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)
        self.mlp = SparseMoe(cfg) if index in cfg.moe_layers else MLP(cfg)
        # Gemma: post_attention_layernorm normalises the attention's output, and two more
        # norms wrap the MLP ("sandwich" norms)
        self.sandwich = cfg.gemma
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, True)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, True)

    def forward(self, residual, delta, rope, kv, meta, backend, ops=None, last=False):
        """The skip connection is carried as (residual, delta), their sum being the
        layer's input x, so that each norm can add and normalise in one fused operator
        (`ops`); returns the next layer's pair. Same rounding as `x = x + attn(norm(x));
        x = x + mlp(norm(x))`. `residual` is updated in place. The `last` layer of a
        step with `meta.kept` returns the kept rows only (none: `residual[:0], None`)."""
        if delta is None:
            h = self.input_layernorm(residual, ops)
        else:
            h = self.input_layernorm.add_forward(residual, delta, ops)
        attended = self._attention(residual, h, rope, kv, meta, backend, last)
        if attended is None:
            return residual[:0], None
        o, residual = attended
        if self.sandwich:
            return self._sandwich(residual, o)
        h = self.post_attention_layernorm.add_forward(residual, o, ops)
        return residual, self.mlp(h)

    def _attention(self, residual, h, rope, kv, meta, backend, last):
        """(the attention's output, the residual rows it goes with): the kept rows only for
        the last layer of a step with `meta.kept`; None when no row is kept."""
        if last and meta.kept is not None:
            o = self.self_attn.forward_kept(h, rope, kv, meta, backend)
            return None if o is None else (o, residual.index_select(0, meta.kept.rows))
        return self.self_attn(h, rope, kv, meta, backend), residual

    def _sandwich(self, residual, o):
        """Gemma's layer after its attention: x += norm(attn); the MLP's output,
        normalised, is the delta the next layer adds."""
        residual.add_(self.post_attention_layernorm(o))
        return residual, self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(residual)))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: bool = True) -> None:
        """`rotary` False: no cos/sin tables yet (the loader builds the model on the meta
        device and sets `rotary` on the real one; computing the tables, or nn.Embedding's
        normal_ init, on meta imports torch's reference ops: 1.2-1.6 s of every start)."""
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)
        self.rotary = Rotary(cfg) if rotary else None
        self.rotary_local = None  # Gemma 3's windowed layers' own rope (set with `rotary`)
        self._local_layers: frozenset[int] = frozenset()  # the layers that rotate with it
        if rotary:
            self.set_rotary(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # the compiled CPU kernels (engine/cpu_kernels), set by ModelRunner on CPU; None: torch operators
        self.cpu_ops = None
        self.tp = None  # the tensor-parallel group's Communicator (set_tensor_parallel)
        self.vocab_comm = None  # set when the LM head is vocab-parallel: its logits are gathered on rank 0

    def set_rotary(self, cfg: ModelConfig) -> None:
        """The cos/sin tables: every layer's, and where the windowed layers rotate with a
        theta of their own (Gemma 3), theirs (default rope, no scaling)."""
        self.rotary = Rotary(cfg)
        if cfg.local_rope_theta is not None:
            self.rotary_local = Rotary(dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta,
                                                           rope_scaling=RopeScaling()))
            self._local_layers = frozenset(cfg.sliding_layers)

    def set_tensor_parallel(self, comm, vocab_parallel: bool = True) -> None:
        """Sum the row-parallel layers' partial outputs over `comm`'s ranks (this model
        holds one rank's shard: engine/parallel/shard.py). With `vocab_parallel` (and a
        vocabulary the ranks divide), this rank keeps its 1/size of the LM head's rows
        (a tied head: a view of the embedding's rows) and `compute_logits` gathers the
        ranks' columns on rank 0, which alone samples; the others get None."""
        self.tp = comm
        for layer in self.layers:
            layer.self_attn.tp = layer.mlp.tp = comm
        vocab, size = self.cfg.vocab_size, comm.size
        if not vocab_parallel or size == 1 or vocab % size:
            return
        n = vocab // size
        rows = slice(comm.rank * n, (comm.rank + 1) * n)
        if isinstance(self.lm_head, QuantLinear):  # its scales' rows too
            self.lm_head = self.lm_head.rows(rows)
        else:
            with torch.no_grad():
                w = self.embed_tokens.weight[rows] if self.lm_head is None else self.lm_head.weight[rows].clone()
            head = nn.Linear(self.cfg.hidden_size, n, bias=False, device="meta", dtype=w.dtype)
            head.weight = nn.Parameter(w, requires_grad=False)
            self.lm_head = head
        self.vocab_comm = comm

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        meta: AttentionMetadata,
        backend: AttentionBackend,
        on_layer_done=None,  # called with the layer index once its KV is in the cache
    ) -> torch.Tensor:  # [T, hidden]; with `meta.kept`, [K, hidden] of its rows
        residual = self.embed_tokens(input_ids)  # a new tensor: the layers add into it in place
        if self.cfg.gemma:  # times sqrt(hidden), rounded to the dtype first (as transformers)
            residual = residual * torch.tensor(self.cfg.hidden_size**0.5, dtype=residual.dtype)
        ops = self.cpu_ops if residual.is_cpu else None
        if (ops is not None and on_layer_done is None and meta.num_decode_tokens == residual.shape[0]
                and backend.name == "cpu" and meta.groups is None):
            stack = self._decode_stack(ops, kv_caches, residual.dtype)
            if stack is not None:
                # the layers in one C++ call, the same kernels and rounding (cpu_kernels/decode_layers.cpp)
                cfg = self.cfg
                tables = meta.decode_block_tables.to(torch.int32).contiguous()  # no copy when they already are
                lens = meta.decode_seq_lens.to(torch.int32).contiguous()
                args = (residual, *stack, [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches],
                        positions, self.rotary.cos, self.rotary.sin, meta.slot_mapping.contiguous(),
                        tables, lens, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        self.layers[0].self_attn.scale, self.layers[0].input_layernorm.eps,
                        backend.bf16_pairs, self._small_rows, TILE_ROWS, self._kv_scales,
                        self._windows if self._windowed(meta.decode_max_seq_len) else [],
                        self._quant, self._quant_tiles)
                self._before_layers()
                delta = ops.decode_layers(*args)
                return self.norm.add_forward(residual, delta, ops)
        self._before_layers()
        rope = self.rotary.rotation(positions, residual.dtype, ops)
        local = rope if self.rotary_local is None else self.rotary_local.rotation(positions, residual.dtype, ops)
        local_layers = self._local_layers  # empty but for Gemma 3
        # KV groups (engine/kv_groups.py): each layer reads its group's slots and tables
        metas = [meta.groups[g] for g in self._layer_group] if meta.groups is not None else None
        delta = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            residual, delta = layer(residual, delta, local if i in local_layers else rope, kv_caches[i],
                                    meta if metas is None else metas[i], backend, ops, i == last)
            if on_layer_done is not None:
                on_layer_done(i)
        if residual.shape[0] == 0:  # no row kept
            return residual
        return self.norm(residual, ops) if delta is None else self.norm.add_forward(residual, delta, ops)

    before_layers = None  # ModelRunner.before_layers: each path of forward calls it once

    def _before_layers(self) -> None:
        if self.before_layers is not None:
            self.before_layers()

    @functools.cached_property
    def _layer_group(self) -> list[int]:
        """Each layer's KV group (engine/kv_groups.py)."""
        return [self.cfg.kv_groups.place(i)[0] for i in range(len(self.layers))]

    @functools.cached_property
    def _windows(self) -> list[int]:
        """Each layer's sliding window for the one-call stack (0: the layer sees everything)."""
        return [self.cfg.window_of(i) or 0 for i in range(len(self.layers))]

    def _windowed(self, longest: int | None) -> bool:
        """Whether a sliding window hides part of a context of `longest` tokens (None: unknown)."""
        w = self.cfg.sliding_window
        return bool(self.cfg.sliding_layers) and w is not None and (longest is None or longest > w)

    def _decode_stack(self, ops, kv_caches, dtype: torch.dtype):
        """The weights `ops.decode_layers` takes: (norms, 2 a layer; packed linear
        weights, 5 a layer; their row-major copies and their tile-order copies, each 5 a
        layer or none), or None where
        that operator cannot run this model: no such operator in the build, a linear
        layer not packed for oneDNN or with a bias, a head_dim the attention kernel does
        not walk, a cache dtype other than the model's or fp8 e4m3. A quantized model's
        linear layers go in `self._quant` instead (`_quant_stack`), the weight lists
        empty. Decided once."""
        if getattr(self, "_stack_checked", False):
            return self._stack
        self._stack_checked, self._stack, self._quant, self._quant_tiles = True, None, [], False
        # the one-call stack has no place for the all-reduces tensor parallelism adds, nor
        # for q/k norms or experts
        if self.cfg.qk_norm or self.cfg.moe_layers or self.cfg.gemma:
            return None
        if self.tp is not None or not hasattr(ops, "decode_layers") or self.cfg.head_dim % 16 or any(
                k.dtype not in (dtype, torch.float8_e4m3fn) or not k.is_contiguous() or not v.is_contiguous()
                for k, v in kv_caches):
            return None
        # an fp8 cache: every layer's K and V scale, in order (decode_layers stores and reads with them)
        self._kv_scales = ([s for layer in self.layers for s in layer.self_attn.kv_scales]
                           if kv_caches[0][0].dtype == torch.float8_e4m3fn else [])
        norms = [w for layer in self.layers
                 for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)]
        # (a fused gate and up, QuantSwiGLU, in the gate's place and None in the up's)
        linears = [x for layer in self.layers
                   for x in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                             layer.mlp.gate_proj if layer.mlp.gate_up is None else layer.mlp.gate_up,
                             layer.mlp.up_proj, layer.mlp.down_proj)]
        if (any(w.dtype != dtype or not w.is_contiguous() for w in norms)
                or any(getattr(x, "bias", None) is not None for x in linears)):
            return None
        self._small_rows = SMALL_BATCH_ROWS  # the quantized kernels take every batch size
        if any(isinstance(x, QuantLinear) for x in linears):
            self._stack = (norms, [], [], []) if self._quant_stack(linears, dtype) else None
            return self._stack
        if any(getattr(x, "packed", None) is None for x in linears):
            return None
        copies = []
        for ws in ([x.plain for x in linears], [x.tiles for x in linears]):
            # each kind of copy: every layer's or none (a layer keeps at most one kind)
            if any(w is None for w in ws) and any(w is not None for w in ws):
                return None
            copies.append([] if ws[0] is None else ws)
        plain, tiles = copies
        if any(w.dtype != dtype or not w.is_contiguous() for w in plain + tiles):
            return None
        self._stack = (norms, [x.packed for x in linears], plain, tiles)
        # PlainLinear's own bound (every size for bf16 without native bf16), else the row-major kernel's
        self._small_rows = min(getattr(x, "max_rows", SMALL_BATCH_ROWS) for layer in self.layers
                               for x in (layer.self_attn.qkv_proj, layer.self_attn.o_proj))
        return self._stack

    def _quant_stack(self, linears: list, dtype: torch.dtype) -> bool:
        """Whether the one-call stack can run a quantized model's linear layers (every one
        quantized, one scale a row, on the compiled kernel, all in tile order or none, bf16
        or fp32 activations); if so `self._quant` holds each one's (q, scale, weight sums)
        in turn, 15 a layer, and `self._quant_tiles` the order. Each runs on the kernel its
        QuantLinear runs on (engine/quantization/linear.py), so the bits are the same. A
        fused gate and up (QuantSwiGLU) goes in the gate's place and three empty tensors in
        the up's: decode_layers then calls quant_linear_tiles_swiglu, as the MLP does."""
        tiles = bool(getattr(linears[0], "tiles", False))
        if dtype not in (torch.bfloat16, torch.float32) or any(
                x is not None and (not isinstance(x, (QuantLinear, QuantSwiGLU)) or x._ops is None
                                   or x.weight_scale.shape[1] != 1 or x.tiles != tiles)
                for x in linears):
            return False
        empty = torch.empty(0, dtype=torch.int32)  # no weight sums: the layer keeps x in its dtype
        w8a8 = dtype == torch.bfloat16
        self._quant = [t for x in linears
                       for t in ((empty, empty, empty) if x is None
                                 else (x.weight, x.weight_scale, x._sums if w8a8 and x._sums is not None else empty))]
        self._quant_tiles = tiles
        return True

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor | None:
        """[S, hidden] -> [S, V], float32 unless `fp32` is False (then the model's dtype).
        A vocab-parallel head (`set_tensor_parallel`): every rank must call it, at the same
        point of the same step; rank 0 gets the logits, the others None."""
        logits = F.linear(hidden, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(hidden)
        if self.vocab_comm is not None:
            logits = self.vocab_comm.gather_cols(logits)
            if logits is None:
                return None
        if self.cfg.final_softcap:  # Gemma 2, in the model's dtype as transformers does
            cap = self.cfg.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if fp32 else logits

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v. Checks names, shapes and, for the
        quantized layers (`self.quantized`, set by the loader), dtypes and scales."""
        expected = expected_shapes(self.cfg, as_stored=False)  # a fused tensor arrives as its parts
        for prefix in getattr(self, "quantized", ()):
            expected[f"{prefix}.weight_scale"] = tuple(self._param_slice(f"{prefix}.weight_scale").shape)
        seen: set[str] = set()
        for name, t in tensors:
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                continue
            if name not in expected:
                raise WeightError(f"unexpected tensor {name!r} in checkpoint")
            if tuple(t.shape) != expected[name]:
                raise WeightError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {expected[name]}")
            target = self._param_slice(name)
            if (t.dtype in STORAGE.values()) != (target.dtype in STORAGE.values()):
                raise WeightError(f"tensor {name!r} is {t.dtype}, where the model holds {target.dtype}")
            target.copy_(t)
            seen.add(name)
        missing = sorted(set(expected) - seen)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise WeightError(f"checkpoint is missing tensors: {', '.join(missing[:5])}{more}")

    def _param_slice(self, name: str) -> torch.Tensor:
        if name == "model.embed_tokens.weight":
            return self.embed_tokens.weight
        if name == "model.norm.weight":
            return self.norm.weight
        if name.startswith("lm_head."):
            return getattr(self.lm_head, name.removeprefix("lm_head."))
        parts = name.split(".")  # model.layers.{i}.{group}[.{proj}].{kind}
        layer, group, kind = self.layers[int(parts[2])], parts[3], parts[-1]
        if group in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            return getattr(layer, group).weight
        if isinstance(layer.mlp, SparseMoe) and group != "self_attn":
            return layer.mlp.param(parts[4:-1])
        proj = parts[4]
        if group == "self_attn":
            attn = layer.self_attn
            if proj in ("q_norm", "k_norm"):
                return getattr(attn, proj).weight
            if proj == "o_proj":
                return getattr(attn.o_proj, kind)
            off = {
                "q_proj": (0, attn.q_size),
                "k_proj": (attn.q_size, attn.kv_size),
                "v_proj": (attn.q_size + attn.kv_size, attn.kv_size),
            }[proj]
            return getattr(attn.qkv_proj, kind).narrow(0, *off)
        return getattr(getattr(layer.mlp, proj), kind)
