"""The tensors a Llama-family checkpoint holds, by Hugging Face name, and their shapes.
Torch-free, so a checkpoint can be checked (router/checks.py) without importing torch."""

from __future__ import annotations

from engine.config import MOE_NAMING, ModelConfig


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must (or, for lm_head when tied, may) hold, by HF name."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
        }
        if i in cfg.moe_layers:
            shapes |= moe_shapes(cfg, p)
        else:
            shapes |= {
                p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
                p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
            }
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (cfg.head_dim,), p + "self_attn.k_norm.weight": (cfg.head_dim,)}
        if cfg.qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.mlp_bias and i not in cfg.moe_layers:
            for n, dim in (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size), ("down_proj", h)):
                shapes[p + f"mlp.{n}.bias"] = (dim,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def moe_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """A sparse layer's router and experts (`prefix`: "model.layers.{i}.")."""
    block, (gate, up, down) = MOE_NAMING[cfg.architecture]
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    p = f"{prefix}{block}."
    shapes = {p + "gate.weight": (cfg.num_experts, h)}
    for e in range(cfg.num_experts):
        shapes |= {f"{p}experts.{e}.{gate}.weight": (i, h), f"{p}experts.{e}.{up}.weight": (i, h),
                   f"{p}experts.{e}.{down}.weight": (h, i)}
    return shapes
