"""The random-weight model tandem-tiny-v1: same bytes everywhere, loadable by us and by
transformers, varied output. (The trained built-in pair: test_builtin_trained.py.)"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

import engine.models.writer as writer
from engine.attention import AttentionMetadata, TorchAttention
from engine.models.builtin import RANDOM_VERSION
from engine.models.checkpoint import load_checkpoint
from engine.models.loader import build_model
from engine.models.writer import build_random_checkpoint, random_model_path

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_thread")]

# SHA-256 of every file of tandem-tiny-v1. Another machine, OS or Python version must
# produce exactly these; a change here needs a new RANDOM_VERSION.
GOLDEN_SHA256 = {
    "config.json": "62043f72f958219ad3b93e4b5803b5952d0d93b309931bd77c3b0e4292203680",
    "generation_config.json": "5f2f7e973cd5302b1514a2c6d02b3b3e9740e6443de22cdfeb8c1030aaa8421e",
    "model.safetensors": "45cb39af2888bb83962445f4d1ae33e61e77ecd894cf2b0d331d444c1db9cb54",
    "special_tokens_map.json": "462d91939dbc37178aa5a3eae7068d1990ccc92e09f288cc71f42cdf139d69cc",
    "tokenizer.json": "562b837d51d3e0e2e9af374ac9be1f0a1b607cb5e234846455bd3f6c4ee7db8b",
    "tokenizer_config.json": "7f3f8181eb178096a9dd3c4206ebeb7373004aad5a517e8976087ac2361cc0c5",
}
PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "def main():",
    "User: hello\nAssistant:",
    "1 2 3 4",
]


def _digests(path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return random_model_path(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def checkpoint(path):
    return load_checkpoint(path)


@pytest.fixture(scope="module")
def model(checkpoint):
    return build_model(checkpoint, "cpu")


def _meta_prefill(n: int, blocks: torch.Tensor) -> AttentionMetadata:
    empty = torch.zeros(0, dtype=torch.int32)
    return AttentionMetadata(torch.arange(n), 0, empty.view(0, 1), empty, 0, blocks[None], [n], [n])


def _meta_decode(pos: int, blocks: torch.Tensor) -> AttentionMetadata:
    seq_len = torch.tensor([pos + 1], dtype=torch.int32)
    return AttentionMetadata(
        torch.tensor([pos]), 1, blocks[None], seq_len, pos + 1, blocks[None, :0], [], []
    )


def _kv(model, num_blocks: int):
    c = model.cfg
    shape = (num_blocks, 16, c.num_kv_heads, c.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(c.num_layers)]


@torch.no_grad()
def _prefill_logits(model, ids: list[int]) -> torch.Tensor:  # [T, V]
    blocks = torch.arange((len(ids) + 15) // 16, dtype=torch.int32)
    meta = _meta_prefill(len(ids), blocks)
    hidden = model(
        torch.tensor(ids), torch.arange(len(ids)), _kv(model, len(blocks)), meta, TorchAttention()
    )
    return model.compute_logits(hidden)


@torch.no_grad()
def _greedy(model, ids: list[int], n: int) -> list[int]:
    """Prefill once, then n - 1 paged decode steps."""
    blocks = torch.arange((len(ids) + n + 15) // 16, dtype=torch.int32)
    kv, backend = _kv(model, len(blocks)), TorchAttention()
    hidden = model(
        torch.tensor(ids), torch.arange(len(ids)), kv, _meta_prefill(len(ids), blocks), backend
    )
    out = [int(model.compute_logits(hidden[-1:]).argmax())]
    for pos in range(len(ids), len(ids) + n - 1):
        hidden = model(
            torch.tensor(out[-1:]), torch.tensor([pos]), kv, _meta_decode(pos, blocks), backend
        )
        out.append(int(model.compute_logits(hidden).argmax()))
    return out


def test_golden_bytes(path):
    assert _digests(path) == GOLDEN_SHA256


def test_two_builds_are_identical(path, tmp_path):
    build_random_checkpoint(tmp_path)
    assert _digests(tmp_path) == _digests(path)


def test_cache_dir_from_env_and_reused(monkeypatch, tmp_path, path):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    (tmp_path / RANDOM_VERSION).mkdir()
    assert random_model_path() == tmp_path / RANDOM_VERSION  # present: not rebuilt


def test_lost_race_returns_the_winners_dir(monkeypatch, tmp_path):
    final = tmp_path / RANDOM_VERSION

    def build_while_another_process_wins(tmp):
        (tmp / "config.json").write_text("{}")
        final.mkdir()
        (final / "winner").write_text("x")

    monkeypatch.setattr(writer, "build_random_checkpoint", build_while_another_process_wins)
    assert random_model_path(tmp_path) == final
    assert os.listdir(tmp_path) == [RANDOM_VERSION] and os.listdir(final) == ["winner"]


def test_shape_and_params(checkpoint):
    cfg = checkpoint.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        8192,
        256,
        4,
        4,
        2,
    )
    assert cfg.tie_word_embeddings and cfg.dtype == "float32" and cfg.eos_token_ids == (1, 4)
    assert cfg.num_params == 5_245_184
    assert checkpoint.tokenizer.vocab_size == 8192


def test_greedy_outputs_are_varied_and_never_special(model, checkpoint):
    tok = checkpoint.tokenizer
    outs = [_greedy(model, tok.encode(p), 48) for p in PROMPTS]
    assert len({tuple(o) for o in outs}) == len(PROMPTS)
    for out in outs:
        assert min(out) >= 5  # bos/eos/chat markers are never the argmax
        assert len(set(out[16:])) >= 24  # no collapse onto a few tokens later on
        assert sum(a == b for a, b in zip(out, out[1:])) <= 3


def test_transformers_loads_it_and_agrees(path, model, checkpoint):
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    tok = checkpoint.tokenizer
    text = "Hello world, the café is open 😀 def f(x): return x"
    assert hf_tok.encode(text) == tok.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert hf_tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    ) == tok.apply_chat_template(messages)

    hf = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    ids = tok.encode("The quick brown fox jumps over the lazy dog, and then it rests.")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(_prefill_logits(model, ids), ref, atol=1e-4, rtol=0)
    generated = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[
        0, len(ids) :
    ].tolist()
    assert generated == _greedy(model, ids, 24)
