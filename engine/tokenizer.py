"""Tokenizer of a Hugging Face checkpoint: tokenizer.json plus tokenizer_config.json.

The router owns tokenization and the chat template; workers see token ids only.
`IncrementalDetokenizer` turns a request's stream of generated ids into text deltas.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Sequence

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

# An incomplete UTF-8 sequence decodes to this; never emitted while more bytes may come.
REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context so that the first generated token decodes as it
# would inside the whole text (SentencePiece-style decoders strip a leading space).
_CONTEXT_TOKENS = 5


class TokenizerError(ValueError):
    """The tokenizer files are missing or inconsistent, or a chat template is absent."""


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(tok: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or an AddedToken dict."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def merged_eos_ids(*configs: dict[str, Any]) -> list[int]:
    """Union of the `eos_token_id` fields (int or list) of config / generation config dicts."""
    ids: list[int] = []
    for cfg in configs:
        ids += [i for i in _as_id_list(cfg.get("eos_token_id")) if i not in ids]
    return ids


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """Sandboxed, with the whitespace rules and helpers transformers gives chat templates."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _pick_template(template: Any) -> str | None:
    """A chat_template is a string or a list of {"name", "template"}; take "default"."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default")
    return template


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the checkpoint's special tokens and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        tokenizer_config: dict[str, Any] | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        cfg = tokenizer_config or {}
        self.bos_token = _token_content(cfg.get("bos_token"))
        self.eos_token = _token_content(cfg.get("eos_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        eos = list(eos_token_ids)
        eos_id = self._id_of(self.eos_token)
        if eos_id is not None and eos_id not in eos:
            eos.append(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))
        self.chat_template = chat_template or _pick_template(cfg.get("chat_template"))
        self._add_bos = cfg.get("add_bos_token")  # None: trust the post-processor
        first_of_empty = backend.encode("").ids[:1]
        self._post_adds_bos = self.bos_token_id is not None and first_of_empty == [
            self.bos_token_id
        ]
        self._template: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load from a checkpoint directory; eos ids merge config.json, generation_config.json
        and tokenizer_config.json's eos_token."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(
                f"{path}: no tokenizer.json (tandem reads fast-tokenizer files only)"
            )
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        eos = merged_eos_ids(
            _read_json(path / "config.json"), _read_json(path / "generation_config.json")
        )
        template_file = path / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        return cls(backend, _read_json(path / "tokenizer_config.json"), eos, template)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """At most this many characters of text become one token: the longest vocabulary
        entry (byte-level entries spell one byte a character, and a decoded character
        takes at least one byte). Text longer than `n * max_token_chars` cannot fit in
        `n` tokens, which is known without tokenizing it."""
        return max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with special tokens, bos follows `add_bos_token` when the
        config sets it and the tokenizer's post-processor otherwise."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens or self._add_bos is None or self.bos_token_id is None:
            return ids
        if self._add_bos and not self._post_adds_bos:
            return [self.bos_token_id] + ids
        if not self._add_bos and self._post_adds_bos and ids[:1] == [self.bos_token_id]:
            return ids[1:]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (bytes of an incomplete character decode to U+FFFD)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the checkpoint's chat template.

        The rendered text already holds bos when the template writes it, so with
        `tokenize=True` it is encoded without adding special tokens (as transformers does);
        encode rendered text yourself with `add_special_tokens=False` too.
        """
        if self.chat_template is None:
            raise TokenizerError(
                "this checkpoint has no chat template (no chat_template in tokenizer_config.json "
                "and no chat_template.jinja); use the completions API or a chat/instruct model"
            )
        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        text = self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas, as they arrive.

    Text is emitted only once it is final: a delta never ends in a partial UTF-8
    character (byte-level BPE can split one character over several tokens), so
    `"".join(deltas) == tokenizer.decode(generated_ids)` once `flush()` is called.
    `text` is everything emitted so far; a caller matching stop strings holds back the
    tail of the deltas itself.

    Invariant: ids[prefix:read] decode to text already emitted (kept as left context);
    ids[read:] are not yet emitted.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self._num_prompt = len(self._ids)
        self.text = ""

    @property
    def num_tokens(self) -> int:
        """Generated tokens fed so far."""
        return len(self._ids) - self._num_prompt

    def add(self, token_ids: Iterable[int]) -> str:
        """Feed newly generated ids; return the new final text (possibly "")."""
        self._ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the request: emit what is held back, incomplete bytes included."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self.tokenizer.decode
        before = decode(self._ids[self._prefix : self._read], self.skip_special_tokens)
        after = decode(self._ids[self._prefix :], self.skip_special_tokens)
        if len(after) <= len(before) or (after.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta
