"""The trained built-in pair (package data): files as their manifests say, the shapes and
the shared tokenizer, transformers agrees with our forward pass, the reported held-out
losses, and the target writes Python after a held-out function signature."""

from __future__ import annotations

import json

import pytest
import torch

from decode_worker.llm import LLM
from engine.models.builtin import BUILTIN_CONFIG, builtin_draft_path, builtin_model_path, verify_manifest
from engine.models.checkpoint import load_checkpoint
from engine.sampling_params import SamplingParams
from tests.oracle import hf_greedy

pytestmark = pytest.mark.model

# SHA-256 of each manifest.json (which names the SHA-256 of every other file). A new
# training run changes these on purpose: update them with the model.
MANIFESTS = {
    "tandem-tiny-v2": "f5e424961d96f609477d70852a950d4300b0db51c26200bf9fcc916e2d235230",
    "tandem-tiny-v2-draft": "9ea8d0cfc9539b0eb4cfa29e54443bc5558c1414ff7c543adea9a58d0053f739",
}
SIGNATURES = [  # the first two open functions of held-out files (email/contentmanager.py, email/_encoded_words.py)
    "def get_text_content(msg, errors='replace'):",
    "def decode_q(encoded):",
    "class Stack:\n    def __repr__(self):",
]


@pytest.mark.parametrize("path", [builtin_model_path(), builtin_draft_path()], ids=["target", "draft"])
def test_files_match_their_manifest(path):
    assert verify_manifest(path) == MANIFESTS[path.name]


def test_shapes_and_one_tokenizer():
    t, d = load_checkpoint(builtin_model_path()), load_checkpoint(builtin_draft_path())
    assert t.config.num_params == 5_245_184 and t.config.hidden_size == BUILTIN_CONFIG["hidden_size"]
    assert d.config.num_params < t.config.num_params / 3 and d.config.vocab_size == t.config.vocab_size
    assert t.config.dtype == "float32" and t.config.eos_token_ids == (1, 4)
    tokenizers = [(p / "tokenizer.json").read_bytes() for p in (builtin_model_path(), builtin_draft_path())]
    assert tokenizers[0] == tokenizers[1]


def test_held_out_losses_are_reported_and_the_target_is_better():
    losses = {}
    for p in (builtin_model_path(), builtin_draft_path()):
        m = json.loads((p / "manifest.json").read_text())
        assert m["training"]["held_out_tokens"] > 100_000 and m["corpus"]["files_held_out"] > 50
        losses[p.name] = m["training"]["held_out_loss_per_token"]
    assert losses["tandem-tiny-v2"] < 2.5 and losses["tandem-tiny-v2"] < losses["tandem-tiny-v2-draft"] < 4.0, losses


def test_transformers_agrees_on_the_trained_weights():
    path = builtin_model_path()
    tok = load_checkpoint(path).tokenizer
    ids = tok.encode(SIGNATURES[0])  # a prompt ends at the colon: the tokenizer joins "\n" to the indent after it
    llm = LLM(model=str(path), num_threads=1)
    out = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(path, ids, 32, ignore_eos=True)


def test_the_target_writes_python_after_a_signature():
    path = builtin_model_path()
    before = torch.get_num_threads()
    llm = LLM(model=str(path), num_threads=1)
    try:
        outs = llm.generate(SIGNATURES, SamplingParams(max_tokens=48, temperature=0), use_tqdm=False)
    finally:
        torch.set_num_threads(before)
    for sig, o in zip(SIGNATURES, outs):
        text = o.outputs[0].text
        assert min(o.outputs[0].token_ids) >= 5  # no special token
        # the body starts on the next line, indented under the signature, and reads as code
        last = sig.splitlines()[-1]
        indent = len(last) - len(last.lstrip()) + 4
        assert text.startswith("\n" + " " * indent) and not text[1 + indent].isspace(), (sig, text)
        assert any(k in text for k in ("return", "raise", " = ", "if ")), (sig, text)
