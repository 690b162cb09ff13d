"""Tokenizer: bos handling, eos ids, chat template, incremental detokenization."""

from __future__ import annotations

import json

import jinja2
import pytest

from engine.models.builtin import CHAT_TEMPLATE
from engine.models.builtin_corpus import corpus
from engine.models.writer import tokenizer_files, train_tokenizer, write_checkpoint
from engine.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, Tokenizer, TokenizerError

pytestmark = pytest.mark.unit

BOS, EOS, START, END, EOT = 0, 1, 2, 3, 4
MULTIBYTE = "naïve café — 東京 and 😀🎉 ∑ done"


@pytest.fixture(scope="module")
def tok_files() -> dict:
    """Tokenizer files like the built-in model's, trained on a small corpus (a few ms)."""
    return tokenizer_files(train_tokenizer(corpus(1, 20_000), 400))


def _write(path, files, config=None, **tok_config_overrides):
    files = dict(files)
    tok_config = dict(files["tokenizer_config.json"])
    for key, value in tok_config_overrides.items():
        if value is None:
            tok_config.pop(key, None)
        else:
            tok_config[key] = value
    files["tokenizer_config.json"] = tok_config
    path.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (path / name).write_text(json.dumps(content), encoding="utf-8")
    (path / "config.json").write_text(json.dumps(config or {}), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tok(tok_files, tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(_write(tmp_path_factory.mktemp("tok"), tok_files))


def test_encode_adds_one_bos_and_decode_round_trips(tok):
    ids = tok.encode("Hello world")
    assert ids[0] == BOS and BOS not in ids[1:]
    assert tok.encode("Hello world", add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == "Hello world"
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>Hello world"
    assert tok.decode(tok.encode(MULTIBYTE)) == MULTIBYTE
    assert tok.vocab_size == 400 and tok.bos_token_id == BOS


def test_add_bos_token_false_drops_the_post_processor_bos(tok_files, tmp_path):
    t = Tokenizer.from_dir(_write(tmp_path, tok_files, add_bos_token=False))
    assert t.encode("Hello")[0] != BOS


def test_add_bos_token_true_adds_bos_when_post_processor_does_not(tok_files, tmp_path):
    files = dict(tok_files)
    files["tokenizer.json"] = {**files["tokenizer.json"], "post_processor": None}
    t = Tokenizer.from_dir(_write(tmp_path / "a", files, add_bos_token=True))
    assert t.encode("Hello")[:1] == [BOS]
    t = Tokenizer.from_dir(_write(tmp_path / "b", files, add_bos_token=None))
    assert t.encode("Hello")[:1] != [BOS]


def test_eos_ids_are_the_union_of_all_configs(tok_files, tmp_path):
    files = {**tok_files, "generation_config.json": {"eos_token_id": [EOT, EOS]}}
    t = Tokenizer.from_dir(
        _write(tmp_path, files, config={"eos_token_id": EOS}, eos_token="<|end_header_id|>")
    )
    assert t.eos_token_ids == (EOS, END, EOT)


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "  Hi there!\n"},
]


def test_chat_template_renders_llama3_style(tok):
    text = tok.apply_chat_template(MESSAGES)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert not tok.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("\n\n")


def test_chat_template_tokenized_has_one_bos_and_the_markers(tok):
    ids = tok.apply_chat_template(MESSAGES, tokenize=True)
    assert ids[0] == BOS and ids.count(BOS) == 1
    assert ids.count(START) == 3 and ids.count(END) == 3 and ids.count(EOT) == 2


def test_chat_template_raise_exception_helper(tok):
    with pytest.raises(jinja2.TemplateError, match="role must be"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_is_sandboxed(tok_files, tmp_path):
    t = Tokenizer.from_dir(
        _write(tmp_path, tok_files, chat_template="{{ messages.__class__.__mro__ }}")
    )
    with pytest.raises(jinja2.exceptions.SecurityError):
        t.apply_chat_template(MESSAGES)


def test_chat_template_sources(tok_files, tmp_path):
    listed = [
        {"name": "tool_use", "template": "x"},
        {"name": "default", "template": "{{ messages | tojson }}"},
    ]
    t = Tokenizer.from_dir(_write(tmp_path / "a", tok_files, chat_template=listed))
    assert json.loads(t.apply_chat_template([{"role": "user", "content": "é"}])) == [
        {"role": "user", "content": "é"}
    ]
    d = _write(tmp_path / "b", tok_files, chat_template=None)
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    assert (
        Tokenizer.from_dir(d)
        .apply_chat_template(MESSAGES)
        .startswith("<|begin_of_text|><|start_header_id|>")
    )


def test_trim_and_lstrip_blocks_like_transformers(tok_files, tmp_path):
    template = "{% for m in messages %}\n    {% if true %}\n[{{ m['content'] }}]\n"
    template += "    {% endif %}\n{% endfor %}"
    t = Tokenizer.from_dir(_write(tmp_path, tok_files, chat_template=template))
    assert t.apply_chat_template(MESSAGES[:1]) == "[Be brief.]\n"


def test_no_chat_template_is_a_clear_error(tok_files, tmp_path):
    t = Tokenizer.from_dir(_write(tmp_path, tok_files, chat_template=None))
    with pytest.raises(TokenizerError, match="no chat template"):
        t.apply_chat_template(MESSAGES)


def test_write_checkpoint_files_load_as_a_tokenizer(tok_files, tmp_path):
    write_checkpoint(tmp_path, {"eos_token_id": [EOS, EOT]}, {}, files=tok_files)
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == (EOS, EOT)


# -- incremental detokenization ------------------------------------------------------


def _feed_one_by_one(detok, ids):
    return [detok.add([i]) for i in ids]


def test_detokenizer_never_emits_a_partial_character(tok):
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    assert any(
        REPLACEMENT_CHAR in tok.decode([i]) for i in ids
    ), "test needs a character split over tokens"
    detok = IncrementalDetokenizer(tok)
    deltas = _feed_one_by_one(detok, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE == detok.text
    assert "" in deltas  # held back while a character was incomplete
    assert detok.flush() == "" and detok.num_tokens == len(ids)


def test_detokenizer_many_tokens_at_once_and_prompt_context(tok):
    prompt = tok.encode("The answer is")
    gen = tok.encode(" café 😀 yes", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    out = detok.add(gen[:3]) + detok.add(gen[3:])
    assert out == " café 😀 yes" and detok.num_tokens == len(gen)


def test_detokenizer_skip_special_tokens(tok):
    ids = (
        tok.encode("one", add_special_tokens=False)
        + [EOT]
        + tok.encode(" two", add_special_tokens=False)
    )
    skipped = IncrementalDetokenizer(tok)
    assert "".join(_feed_one_by_one(skipped, ids)) == "one two"
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(_feed_one_by_one(kept, ids)) == "one<|eot_id|> two"


def test_detokenizer_flush_emits_incomplete_bytes_at_the_end(tok):
    emoji = tok.encode("😀", add_special_tokens=False)
    assert len(emoji) > 1
    detok = IncrementalDetokenizer(tok)
    assert detok.add(tok.encode("ok ", add_special_tokens=False)) == "ok "
    assert detok.add(emoji[:1]) == ""
    assert detok.flush() == REPLACEMENT_CHAR
    assert detok.text == "ok " + REPLACEMENT_CHAR
