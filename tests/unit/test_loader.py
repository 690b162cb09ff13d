"""Checkpoint loading: every validation error on a crafted tiny checkpoint, sharding, dtype."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import ModelConfig
from engine.models.builtin_corpus import corpus
from engine.models.checkpoint import INDEX_FILE, CheckpointError, load_checkpoint
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import build_model, iter_tensors
from engine.models.writer import random_weights, tokenizer_files, train_tokenizer, write_checkpoint

pytestmark = pytest.mark.unit

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 0,
    "eos_token_id": 1,
}


@pytest.fixture(scope="module")
def tok_files() -> dict:
    files = tokenizer_files(train_tokenizer(corpus(2, 5_000), 300))
    files["generation_config.json"] = {"bos_token_id": 0, "eos_token_id": [1, 4]}
    return files


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    return random_weights(ModelConfig.from_hf(TINY), seed=3)


@pytest.fixture
def ckpt(tmp_path, tok_files, tensors):
    """A valid tiny checkpoint directory; tests break one thing in it."""
    write_checkpoint(tmp_path / "ckpt", TINY, tensors, files=tok_files)
    return tmp_path / "ckpt"


def _error(path, match: str) -> CheckpointError:
    with pytest.raises(CheckpointError, match=match) as info:
        load_checkpoint(path)
    return info.value


def test_loads_config_tokenizer_and_tensors(ckpt, tensors):
    c = load_checkpoint(ckpt)
    assert c.path == ckpt and c.config.num_layers == 2 and c.config.num_kv_heads == 2
    assert c.config.eos_token_ids == (
        1,
        4,
    )  # config.json's 1 merged with generation_config's [1, 4]
    assert c.tokenizer.eos_token_ids == (1, 4) and c.tokenizer.encode("hi")[0] == 0
    assert c.hf_config == TINY and c.generation_config["eos_token_id"] == [1, 4]
    loaded = dict(iter_tensors(c))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[n], tensors[n]) for n in tensors)


def test_dtype_override_converts_tensors(ckpt):
    c = load_checkpoint(ckpt, dtype="bfloat16")
    assert c.config.dtype == "bfloat16"
    assert {t.dtype for _, t in iter_tensors(c)} == {torch.bfloat16}


def test_build_model_loads_weights_in_eval_mode(ckpt, tensors):
    model = build_model(load_checkpoint(ckpt), "cpu")
    assert not model.training
    assert torch.equal(model.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    assert torch.equal(
        model.layers[1].self_attn.qkv_proj.weight[:32],
        tensors["model.layers.1.self_attn.q_proj.weight"],
    )
    # buffers computed at construction survive the meta-device build
    reference = dict(LlamaForCausalLM(ModelConfig.from_hf(TINY)).named_buffers())
    buffers = dict(model.named_buffers())
    assert buffers.keys() == reference.keys()
    assert all(torch.equal(buffers[n], reference[n]) for n in reference)


def test_build_model_in_bfloat16(ckpt):
    model = build_model(load_checkpoint(ckpt, dtype="bfloat16"))
    assert model.embed_tokens.weight.dtype == torch.bfloat16


def test_sharded_checkpoint_loads_the_same(tmp_path, tok_files, tensors, ckpt):
    write_checkpoint(tmp_path / "sharded", TINY, tensors, files=tok_files, max_shard_bytes=20_000)
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / INDEX_FILE).is_file()
    a = build_model(load_checkpoint(ckpt)).state_dict()
    b = build_model(load_checkpoint(tmp_path / "sharded")).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_path_missing(tmp_path):
    _error(tmp_path / "nope", "does not exist")


def test_path_not_a_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    _error(tmp_path / "file", "not a directory")


def test_missing_config_json(ckpt):
    (ckpt / "config.json").unlink()
    _error(ckpt, "missing config.json")


def test_invalid_config_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    _error(ckpt, "not valid JSON")


def test_no_safetensors(ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    _error(ckpt, r"no \*.safetensors.*pytorch_model.bin")


def test_index_names_missing_shard(tmp_path, tok_files, tensors):
    path = tmp_path / "sharded"
    write_checkpoint(path, TINY, tensors, files=tok_files, max_shard_bytes=20_000)
    shard = sorted(path.glob("*.safetensors"))[1]
    shard.unlink()
    _error(path, f"names shard.*{shard.name}")


def test_index_names_wrong_shard_for_a_tensor(tmp_path, tok_files, tensors):
    path = tmp_path / "sharded"
    write_checkpoint(path, TINY, tensors, files=tok_files, max_shard_bytes=20_000)
    index = json.loads((path / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]
    (path / INDEX_FILE).write_text(json.dumps(index))
    _error(path, f"not found in the shard.*{name}")


def test_missing_tokenizer_json(ckpt):
    (ckpt / "tokenizer.json").unlink()
    _error(ckpt, "missing tokenizer.json")


def test_unsupported_architecture_names_the_path(ckpt):
    (ckpt / "config.json").write_text(json.dumps({**TINY, "architectures": ["GPT2LMHeadModel"]}))
    err = _error(ckpt, "GPT2LMHeadModel.*is not supported")
    assert str(ckpt / "config.json") in str(err)


def test_shape_mismatch_names_tensor_and_shapes(ckpt, tensors):
    bad = dict(tensors)
    bad["model.layers.1.mlp.up_proj.weight"] = torch.zeros(65, 32)
    write_checkpoint(ckpt, TINY, bad)
    _error(ckpt, r"'model.layers.1.mlp.up_proj.weight' has shape \(65, 32\), expected \(64, 32\)")


def test_missing_tensor(ckpt, tensors):
    bad = {n: t for n, t in tensors.items() if n != "model.norm.weight"}
    write_checkpoint(ckpt, TINY, bad)
    _error(ckpt, "missing tensor.*model.norm.weight")


def test_unexpected_tensor(ckpt, tensors):
    write_checkpoint(
        ckpt, TINY, {**tensors, "model.layers.5.mlp.up_proj.weight": torch.zeros(64, 32)}
    )
    _error(ckpt, "unexpected tensor.*model.layers.5.mlp.up_proj.weight")


def test_tied_checkpoint_may_carry_lm_head(tmp_path, tok_files):
    cfg = {**TINY, "tie_word_embeddings": True}
    tensors = random_weights(ModelConfig.from_hf(cfg), seed=4)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    write_checkpoint(tmp_path, cfg, tensors, files=tok_files)
    model = build_model(load_checkpoint(tmp_path))
    assert model.lm_head is None


def test_corrupt_safetensors(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    _error(ckpt, "not a readable safetensors file")
