"""The side by side's models, made here: `tiny-llama` and `small-llama`, Llama-architecture
checkpoints with seeded random weights, and GGUF files of the same weights for llama.cpp.

No hub is reachable, so the models are made, not downloaded. Shapes (the same as the
peers' measurements used; facts from the team's notes):

    tiny-llama   hidden 256, 4 layers, 4 heads / 2 KV heads, MLP 768, vocab 16000, fp32
    small-llama  hidden 1024, 12 layers, 16 heads / 4 KV heads, MLP 2816, vocab 32000, bf16

Both untied (an lm_head of their own). The tokenizer is byte-level BPE trained on this
Python's standard library source (engine/models/writer.py); the weights come from the
writer's seeded generator. The special tokens' embedding and lm_head rows are scaled
down, so greedy decoding never picks EOS: every request yields max_tokens (benchmarks
pass ignore_eos anyway).

GGUF (`gguf_from_checkpoint`): llama.cpp's own converter identifies a BPE tokenizer by a
hash of its pre-tokenizer's output and refuses ones it does not know, so this writes the
file with the `gguf` package directly: tokenizer model `gpt2` with pre-tokenizer `gpt-2`
(ours is byte-level BPE with GPT-2's split), and q/k weights reordered from Hugging
Face's rotate-half rotary layout to GGML's interleaved pairs. Norms stay fp32.

    python -m bench.lab.peer_models DIR [--only tiny-llama] [--gguf f32,bf16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECS = {
    "tiny-llama": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=768, vocab_size=16000, dtype="float32", seed=1234),
    "small-llama": dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                        intermediate_size=2816, vocab_size=32000, dtype="bfloat16", seed=5678),
}
TOKENIZER_CHARS = {"tiny-llama": 4_000_000, "small-llama": 40_000_000}  # of stdlib source, at most


def hf_config(spec: dict) -> dict:
    from engine.models.builtin import BOS_ID, EOS_ID, EOT_ID

    h, heads = spec["hidden_size"], spec["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, EOT_ID], "head_dim": h // heads,
        "hidden_act": "silu", "hidden_size": h, "initializer_range": 0.02,
        "intermediate_size": spec["intermediate_size"], "max_position_embeddings": 4096, "mlp_bias": False,
        "num_attention_heads": heads, "num_hidden_layers": spec["num_hidden_layers"],
        "num_key_value_heads": spec["num_key_value_heads"], "pretraining_tp": 1, "rms_norm_eps": 1e-5,
        "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "torch_dtype": spec["dtype"], "use_cache": True, "vocab_size": spec["vocab_size"],
    }


def make_model(name: str, out: Path) -> Path:
    """Write checkpoint `name` into out/name (skipped when it is there already)."""
    from bench.lab.train_builtin import stdlib_files
    from engine.config import ModelConfig
    from engine.models.builtin import SPECIAL_TOKENS
    from engine.models.writer import random_weights, tokenizer_files, train_tokenizer, write_checkpoint

    path = out / name
    if (path / "model.safetensors").is_file():
        return path
    spec = SPECS[name]
    docs, size = [], 0
    for _, text, _ in stdlib_files():
        if size >= TOKENIZER_CHARS[name]:
            break
        docs.append(text)
        size += len(text)
    config = hf_config(spec)
    tok = train_tokenizer(docs, spec["vocab_size"])
    weights = random_weights(ModelConfig.from_hf(config), spec["seed"], quiet_rows=range(len(SPECIAL_TOKENS)))
    tmp = path.with_name(path.name + ".partial")
    write_checkpoint(tmp, config, weights, files=tokenizer_files(tok))
    tmp.rename(path)
    return path


# ---- GGUF -------------------------------------------------------------------------------

def _interleave_rotary(w, heads: int):
    """[heads * d, in]: each head's first and second halves (HF's rotate-half order)
    woven into pairs (GGML's order), which rotate the same way in llama.cpp."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_names(layers: int) -> dict[str, str]:
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(layers):
        names |= {f"model.layers.{i}.{hf}.weight": f"blk.{i}.{gg}.weight" for hf, gg in parts.items()}
    return names


def read_safetensors(file: Path) -> dict:
    """Every tensor of a .safetensors file as fp32 numpy, bf16 included (numpy has no
    bf16: its bits are the top half of an fp32's). Needs numpy alone, no torch."""
    import numpy as np

    raw = file.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    types = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        a = np.frombuffer(raw, dtype=types[info["dtype"]], count=(hi - lo) // np.dtype(types[info["dtype"]]).itemsize,
                          offset=8 + size + lo).reshape(info["shape"])
        out[name] = (a.astype(np.uint32) << 16).view(np.float32) if info["dtype"] == "BF16" else a.astype(np.float32)
    return out


def gguf_from_checkpoint(model: Path, out: Path, outtype: str = "bf16") -> Path:
    """Write `model` (a checkpoint made by `make_model`) as GGUF in `outtype` (f32, f16
    or bf16; llama.cpp's llama-quantize makes Q8_0 from the bf16 file)."""
    import gguf
    import numpy as np

    cfg = json.loads((model / "config.json").read_text())
    tok = json.loads((model / "tokenizer.json").read_text())
    gen = json.loads((model / "generation_config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16}[outtype]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(model.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(ftype)
    vocab = tok["model"]["vocab"]
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])])
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(vocab))])
    w.add_token_merges(tok["model"]["merges"])
    w.add_bos_token_id(gen["bos_token_id"])
    w.add_eos_token_id(gen["eos_token_id"][0] if isinstance(gen["eos_token_id"], list) else gen["eos_token_id"])
    w.add_add_bos_token(True)
    names = _gguf_names(cfg["num_hidden_layers"])
    tensors = read_safetensors(model / "model.safetensors")
    for hf_name in sorted(tensors):
        a = tensors[hf_name]
        if hf_name.endswith("q_proj.weight"):
            a = _interleave_rotary(a, heads)
        elif hf_name.endswith("k_proj.weight"):
            a = _interleave_rotary(a, kv_heads)
        if a.ndim == 1 or outtype == "f32":
            w.add_tensor(names[hf_name], np.ascontiguousarray(a, dtype=np.float32))
        elif outtype == "f16":
            w.add_tensor(names[hf_name], np.ascontiguousarray(a, dtype=np.float16))
        else:  # bf16: the top half of each fp32 (round to nearest even), as raw bytes
            bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            w.add_tensor(names[hf_name], rounded, raw_shape=a.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lab.peer_models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, help="models go to DIR/NAME, GGUF files to DIR/gguf/NAME-TYPE.gguf")
    p.add_argument("--only", choices=sorted(SPECS), action="append")
    p.add_argument("--gguf", default="f32,bf16", help="GGUF types to write (f32, f16, bf16; '' for none)")
    p.add_argument("--no-make", action="store_true", help="GGUF files only, of models made already (no torch)")
    a = p.parse_args(argv)
    for name in a.only or sorted(SPECS):
        path = a.dir / name if a.no_make else make_model(name, a.dir)
        print(f"{name}: {path}")
        for outtype in filter(None, a.gguf.split(",")):
            (a.dir / "gguf").mkdir(parents=True, exist_ok=True)
            target = a.dir / "gguf" / f"{name}-{outtype}.gguf"
            if not target.is_file():
                gguf_from_checkpoint(path, target, outtype)
            print(f"  {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
