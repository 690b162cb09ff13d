"""The tensors a Llama-family checkpoint holds, by Hugging Face name, and their shapes.
Torch-free, so a checkpoint can be checked (router/checks.py) without importing torch."""

from __future__ import annotations

from engine.config import MOE_NAMING, ModelConfig

# Families that store some of a layer's weights as one tensor: its name (after
# "model.layers.{i}.") and the weights it stacks, row after row (Phi-3)
FUSED = {"phi3": {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                  "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}}


def fused_parts(cfg: ModelConfig, name: str) -> list[tuple[str, int, int]] | None:
    """For a fused checkpoint tensor's `name` ("....weight"), the weights it stacks as
    (name, first row, rows); None for any other tensor."""
    fused = FUSED.get(cfg.architecture)
    if not fused or not name.startswith("model.layers."):
        return None
    head, _, tail = name.partition(".layers.")
    index, _, rest = tail.partition(".")
    stem, _, kind = rest.rpartition(".")
    if stem not in fused:
        return None
    shapes = expected_shapes(cfg, as_stored=False)
    out, row = [], 0
    for part in fused[stem]:
        full = f"{head}.layers.{index}.{part}.{kind}"
        rows = shapes[full][0]
        out.append((full, row, rows))
        row += rows
    return out


def expected_shapes(cfg: ModelConfig, as_stored: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must (or, for lm_head when tied, may) hold, by HF name;
    with `as_stored` False, a fused tensor's parts instead of it (the names the model
    loads)."""
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
        if cfg.gemma:
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)}
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
    if as_stored and cfg.architecture in FUSED:
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            for stem, parts in FUSED[cfg.architecture].items():
                for kind in ("weight", "bias"):
                    names = [f"{p}{part}.{kind}" for part in parts]
                    if names[0] in shapes:
                        tail = shapes[names[0]][1:]
                        shapes[f"{p}{stem}.{kind}"] = (sum(shapes.pop(n)[0] for n in names), *tail)
    return shapes


def moe_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """A sparse layer's router and experts (`prefix`: "model.layers.{i}.")."""
    block, (gate, up, down) = MOE_NAMING[cfg.architecture]
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    p = f"{prefix}{block}."
    shapes = {p + "gate.weight": (cfg.num_experts, h)}
    for e in cfg.expert_range:
        shapes |= {f"{p}experts.{e}.{gate}.weight": (i, h), f"{p}experts.{e}.{up}.weight": (i, h),
                   f"{p}experts.{e}.{down}.weight": (h, i)}
    if (s := cfg.shared_expert_intermediate_size):
        shapes |= {p + "shared_expert.gate_proj.weight": (s, h), p + "shared_expert.up_proj.weight": (s, h),
                   p + "shared_expert.down_proj.weight": (h, s), p + "shared_expert_gate.weight": (1, h)}
    return shapes
