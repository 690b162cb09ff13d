"""What an engine hands out per token: plain data, no torch, so the router and the
wire conversion (worker_runtime/convert.py) use it without the model runtime."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sequence import FinishReason


@dataclass
class TokenLogprobs:
    """The chosen token's logprob under the model's distribution and the top-n
    alternatives (best first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-n (token id, logprob), best first
    rank: int | None = None  # the token's rank in the distribution (1: the most likely); prompt logprobs


@dataclass
class TokenEvent:
    """A request's progress after one step: a new token and/or its end."""

    seq_id: str
    token_id: int | None
    logprobs: TokenLogprobs | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None  # on a request's first token, when asked for
    num_draft_tokens: int = 0  # speculative decoding, so far: tokens proposed for the request
    num_accepted_tokens: int = 0  # ... and kept
