"""Per-request sampling and stopping parameters. Pure Python (router, schedulers and
workers all carry them); validated at construction with messages a client can act on."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's limit)
GUIDED_KINDS = ("json", "regex", "choice", "grammar")


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; `param` names the field."""

    def __init__(self, param: str, msg: str) -> None:
        super().__init__(msg)
        self.param = param


class GrammarError(ValueError):
    """A structured-output spec the grammar engine cannot compile (its message)."""


@dataclass(frozen=True)
class GuidedSpec:
    """What a request's output must match (engine/structured.py enforces it). `value`:
    a JSON Schema as JSON text, a regex, a JSON list of strings (choice), or a Lark /
    GBNF grammar."""

    kind: str
    value: str

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise SamplingParamsError("response_format", f"unknown structured output kind {self.kind!r} "
                                      f"(one of {', '.join(GUIDED_KINDS)})")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> "GuidedSpec":
        return cls("json", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def choice(cls, options: list[str]) -> "GuidedSpec":
        return cls("choice", json.dumps(list(options)))


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: off; n >= 0: sampled token's logprob plus top-n
    prompt_logprobs: int | None = None  # None: off; n >= 0: each prompt token's logprob plus top-n
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    guided: GuidedSpec | None = None  # structured output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    speculative: bool = True  # False: this request opts out of speculative decoding
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        def need(cond: bool, param: str, msg: str) -> None:
            if not cond:
                raise SamplingParamsError(param, msg)

        need(self.max_tokens >= 1, "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        need(self.temperature >= 0, "temperature", f"temperature must be >= 0, got {self.temperature}")
        need(0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        need(self.top_k >= -1, "top_k", f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        need(0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        need(
            self.repetition_penalty > 0,
            "repetition_penalty",
            f"repetition_penalty must be > 0, got {self.repetition_penalty}",
        )
        need(-2 <= self.presence_penalty <= 2, "presence_penalty", "presence_penalty must be in [-2, 2]")
        need(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "frequency_penalty must be in [-2, 2]")
        need(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"logprobs must be between 0 and {MAX_LOGPROBS}",
        )
        need(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            "prompt_logprobs",
            f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}",
        )
        need(0 <= self.min_tokens <= self.max_tokens, "min_tokens", "min_tokens must be between 0 and max_tokens")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings")
        need(len(self.stop) <= 16, "stop", "at most 16 stop strings")
        need(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} logit_bias entries")
        need(all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias), "logit_bias",
             "logit_bias maps token ids (>= 0) to biases in [-100, 100]")
        need(self.seed is None or 0 <= self.seed < 2**63, "seed", "seed must be in [0, 2**63)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits, nothing to do to them and no logprobs to report (the
        sampler's fast path). Worked out once per request: the sampler asks every step."""
        return self.greedy and not self.needs_logit_work and self.logprobs is None

    @property
    def needs_logit_work(self) -> bool:
        """Anything the sampler must do to the logits before choosing (fast path: none)."""
        return self.needs_penalties or bool(self.logit_bias) or self.guided is not None

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def replace(self, **kw) -> "SamplingParams":
        return dataclasses.replace(self, **kw)
