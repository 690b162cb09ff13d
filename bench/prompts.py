"""Prompt material of a requested token length: token-id lists, or text.

Three ways, chosen by PromptMaker's `fmt` and whether a tokenizer is given:
- "ids": a list of random token ids (exact length). Servers that take `prompt: [ids]`
  on /v1/completions (vLLM, SGLang, llama.cpp, tandem) see exactly that many tokens.
- "text" with a tokenizer (a local HF dir or tokenizer.json, via `tokenizers`): random
  ids decoded to text, then re-encoded and trimmed until the text encodes to the
  target length (exact for that tokenizer, up to a few bounded rounds).
- "text" without a tokenizer: random common English words, one word ~ one token; the
  length is an estimate (`exact` is False) and the server's usage.prompt_tokens is
  what the report counts.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

WORDS = (
    "the of and to in is was for that with as on by he at from his it an were are which "
    "this be or has had not first one their its new after who they have her she two been "
    "other when there all during into school time may years more most only over city some "
    "world would where later up such used many can state about national out known "
    "university united then made under team year through since war he three between "
    "game part both before american became several film being while each number three "
    "season these early people include four well second three including called high "
    "world group following series work around north member south government river music "
    "while play life area album water line house small place light market field paper "
    "system order point story power model family money night table letter answer study "
    "language question reason garden window simple travel morning friend summer color"
).split()


def load_tokenizer(path: str | Path) -> Any:
    """A `tokenizers.Tokenizer` from a tokenizer.json file or a directory holding one."""
    from tokenizers import Tokenizer  # optional dependency, only needed with --tokenizer

    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {p}; pass a HF model dir or the file")
    return Tokenizer.from_file(str(file))


def _ordinary_id_range(tokenizer: Any) -> tuple[int, int]:
    """[lo, hi) of ids past the special / added tokens at either end of the vocab."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    special = sorted(tokenizer.get_added_tokens_decoder().keys())
    lo, hi = 0, size
    for tid in special:
        if tid == lo:
            lo += 1
    for tid in reversed(special):
        if tid == hi - 1:
            hi -= 1
    if hi - lo < 2:
        raise ValueError("tokenizer has no ordinary tokens to sample from")
    return lo, hi


class PromptMaker:
    """Makes prompts of a given token length from a seeded numpy Generator."""

    def __init__(self, fmt: str = "ids", tokenizer: Any = None,
                 id_range: tuple[int, int] | None = None) -> None:
        if fmt not in ("ids", "text"):
            raise ValueError(f"prompt format must be 'ids' or 'text', got {fmt!r}")
        self.fmt = fmt
        self.tokenizer = tokenizer
        if id_range is None:
            id_range = _ordinary_id_range(tokenizer) if tokenizer is not None else (1000, 8000)
        lo, hi = id_range
        if not 0 <= lo < hi:
            raise ValueError(f"bad token id range [{lo}, {hi}); want 0 <= LO < HI")
        self.id_range = (lo, hi)
        self._clean_ids: np.ndarray | None = None

    def _text_ids(self, rng: np.random.Generator, n_tokens: int) -> list[int]:
        """Random ids of tokens that decode, alone, to valid non-empty text (byte-level
        vocabularies also hold partial UTF-8 sequences, which would decode to U+FFFD)."""
        if self._clean_ids is None:
            lo, hi = self.id_range
            clean = [i for i in range(lo, hi)
                     if (t := self.tokenizer.decode([i])) and "\ufffd" not in t]
            if not clean:
                raise ValueError("the tokenizer has no token that decodes to plain text")
            self._clean_ids = np.array(clean)
        return self._clean_ids[rng.integers(0, len(self._clean_ids), size=n_tokens)].tolist()

    @property
    def exact(self) -> bool:
        return self.fmt == "ids" or self.tokenizer is not None

    def make(self, rng: np.random.Generator, n_tokens: int) -> tuple[str | list[int], int]:
        """(prompt, token count): the count is exact when `self.exact`, else an estimate."""
        n_tokens = max(int(n_tokens), 1)
        if self.fmt == "ids":
            return self.ids(rng, n_tokens), n_tokens
        if self.tokenizer is None:
            words = rng.choice(len(WORDS), size=n_tokens)
            return " ".join(WORDS[i] for i in words), n_tokens
        return self._exact_text(rng, n_tokens)

    def ids(self, rng: np.random.Generator, n_tokens: int) -> list[int]:
        return rng.integers(self.id_range[0], self.id_range[1], size=n_tokens).tolist()

    def _exact_text(self, rng: np.random.Generator, n_tokens: int) -> tuple[str, int]:
        tok = self.tokenizer
        text = tok.decode(self._text_ids(rng, n_tokens))
        for _ in range(8):  # decode/encode rarely needs more than two rounds
            enc = tok.encode(text, add_special_tokens=False).ids
            if len(enc) == n_tokens:
                return text, n_tokens
            if len(enc) > n_tokens:
                text = tok.decode(enc[:n_tokens])
            else:
                text = text + tok.decode(self._text_ids(rng, n_tokens - len(enc)))
        return text, len(tok.encode(text, add_special_tokens=False).ids)

    def count(self, text: str) -> int | None:
        """Token count of `text` with the tokenizer, or None without one."""
        if self.tokenizer is None:
            return None
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def concat(self, a: str | list[int], b: str | list[int]) -> str | list[int]:
        if isinstance(a, list) and isinstance(b, list):
            return a + b
        if isinstance(a, str) and isinstance(b, str):
            return f"{a} {b}" if self.tokenizer is None else a + b
        raise TypeError("cannot join a token-id prompt with a text prompt")
