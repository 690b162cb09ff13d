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

Per step, the sampler asks `fill_bitmask` for the masks of every constrained row at
once (llguidance's executor computes them in parallel, outside the GIL) and applies
them with one vectorised torch operation (`apply_bitmask`).

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
import os
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from engine.sampling_params import GrammarError, GuidedSpec, SamplingParamsError

if TYPE_CHECKING:  # the router checks specs with this module and imports no torch
    import torch

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


@functools.cache
def _executor():
    """One thread on a CPU-only host, where the engine's own threads hold the cores (two
    threads doubled the mask's time at batch 64 on 2 cores: they fought OpenMP's
    spinning workers); on a GPU host, up to 8, half the cores."""
    import llguidance
    import torch

    threads = min(8, max(1, (os.cpu_count() or 2) // 2)) if torch.cuda.is_available() else 1
    return llguidance.LLExecutor(threads)


def fill_bitmask(matchers: Sequence[object], vocab_size: int) -> torch.Tensor:
    """[len(matchers), ceil(V/32)] int32 masks (bit t of row r: token t allowed), one
    parallel call for all rows. (llguidance.torch wraps the same call, but importing it
    sets up torch.compile, seconds of start-up for nothing here.)"""
    mask = torch_full_mask(len(matchers), vocab_size)
    row = mask.shape[1] * 4
    _executor().unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], mask.data_ptr(), row,
                                        len(matchers))
    return mask


def fill_draft_bitmask(matcher, draft: Sequence[int], vocab_size: int) -> torch.Tensor:
    """[1 + len(draft), ceil(V/32)] masks for verifying a speculative draft: row i is the
    mask once draft[:i] is consumed. The matcher is advanced over the draft tokens it
    accepts and rolled back; rows past the first refused draft token allow everything
    (verification rejects that token, so it never reads them)."""
    mask = torch_full_mask(len(draft) + 1, vocab_size)
    ok = matcher.validate_tokens(list(draft)) if draft else 0
    for i in range(ok + 1):
        mask[i] = fill_bitmask([matcher], vocab_size)[0]
        if i < ok:
            matcher.consume_token(draft[i])
    if ok:
        matcher.rollback(ok)
    return mask


def torch_full_mask(rows: int, vocab_size: int) -> torch.Tensor:
    import torch

    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


@functools.cache
def _bit_weights(device: torch.device) -> torch.Tensor:
    import torch

    return torch.arange(32, dtype=torch.int32, device=device)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor | None, mask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of `rows` (None: every row) whose bit in `mask`
    is clear. Columns past the mask (a vocabulary padded beyond the tokenizer's) are
    disallowed."""
    mask = mask.to(logits.device, non_blocking=True)
    vocab = logits.shape[1]
    blocked = ((mask[:, :, None] >> _bit_weights(logits.device)) & 1).reshape(mask.shape[0], -1) == 0
    width = min(vocab, blocked.shape[1])
    sub = logits if rows is None else logits[rows]
    sub[:, :width].masked_fill_(blocked[:, :width], float("-inf"))
    if vocab > width:
        sub[:, width:] = float("-inf")
    if rows is not None:
        logits[rows] = sub
