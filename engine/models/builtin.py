"""The built-in models: `tandem-tiny-v2` (trained) and `tandem-tiny-v1` (random).

`tandem-tiny-v2`, the model `tandem serve` runs when no model is named, and its draft
`tandem-tiny-v2-draft` are trained on the Python standard library's source by
bench/lab/train_builtin.py and ship as package data (engine/models/data/), each with a
manifest.json naming the SHA-256 of every file (`verify_manifest`). Finding them
imports no torch: every router and command line does it.

`tandem-tiny-v1` is the untrained model of the same shape, made on first use by
engine/models/writer.py (which pins its bytes down).

A 5.3M-parameter LlamaForCausalLM (vocab 8192, hidden 256, 4 layers, 4 query heads,
2 KV heads, head_dim 64, MLP 768, tied embeddings, fp32).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

BUILTIN_VERSION = "tandem-tiny-v2"  # trained, package data
DRAFT_VERSION = "tandem-tiny-v2-draft"
RANDOM_VERSION = "tandem-tiny-v1"  # random weights, built on first use
DATA_DIR = Path(__file__).parent / "data"

SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
BOS_ID, EOS_ID, EOT_ID = 0, 1, 4

CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ('system', 'user', 'assistant') %}\n"
    "{{- raise_exception('role must be system, user or assistant, got ' + message['role']) }}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "{{- message['content'] | trim }}\n"
    "{{- '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

BUILTIN_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": BOS_ID,
    "eos_token_id": [EOS_ID, EOT_ID],
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 768,
    "max_position_embeddings": 4096,
    "mlp_bias": False,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "use_cache": True,
    "vocab_size": 8192,
}


def builtin_model_path() -> Path:
    """The built-in model's directory (package data)."""
    return _packaged(BUILTIN_VERSION)


def builtin_draft_path() -> Path:
    """The built-in draft model's directory (package data)."""
    return _packaged(DRAFT_VERSION)


def _packaged(name: str) -> Path:
    path = DATA_DIR / name
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"the built-in model {name} is missing from {DATA_DIR} (an incomplete install?); "
                                f"python -m bench.lab.train_builtin makes it, or pass --model DIR")
    return path


def verify_manifest(path: str | Path) -> str:
    """Check every file a packaged checkpoint's manifest.json names against its SHA-256;
    returns the manifest's own SHA-256. ValueError on a mismatch."""
    path = Path(path)
    raw = (path / "manifest.json").read_bytes()
    for name, digest in json.loads(raw)["files"].items():
        if hashlib.sha256((path / name).read_bytes()).hexdigest() != digest:
            raise ValueError(f"{path / name} does not match its manifest")
    return hashlib.sha256(raw).hexdigest()
