"""`tandem generate`: prompts from arguments and JSONL, JSONL out, greedy = transformers."""

import json

import pytest

from cli.main import main
from engine.tokenizer import Tokenizer
from tests.oracle import hf_greedy

pytestmark = pytest.mark.model


def test_generate_from_args_and_jsonl(tmp_path, builtin_dir):
    src = tmp_path / "in.jsonl"
    src.write_text(
        json.dumps({"prompt": "The river", "max_tokens": 5})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "hello"}]})
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    assert (
        main(
            [
                "generate",
                "Once upon a time",
                "-i",
                str(src),
                "-o",
                str(out),
                "--max-tokens",
                "7",
                "--num-blocks",
                "64",
                "--no-progress",
                "--model",
                str(builtin_dir),
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [len(r["token_ids"]) for r in rows] == [7, 5, 7]
    tok = Tokenizer.from_dir(builtin_dir)
    assert rows[0]["token_ids"] == hf_greedy(builtin_dir, tok.encode("Once upon a time"), 7)
    chat_ids = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=True
    )
    assert rows[2]["token_ids"] == hf_greedy(builtin_dir, chat_ids, 7)
    assert rows[1]["text"] == tok.decode(rows[1]["token_ids"])


def test_generate_rejects_bad_input(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(SystemExit, match="not JSON"):
        main(["generate", "-i", str(bad)])
    with pytest.raises(SystemExit, match="no prompts"):
        main(["generate"])
