"""A request as schedulers see it: tokens, blocks and progress. Pure Python."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.plan import DEAD_END, SampleRow
from engine.sampling_params import SamplingParams

INTERACTIVE, BATCH = 0, 1  # priority lanes, served in this order


class Status(enum.Enum):
    WAITING = "waiting"  # queued for a local prefill (colocated, or resumed after preemption)
    AWAITING_KV = "awaiting_kv"  # blocks reserved; a remote prefill writes the prompt's KV
    QUARANTINED = "quarantined"  # reservation ended unlanded; blocks held until no write can land
    RUNNING = "running"
    HANDOFF = "handoff"  # prefill worker: first token sampled, KV being written to a decode worker
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_tokens, or the model's length limit
    STOP = "stop"  # EOS, a stop token id or a stop string
    ABORT = "abort"
    ERROR = "error"
    GRAMMAR_DEAD_END = "grammar_dead_end"  # the structured output allows no token (engine/structured.py)


@dataclass(eq=False)
class Sequence:
    """Invariant: 0 <= num_computed <= num_tokens. Its blocks (which cover the computed
    tokens) are the cache manager's business (engine/kv_cache_manager.py).

        all_ids:   [ prompt ............ | output ....... ]
                   [ computed (KV in cache) ... | to compute ]
                                          ^ num_computed
    A decoding sequence has exactly one token to compute: the last one sampled.
    """

    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: frozenset[int] = frozenset()
    priority: int = INTERACTIVE
    arrival: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprobs of prompt tokens 1.., when asked for
    grammar: object | None = None  # structured output: an llguidance matcher fed every appended token
    # speculative decoding (engine/speculative.py): the proposer's state, this step's draft,
    # and how the drafts fared (drafted and accepted tokens: in all, and recent ones, decayed)
    spec_state: object | None = None
    draft_ids: list[int] = field(default_factory=list)
    num_drafted: int = 0
    num_accepted: int = 0
    recent_drafted: float = 0.0
    recent_accepted: float = 0.0
    # the scheduler's SampleRow for a plain decode of this sequence (no grammar, draft or
    # banned ids left), made once: it holds the live output list, so it stays current
    plain_row: SampleRow | None = field(default=None, repr=False)
    # LongRoPE: past the short factors' length every token of the sequence rotates with
    # the long ones (the scheduler recomputes it once there, as transformers does)
    long_rope: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def prompt_logprobs_left(self) -> bool:
        """Prompt logprobs were asked for and not all computed yet (they need every prompt
        position computed: no prefix-cache hit)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    @property
    def num_to_compute(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token: int) -> FinishReason | None:
        """Append a sampled token (feeding the grammar); the reason to stop now, if any.
        DEAD_END (the sampler found no allowed token) appends nothing."""
        if token == DEAD_END:
            return FinishReason.GRAMMAR_DEAD_END
        self.output_ids.append(token)
        if self.grammar is not None:
            if not self.grammar.consume_token(token):
                return FinishReason.GRAMMAR_DEAD_END
            if self.grammar.is_stopped():  # a complete output: nothing more is allowed
                return self.stop_reason_for(token) or FinishReason.STOP
        return self.stop_reason_for(token)

    def stop_reason_for(self, token: int) -> FinishReason | None:
        """Token-level stop check after `token` was appended (stop strings live elsewhere)."""
        n = len(self.output_ids)
        p = self.params
        if n >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_ids:
                return FinishReason.STOP
            if token in p.stop_token_ids:
                return FinishReason.STOP
        if n >= p.max_tokens:
            return FinishReason.LENGTH
        return None

    def banned_ids(self) -> tuple[int, ...]:
        """Tokens that may not be sampled yet (EOS / stop ids before min_tokens)."""
        if len(self.output_ids) >= self.params.min_tokens:
            return ()
        eos = () if self.params.ignore_eos else tuple(self.eos_ids)
        return eos + tuple(self.params.stop_token_ids)
