"""Logprobs in OpenAI's two shapes, from the engine's TokenLogprobs.

A token's string is its own decoding (special tokens included). A token that holds
only part of a UTF-8 character (byte-level BPE) has no string of its own: it is shown
as "bytes:\\xe6\\x97" (vLLM's convention), and chat's `bytes` field carries the raw
bytes either way. -inf logprobs are reported as -9999.0 (JSON has no infinity).
"""

from __future__ import annotations

import codecs
import functools
import math
import re
from typing import Sequence

from tokenizers import decoders

from engine.events import TokenLogprobs
from engine.tokenizer import Tokenizer
from router.protocol import CompletionLogprobs, PromptLogprob, TokenLogprob, TopLogprob

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte fallback
MIN_LOGPROB = -9999.0


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenStrings:
    """Token id -> (string, bytes), cached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_level = isinstance(tokenizer.backend.decoder, decoders.ByteLevel)
        self._alphabet = _byte_level_alphabet() if self._byte_level else {}
        self.lookup = functools.lru_cache(maxsize=65536)(self._lookup)

    def _raw_bytes(self, token_id: int, text: str) -> bytes:
        piece = self.tokenizer.backend.id_to_token(token_id) or ""
        if self._byte_level and piece and all(c in self._alphabet for c in piece):
            return bytes(self._alphabet[c] for c in piece)
        m = _BYTE_TOKEN.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return text.encode("utf-8")

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        raw = self._raw_bytes(token_id, text)
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def text(self, token_id: int) -> str:
        return self.lookup(token_id)[0]


def _clamp(x: float) -> float:
    return MIN_LOGPROB if math.isinf(x) or math.isnan(x) or x < MIN_LOGPROB else x


class TextOffsets:
    """Where each token starts in a choice's text (legacy `text_offset`). The text is
    the UTF-8 decoding of the tokens' bytes, so a token ending inside a character
    starts where that character does."""

    def __init__(self) -> None:
        self.pos = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, raw: bytes) -> int:
        start = self.pos
        self.pos += len(self._decoder.decode(raw))
        return start


def completion_logprobs(strings: TokenStrings, entries: Sequence[TokenLogprobs],
                        offsets: TextOffsets) -> CompletionLogprobs:
    """The legacy `logprobs` object for the next tokens of one choice."""
    out = CompletionLogprobs()
    for lp in entries:
        token, raw = strings.lookup(lp.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(_clamp(lp.logprob))
        out.top_logprobs.append({strings.text(t): _clamp(v) for t, v in lp.top})
        out.text_offset.append(offsets.next(raw))
    return out


def chat_logprobs(strings: TokenStrings, entries: Sequence[TokenLogprobs]) -> list[TokenLogprob]:
    """The `logprobs.content` entries of chat for some tokens."""
    def fields(token_id: int, logprob: float) -> dict:
        text, raw = strings.lookup(token_id)
        return {"token": text, "logprob": _clamp(logprob), "bytes": list(raw)}

    return [
        TokenLogprob(**fields(lp.token_id, lp.logprob),
                     top_logprobs=[TopLogprob(**fields(t, v)) for t, v in lp.top])
        for lp in entries
    ]


def prompt_logprobs(strings: TokenStrings, entries: Sequence[TokenLogprobs] | None
                    ) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs`: None for the first prompt token (nothing comes before
    it), then per token a map from token id to {logprob, rank, decoded_token} holding
    the prompt's own token and the top-n. Ranks of the top-n are their places in it."""
    if entries is None:
        return None
    out: list[dict[str, PromptLogprob] | None] = [None]
    for lp in entries:
        row = {str(t): PromptLogprob(logprob=_clamp(v), rank=i + 1, decoded_token=strings.lookup(t)[0])
               for i, (t, v) in enumerate(lp.top)}
        row[str(lp.token_id)] = PromptLogprob(logprob=_clamp(lp.logprob), rank=lp.rank,
                                              decoded_token=strings.lookup(lp.token_id)[0])
        out.append(row)
    return out
