"""Writing checkpoints: byte-level BPE tokenizers, seeded weights, safetensors written
by hand; and the random-weight built-in model `tandem-tiny-v1`, made on first use.

`tandem-tiny-v1` is byte for byte the same on every machine and Python version: a model
whose greedy output is noise, for tests that want one (`random_model_path`). It shares
nothing with tandem-tiny-v2 but the shape: its tokenizer was trained on a synthetic
corpus.
How tandem-tiny-v1's bytes are pinned down:
- Tokenizer: byte-level BPE trained with `tokenizers` (vocab 8192, min frequency 2) on
  ~900 KB of text from builtin_corpus.py. Ids 0-4 are the Llama-3-style special tokens;
  bos is added by the post-processor. tokenizer.json is written from the learned vocab
  and merges by this module, not by the library's serialiser.
- Weights: uniform values from splitmix64 (numpy uint64 arithmetic), one stream per
  tensor seeded from SHA-256 of (SEED, name); the top 24 bits of each output map to
  (k + 0.5) / 2**24 * 2 - 1, then one float64 multiply and a cast to float32, all exact
  IEEE operations. Matrices: std = GAIN / sqrt(fan_in) (embeddings: EMBED_STD); norm
  weights 1 +- 0.1, so swapped norms change the logits. No torch or numpy generator.
- Special tokens never win a greedy argmax: their embedding rows (tied, so also their
  lm_head rows) are scaled by SPECIAL_ROW_SCALE, so greedy generation never emits eos
  and benchmarks get exactly max_tokens tokens. Sampling can still pick them.
- safetensors and JSON are written by hand: sorted names, fixed metadata, sorted keys.

The golden SHA-256 of every file is in tests/model/test_builtin.py; changing anything
here or in builtin_corpus.py / data/builtin_words.txt needs a new RANDOM_VERSION.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

if TYPE_CHECKING:
    import numpy as np
    import torch

from engine import envs
from engine.config import ModelConfig
from engine.models.builtin import (
    BOS_ID,
    BUILTIN_CONFIG,
    CHAT_TEMPLATE,
    EOS_ID,
    EOT_ID,
    RANDOM_VERSION,
    SPECIAL_TOKENS,
)
from engine.models.builtin_corpus import GAMMA, corpus
from engine.models.shapes import expected_shapes

log = logging.getLogger(__name__)

log = logging.getLogger(__name__)

SEED = 0x7A9DE31
CORPUS_CHARS = 900_000
GAIN = 2.0
EMBED_STD = 0.1
SPECIAL_ROW_SCALE = 0.05
NORM_JITTER = 0.1

# torch dtype names -> safetensors' (torch is imported only to build a checkpoint:
# finding a built one, as every router does, stays torch-free)
_SAFETENSORS_DTYPES = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}


def random_model_path(cache_dir: str | Path | None = None) -> Path:
    """The random-weight model's directory, built on first use.

    Lives in `cache_dir`, else $TANDEM_CACHE_DIR, else ~/.cache/tandem, under
    RANDOM_VERSION. Built in a temporary sibling and renamed into place, so a reader
    never sees a partial checkpoint and racing processes agree on one result.
    """
    root = Path(cache_dir).expanduser() if cache_dir else envs.cache_dir()
    final = root / RANDOM_VERSION
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{RANDOM_VERSION}.", dir=root))
    try:
        build_random_checkpoint(tmp)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_random_checkpoint(path: str | Path) -> None:
    """Write the random-weight checkpoint's files into `path` (created if absent)."""
    cfg = ModelConfig.from_hf(BUILTIN_CONFIG)
    log.info("building the random-weight model %s (first run only) into %s", RANDOM_VERSION, path)
    # a bar on a terminal only: in a log file or a pipe its redraws would land among the lines
    with tqdm(total=3, desc=f"building {RANDOM_VERSION}", unit="step", leave=False,
              disable=not sys.stderr.isatty()) as bar:
        tok_json = train_tokenizer(corpus(SEED, CORPUS_CHARS), cfg.vocab_size)
        bar.update()
        tensors = random_weights(cfg, SEED, quiet_rows=range(len(SPECIAL_TOKENS)))
        bar.update()
        write_checkpoint(path, BUILTIN_CONFIG, tensors, files=tokenizer_files(tok_json))
        bar.update()


