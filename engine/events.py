"""What an engine hands out per token: plain data, no torch, so the router and the
wire conversion (protos/tokens.py) use it without the model runtime."""

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
class Usage:
    """A request's token counts, by the names the wire (protos/tokens.py), the router
    and the OpenAI API use."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    completion_tokens: int = 0
    draft_tokens: int = 0  # speculative decoding: tokens proposed for the request
    accepted_tokens: int = 0  # ... and kept


@dataclass
class TokenEvent:
    """A request's progress after one step: a new token and/or its end. Built by
    keyword; most carry a token and its place alone, the last one its usage."""

    seq_id: str
    token_id: int | None
    completion_tokens: int = 0  # the token's place in the output (1 for the first)
    logprobs: TokenLogprobs | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    usage: Usage | None = None  # on the event that finishes the request
    prompt_logprobs: list[TokenLogprobs] | None = None  # on a request's first token, when asked for
