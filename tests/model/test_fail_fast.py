"""What a user gets wrong fails at once, before Ray or any worker starts: one line on
stderr saying what is wrong, exit code 2, no traceback. Each case runs the real
`tandem` command line in a subprocess."""

import json
import shutil
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.model

# Ray's local start alone takes several seconds here; python, torch and the checks
# take about 3 s on this 2-core machine. A failure within this bound came before Ray.
BEFORE_RAY_S = 15.0


def tandem(*args: str, timeout: float = 120) -> tuple[int, list[str], float]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    return p.returncode, lines, time.monotonic() - t0


def one_line(code: int, lines: list[str], took: float, command: str, *wanted: str) -> None:
    assert code == 2, lines
    assert len(lines) == 1, "\n".join(lines)
    assert lines[0].startswith(f"tandem {command}: error: "), lines[0]
    for w in wanted:
        assert w in lines[0], lines[0]
    assert "Traceback" not in lines[0] and "ray" not in lines[0].lower()
    assert took < BEFORE_RAY_S, f"took {took:.1f} s to fail"


@pytest.fixture
def broken(builtin_dir, tmp_path):
    """A copy of the built-in checkpoint to break one way or another."""
    def copy(name: str):
        d = tmp_path / name
        shutil.copytree(builtin_dir, d)
        return d
    return copy


def test_a_port_in_use_fails_before_ray_starts(builtin_dir):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        code, lines, took = tandem("serve", "--port", str(port), "--model", str(builtin_dir))
    finally:
        taken.close()
    one_line(code, lines, took, "serve", f"cannot listen on 127.0.0.1 port {port}", "in use")


def test_a_model_path_that_does_not_exist(tmp_path):
    missing = tmp_path / "no-such-model"
    one_line(*tandem("serve", "--port", "0", "--model", str(missing)), "serve", f"model path {missing} does not exist")
    one_line(*tandem("generate", "hi", "--model", str(missing)), "generate", "does not exist")
    one_line(*tandem("controller", "--address", "127.0.0.1:1", "--model", str(missing)), "controller",
             "does not exist")


def test_a_model_dir_missing_a_file(broken):
    d = broken("no-tokenizer")
    (d / "tokenizer.json").unlink()
    one_line(*tandem("serve", "--port", "0", "--model", str(d)), "serve", "missing tokenizer.json")
    d = broken("no-weights")
    (d / "model.safetensors").unlink()
    one_line(*tandem("generate", "hi", "--model", str(d)), "generate", "no *.safetensors weight files")


def test_an_unsupported_architecture(broken):
    d = broken("gpt2")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    one_line(*tandem("serve", "--port", "0", "--model", str(d)), "serve", "GPT2LMHeadModel", "not supported")
    one_line(*tandem("generate", "hi", "--model", str(d)), "generate", "not supported")


def test_chat_on_a_model_without_a_chat_template(broken):
    d = broken("no-template")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    one_line(*tandem("generate", "hi", "--chat", "--model", str(d)), "generate", "no chat template")
    # without --chat the same model generates
    code, lines, _ = tandem("generate", "hi", "--max-tokens", "2", "--no-progress", "--model", str(d), timeout=300)
    assert code == 0 and json.loads(lines[-1])["prompt"] == "hi", lines