def train_tokenizer(docs: list[str], vocab_size: int) -> dict[str, Any]:
    """Train byte-level BPE on `docs`; return tokenizer.json's content."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    vocab = dict(sorted(model["vocab"].items(), key=lambda kv: kv[1]))
    if len(vocab) != vocab_size or list(vocab.values()) != list(range(vocab_size)):
        raise RuntimeError(
            f"tokenizer training gave {len(vocab)} ids, expected 0..{vocab_size - 1}"
        )
    return _tokenizer_json(vocab, merges)


def _tokenizer_json(vocab: dict[str, int], merges: list[str]) -> dict[str, Any]:
    bos = SPECIAL_TOKENS[BOS_ID]
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    ]
    seq = lambda part, type_id: {"Sequence": {"id": part, "type_id": type_id}}  # noqa: E731
    special = lambda type_id: {"SpecialToken": {"id": bos, "type_id": type_id}}  # noqa: E731
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [special(0), seq("A", 0)],
            "pair": [special(0), seq("A", 0), special(1), seq("B", 1)],
            "special_tokens": {bos: {"id": bos, "ids": [BOS_ID], "tokens": [bos]}},
        },
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def tokenizer_files(tok_json: dict[str, Any]) -> dict[str, Any]:
    """tokenizer.json plus the config files transformers and vLLM look for."""
    bos, eos = SPECIAL_TOKENS[BOS_ID], SPECIAL_TOKENS[EOS_ID]
    added = {
        str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in tok_json["added_tokens"]
    }
    return {
        "tokenizer.json": tok_json,
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": bos,
            "eos_token": eos,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "model_max_length": BUILTIN_CONFIG["max_position_embeddings"],
            "added_tokens_decoder": added,
        },
        "special_tokens_map.json": {"bos_token": bos, "eos_token": eos},
        "generation_config.json": {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, EOT_ID]},
    }


def uniform(name: str, seed: int, n: int) -> np.ndarray:
    """n float64 values in (-1, 1) from splitmix64, seeded by SHA-256 of (seed, name)."""
    import numpy as np

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    start = np.uint64(int.from_bytes(digest[:8], "little"))
    with np.errstate(over="ignore"):
        z = start + (np.arange(1, n + 1, dtype=np.uint64) * np.uint64(GAMMA))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    k = (z >> np.uint64(40)).astype(np.float64)
    return (k + 0.5) * (2.0 / (1 << 24)) - 1.0


def random_weights(cfg: ModelConfig, seed: int, quiet_rows=()) -> dict[str, torch.Tensor]:
    """Deterministic weights for every tensor of `cfg` (HF names), in cfg.dtype.

    Reusable for any Llama-shaped config (e.g. a larger benchmark model). `quiet_rows`:
    token ids whose embedding (and lm_head) rows are scaled by SPECIAL_ROW_SCALE.
    """
    import numpy as np
    import torch

    out = {}
    for name, shape in sorted(expected_shapes(cfg).items()):
        values = _scaled(name, shape, uniform(name, seed, int(np.prod(shape))).reshape(shape))
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            values[list(quiet_rows)] *= SPECIAL_ROW_SCALE
        out[name] = torch.from_numpy(values.astype(np.float32)).to(getattr(torch, cfg.dtype))
    return out


def _scaled(name: str, shape: tuple[int, ...], u: np.ndarray) -> np.ndarray:
    """Map uniform (-1, 1) values to the tensor's init: norms near 1, small biases,
    matrices with std GAIN / sqrt(fan_in), embeddings with std EMBED_STD."""
    import numpy as np

    if name.endswith("norm.weight"):
        return 1.0 + NORM_JITTER * u
    if len(shape) == 1:
        return 0.02 * u
    embedding = name.endswith(("embed_tokens.weight", "lm_head.weight"))
    std = EMBED_STD if embedding else GAIN / float(np.sqrt(shape[1]))
    return u * (std * float(np.sqrt(3.0)))  # a uniform (-a, a) has std a / sqrt(3)


def write_checkpoint(
    path: str | Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    files: dict[str, Any] | None = None,
    max_shard_bytes: int | None = None,
) -> None:
    """Write a Hugging Face checkpoint: config.json, safetensors, and `files`.

    `files` maps a file name to a dict (written as JSON), str or bytes, e.g. the
    tokenizer files of another checkpoint (see `copy_tokenizer_files`). With
    `max_shard_bytes`, weights go to model-0000i-of-0000n.safetensors shards plus
    model.safetensors.index.json. Output bytes depend only on the arguments.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_file(path / "config.json", config)
    for name, content in sorted((files or {}).items()):
        _write_file(path / name, content)
    shards = _plan_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        write_safetensors(path / "model.safetensors", {n: tensors[n] for n in shards[0]})
        return
    weight_map = {}
    for i, names in enumerate(shards):
        shard = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(path / shard, {n: tensors[n] for n in names})
        weight_map |= {n: shard for n in names}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_file(
        path / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )


def copy_tokenizer_files(src: str | Path) -> dict[str, bytes]:
    """The tokenizer and generation-config files of checkpoint `src`, for `write_checkpoint`."""
    names = (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    )
    return {n: (Path(src) / n).read_bytes() for n in names if (Path(src) / n).is_file()}


def _plan_shards(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_file(file: Path, content: Any) -> None:
    if isinstance(content, (dict, list)):
        content = json.dumps(content, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    file.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)


def write_safetensors(file: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write a .safetensors file deterministically: names sorted, metadata {"format": "pt"}."""
    import torch

    if sys.byteorder != "little":
        raise RuntimeError(
            "safetensors are little-endian; writing them on a big-endian host is not supported"
        )
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[str(t.dtype).removeprefix("torch.")],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    with open(file, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for data in blobs:
            f.write(data)
