"""Structured outputs: a grammar per request, enforced as a token mask in the sampler.

The grammar engine is llguidance (Microsoft's guidance-ai/llguidance, Rust, no Python
dependencies): JSON Schema, regular expressions, choice lists and Lark / GBNF grammars
compile into one kind of matcher that computes the allowed-token bitmask in tens of
microseconds and can be rolled back (what speculative verification needs).

Where the state lives: a `Sequence` holds its matcher (`Sequence.grammar`) and feeds it
every token it appends, so preemption (recompute keeps `output_ids`) and migration
(replaying earlier output) keep it right. Across the disaggregated handoff only the
spec travels, in SamplingParams: the decode worker compiles the same grammar at
reservation and feeds it the prefill worker's first token when the KV lands, which
reproduces the prefill side's state exactly (a matcher is a function of the spec and
the tokens consumed).

Per step, the sampler asks `fill_bitmask` (engine/bitmask.py, the torch side) for the
masks of every constrained row at once (llguidance's executor computes them in
parallel, outside the GIL) and applies them with one vectorised torch operation
(`apply_bitmask`). This module imports no torch: the router checks specs with it.

Decisions:
- JSON is compact by default (no whitespace between tokens): a model that has not
  learnt to close an object could otherwise emit whitespace forever. A schema may ask
  for flexible whitespace with llguidance's own `"x-guidance": {"whitespace_flexible": true}`.
- When the grammar has accepted a complete output and allows nothing more, the request
  ends with finish reason "stop" (as EOS would end it), even under ignore_eos.
- A row whose mask, after banned ids (min_tokens), allows no token at all is a dead
  end: the request ends with finish reason "grammar_dead_end", never hangs.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Sequence

from engine.sampling_params import GrammarError, GuidedSpec, SamplingParamsError

_JSON_DEFAULTS = {"whitespace_flexible": False}


def grammar_text(spec: GuidedSpec) -> str:
    """The llguidance grammar text of `spec` (not yet checked)."""
    import llguidance

    if spec.kind == "json":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=_JSON_DEFAULTS)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        try:
            options = json.loads(spec.value)
        except ValueError:
            options = None
        if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
            raise GrammarError("a choice needs a non-empty list of strings")
        return llguidance.grammar_from("choice", spec.value)
    return llguidance.grammar_from("grammar", spec.value)


class StructuredOutputs:
    """The grammar engine over one tokenizer: checks specs, makes matchers, fills masks."""

    def __init__(self, tokenizer_json: str, eos_ids: Sequence[int]) -> None:
        """tokenizer_json: the text of a tokenizer.json."""
        import llguidance

        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=sorted(eos_ids) or None)

    @classmethod
    def for_checkpoint(cls, path: str | Path, eos_ids: Sequence[int]) -> "StructuredOutputs | None":
        """None when the checkpoint has no tokenizer.json (no grammar can be enforced)."""
        f = Path(path) / "tokenizer.json"
        return cls(f.read_text(encoding="utf-8"), eos_ids) if f.is_file() else None

    @functools.lru_cache(maxsize=256)
    def _checked(self, spec: GuidedSpec) -> str:
        import llguidance

        grammar = grammar_text(spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(error.strip())
        return grammar

    def check(self, spec: GuidedSpec) -> None:
        """Raises GrammarError with the engine's message when `spec` cannot compile."""
        self._checked(spec)

    def matcher(self, spec: GuidedSpec, consumed: Sequence[int] = ()):
        """A fresh matcher for `spec`, advanced over `consumed` (tokens generated earlier)."""
        import llguidance

        m = llguidance.LLMatcher(self.tokenizer, self._checked(spec), log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        for t in consumed:
            m.consume_token(t)
        return m


def attach_grammar(structured: "StructuredOutputs | None", seq) -> None:
    """Give `seq` (an engine Sequence) the matcher its params ask for, advanced over the
    output it already has (a migrated request). SamplingParamsError when the spec does
    not compile, or the model has no tokenizer.json to compile it against."""
    if seq.params.guided is None:
        return
    if structured is None:
        raise SamplingParamsError("response_format", "structured outputs need the model's tokenizer.json, "
                                  "which this checkpoint lacks")
    try:
        seq.grammar = structured.matcher(seq.params.guided, seq.output_ids)
    except GrammarError as e:
        raise SamplingParamsError("response_format", str(e)) from None
