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
- Bounded: a spec longer than `GrammarLimits.max_spec_bytes` is refused before anything
  compiles it (the router answers 400 naming the limit), and llguidance's own limits cap
  the work of one compile. A failure inside the grammar engine (a Rust panic) is a
  GrammarError with one line, never a native backtrace.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable, Sequence, TypeVar

from engine.config import GrammarLimits
from engine.sampling_params import GrammarError, GuidedSpec, SamplingParamsError

_JSON_DEFAULTS = {"whitespace_flexible": False}
T = TypeVar("T")


def check_size(spec: GuidedSpec, limits: GrammarLimits) -> None:
    """GrammarError naming the limit when `spec` is too large to compile at all."""
    size = len(spec.value.encode())
    if size > limits.max_spec_bytes:
        raise GrammarError(f"the spec is {size} bytes, over this server's limit of {limits.max_spec_bytes} "
                           "(--max-grammar-bytes)")


def bounded(spec: GuidedSpec, limits: GrammarLimits, fn: Callable[[], T]) -> T:
    """fn() (a compile of `spec`) once `spec` is within `limits`; any failure of the
    grammar engine, a panic included, as a GrammarError of one line."""
    check_size(spec, limits)
    try:
        return fn()
    except GrammarError:
        raise
    except Exception as e:  # noqa: BLE001 - llguidance's own errors: their first line is the message
        raise GrammarError(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from None
    except BaseException as e:
        if type(e).__name__ != "PanicException":  # pyo3's, a BaseException: the engine failed inside
            raise
        raise GrammarError("the grammar engine failed on this spec (too large or too complex to compile)") from None


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

    def __init__(self, tokenizer_json: str, eos_ids: Sequence[int], limits: GrammarLimits = GrammarLimits()) -> None:
        """tokenizer_json: the text of a tokenizer.json."""
        import llguidance

        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=sorted(eos_ids) or None)
        self.limits = limits

    @classmethod
    def for_checkpoint(cls, path: str | Path, eos_ids: Sequence[int],
                       limits: GrammarLimits = GrammarLimits()) -> "StructuredOutputs | None":
        """None when the checkpoint has no tokenizer.json (no grammar can be enforced)."""
        f = Path(path) / "tokenizer.json"
        return cls(f.read_text(encoding="utf-8"), eos_ids, limits) if f.is_file() else None

    @functools.lru_cache(maxsize=256)
    def _checked(self, spec: GuidedSpec) -> str:
        import llguidance

        def validate() -> str:
            grammar = grammar_text(spec)
            error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
            if error:
                raise GrammarError(error.strip())
            return grammar

        return bounded(spec, self.limits, validate)

    def check(self, spec: GuidedSpec) -> None:
        """Raises GrammarError with the engine's message when `spec` cannot compile."""
        self._checked(spec)

    def matcher(self, spec: GuidedSpec, consumed: Sequence[int] = ()):
        """A fresh matcher for `spec`, advanced over `consumed` (tokens generated earlier)."""
        import llguidance

        grammar = self._checked(spec)
        m = bounded(spec, self.limits, lambda: llguidance.LLMatcher(self.tokenizer, grammar, log_level=0))
        if m.is_error():
            raise GrammarError(m.get_error())
        for t in consumed:
            m.consume_token(t)
        return m


def compile_matcher(structured: "StructuredOutputs | None", spec: GuidedSpec):
    """A fresh matcher for `spec`; SamplingParamsError when it does not compile, or the
    model has no tokenizer.json to compile it against. Workers call it on a thread of
    their own before a request reaches the engine thread (worker_runtime/grammar.py)."""
    if structured is None:
        raise SamplingParamsError("response_format", "structured outputs need the model's tokenizer.json, "
                                  "which this checkpoint lacks")
    try:
        return structured.matcher(spec)
    except GrammarError as e:
        raise SamplingParamsError("response_format", str(e)) from None


def attach_grammar(structured: "StructuredOutputs | None", seq, matcher=None) -> None:
    """Give `seq` (an engine Sequence) the matcher its params ask for (`matcher`, compiled
    already, or compiled here), advanced over the output it already has (a migrated
    request). SamplingParamsError as `compile_matcher`."""
    if seq.params.guided is None:
        return
    if matcher is None:
        matcher = compile_matcher(structured, seq.params.guided)
    for t in seq.output_ids:
        matcher.consume_token(t)
    seq.grammar = matcher
