"""What the commands check before they start anything, and how they fail: one line on
stderr and exit code 2 (what was asked cannot be done as given), never a traceback.

    tandem serve: error: model path /no/such/dir does not exist

`check_model` reads a checkpoint's config, tokenizer and safetensors headers only
(engine/models/loader.py), so a wrong `--model` fails in well under a second, before
Ray, workers or weights.
"""

from __future__ import annotations

from pathlib import Path


class CommandError(Exception):
    """Ends a `tandem` command with `tandem CMD: error: MESSAGE` and `code`."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def check_model(path: str | Path, need_chat_template: bool = False, quantization: str | None = None,
                kv_cache_dtype: str = "auto") -> None:
    """Raise CommandError when `path` is not a checkpoint tandem can serve (missing,
    a file missing or unreadable, an unsupported architecture, tensors that do not
    match the config, a quantization it does not load or that `quantization` contradicts)
    or, with `need_chat_template`, when it has no chat template."""
    from engine.models.checkpoint import CheckpointError, load_checkpoint

    try:
        ckpt = load_checkpoint(path, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    except CheckpointError as e:
        raise CommandError(str(e)) from None
    if need_chat_template and ckpt.tokenizer.chat_template is None:
        raise CommandError(f"{ckpt.path}: this checkpoint has no chat template (no chat_template in "
                           "tokenizer_config.json and no chat_template.jinja); drop --chat, or use a chat model")
