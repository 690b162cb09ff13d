"""RouterSettings: everything the HTTP layer needs, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from router.admission import ORDERS


class SettingsError(ValueError):
    pass


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise SettingsError(msg)


@dataclass(frozen=True)
class RouterSettings:
    served_model_name: str = "tandem-tiny-v2"
    # More names the model is served under (vLLM's --served-model-name a b): accepted in
    # requests and listed by /v1/models; answers name the first
    more_served_names: tuple[str, ...] = ()
    # More names a request's `model` may use for the same model (e.g. the checkpoint path).
    model_aliases: tuple[str, ...] = ()
    # API keys on /v1/*: none (and no file) means the OpenAI endpoints are open.
    api_keys: frozenset[str] = frozenset()
    api_key_file: str | None = None
    # Key for /admin; None keeps /admin closed.
    admin_key: str | None = None
    # Admission in the router, counted in engine requests (prompts x n of each HTTP
    # request): at most `max_concurrent_requests` in the backend, at most
    # `max_queued_requests` waiting for a slot (beyond: 429), each waiting at most
    # `queue_timeout_s` (then 503). Both answers carry Retry-After: an estimate from the
    # rate slots are given back (router/admission.py), at least `retry_after_s`.
    max_concurrent_requests: int = 256
    max_queued_requests: int = 1024
    queue_timeout_s: float = 30.0
    retry_after_s: float = 1.0
    # Whom the queue serves first (router/admission.py): "priority" (interactive first;
    # a batch request waits at most `batch_aging_s` longer than interactive ones that
    # came after it) or "fifo" (arrival order).
    admission_order: str = "priority"
    batch_aging_s: float = 10.0
    # On SIGTERM/SIGINT (`tandem serve`): how long in-flight requests may run on while
    # /ready and new requests answer 503 (router/shutdown.py).
    shutdown_grace_s: float = 30.0
    # Largest request body accepted (413 beyond). Text that cannot fit in the context
    # is refused before it is tokenized whatever this is (router/serving.py).
    max_request_body_bytes: int = 8 * 1024 * 1024
    # Chat tool calling under tool_choice "auto": the format the model writes calls in
    # (router/tools.py PARSERS: hermes, llama3_json, mistral); None: "auto" is refused.
    tool_call_parser: str | None = None
    # Structured outputs: the largest spec a request may carry (400 beyond, before any
    # compile), and how long its compile may take off the event loop (400 beyond).
    max_grammar_bytes: int = 256 * 1024
    grammar_compile_timeout_s: float = 10.0
    # Largest n, and largest prompts x n of one request.
    max_n: int = 16
    max_choices_per_request: int = 256
    # max_tokens of /v1/completions when the request gives none (OpenAI legacy).
    default_completion_max_tokens: int = 16
    # SLO targets of tandem:slo_attainment_total, per traffic class: interactive
    # (priority <= 0) and batch (priority > 0).
    slo_ttft_s: float = 1.0
    slo_tpot_s: float = 0.1
    batch_slo_ttft_s: float = 30.0
    batch_slo_tpot_s: float = 0.5
    # The drift monitor (router/drift.py): the reference workload (a profile's
    # `workload` section; None: the first window of traffic), the window it looks at,
    # and how many requests a window needs before it is judged.
    drift_reference: dict | None = None
    drift_window_s: float = 600.0
    drift_min_requests: int = 50
    # The app's lifespan starts the backend on startup and stops it on shutdown.
    manage_backend: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_keys", frozenset(self.api_keys))  # accept any iterable
        object.__setattr__(self, "model_aliases", tuple(self.model_aliases))
        object.__setattr__(self, "more_served_names", tuple(self.more_served_names))
        _require(bool(self.served_model_name), "served_model_name must not be empty")
        _require(self.max_concurrent_requests >= 1, "max_concurrent_requests must be >= 1")
        _require(self.max_queued_requests >= 0, "max_queued_requests must be >= 0 (0: no queue, 429 when busy)")
        _require(self.queue_timeout_s > 0, "queue_timeout_s must be > 0")
        _require(self.retry_after_s > 0, "retry_after_s must be > 0")
        _require(self.admission_order in ORDERS, f"admission_order must be one of {', '.join(ORDERS)}")
        _require(self.batch_aging_s >= 0, "batch_aging_s must be >= 0")
        _require(self.shutdown_grace_s >= 0, "shutdown_grace_s must be >= 0")
        _require(self.max_request_body_bytes >= 1024, "max_request_body_bytes must be >= 1024")
        _require(self.max_n >= 1, "max_n must be >= 1")
        _require(self.max_choices_per_request >= self.max_n,
                 "max_choices_per_request must be >= max_n")
        _require(self.default_completion_max_tokens >= 1, "default_completion_max_tokens must be >= 1")
        _require(min(self.slo_ttft_s, self.slo_tpot_s, self.batch_slo_ttft_s, self.batch_slo_tpot_s) > 0,
                 "SLO targets must be > 0 seconds")
        _require(self.drift_window_s > 0 and self.drift_min_requests >= 1,
                 "drift_window_s must be > 0 and drift_min_requests >= 1")
        _require(not self.admin_key or self.admin_key not in self.api_keys,
                 "the admin key must differ from every API key")

    @property
    def slos(self) -> dict[str, tuple[float, float]]:
        """(TTFT, TPOT) targets in seconds, per traffic class."""
        return {"interactive": (self.slo_ttft_s, self.slo_tpot_s),
                "batch": (self.batch_slo_ttft_s, self.batch_slo_tpot_s)}

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.more_served_names, *self.model_aliases)

    @property
    def listed_names(self) -> tuple[str, ...]:
        """The names /v1/models lists."""
        return (self.served_model_name, *self.more_served_names)
