"""Router-side Prometheus series, one CollectorRegistry per app (tests build many).

Names follow vLLM's (`vllm:...` -> `tandem:...`) so dashboards translate; every
series carries `model_name`. The list, with meanings, is in docs/metrics.md. Latencies
are measured per engine request (one choice) from the HTTP request's arrival, so TTFT
includes router queueing, tokenization and prefill, as a client sees it.

Worker or cluster metrics join the same endpoint through `RouterMetrics.register`
(any prometheus-client Collector).
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                         0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")
PRESET_STATUSES = ("400", "401", "404", "429", "500", "503")
OK_REASONS = ("stop", "length")


class _LoadCollector(Collector):
    """Running / waiting engine requests, read from admission when scraped."""

    def __init__(self, model: str, load: Callable[[], tuple[int, int]]) -> None:
        self.model = model
        self.load = load

    def collect(self):
        running, waiting = self.load()
        for name, value, doc in (
            ("tandem:num_requests_running", running, "Engine requests admitted by the router and not finished."),
            ("tandem:num_requests_waiting", waiting, "Engine requests queued in the router for admission."),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model], value)
            yield g


class RouterMetrics:
    def __init__(self, model_name: str, slo_ttft_s: float, slo_tpot_s: float,
                 load: Callable[[], tuple[int, int]] = lambda: (0, 0)) -> None:
        self.model = model_name
        self.slo_ttft_s = slo_ttft_s
        self.slo_tpot_s = slo_tpot_s
        self.registry = CollectorRegistry()
        reg, m = self.registry, ["model_name"]
        self.registry.register(_LoadCollector(model_name, load))
        self.success = Counter("tandem:request_success", "Finished engine requests by finish reason.",
                               m + ["finish_reason"], registry=reg)
        self.errors = Counter("tandem:request_errors", "HTTP requests answered with an error, by status.",
                              m + ["status"], registry=reg)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens of engine requests.", m, registry=reg)
        self.generation_tokens = Counter("tandem:generation_tokens", "Generated tokens.", m, registry=reg)
        self.cache_queries = Counter("tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                     m, registry=reg)
        self.cache_hits = Counter("tandem:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  m, registry=reg)
        self.slo = Counter("tandem:slo_attainment", "Successful engine requests that met / missed the TTFT and "
                           "TPOT SLOs.", m + ["met"], registry=reg)
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Arrival to first token.", m,
                              buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("tandem:inter_token_latency_seconds", "Time between consecutive tokens.", m,
                             buckets=TOKEN_LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram("tandem:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", m,
                              buckets=TOKEN_LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "Arrival to last token.", m,
                             buckets=E2E_BUCKETS, registry=reg)
        # the SLO targets themselves, so one alert rule serves every deployment's SLOs
        # (deploy/monitoring: p99 TTFT / TPOT compared with these)
        for name, value, what in (("tandem:slo_ttft_seconds", slo_ttft_s, "TTFT"),
                                  ("tandem:slo_tpot_seconds", slo_tpot_s, "TPOT")):
            Gauge(name, f"The router's {what} SLO target (--slo-{what.lower()}-ms).", m,
                  registry=reg).labels(model_name).set(value)
        for reason in FINISH_REASONS:  # series exist (at 0) before the first event
            self.success.labels(model_name, reason)
        for status in PRESET_STATUSES:
            self.errors.labels(model_name, status)
        for met in ("true", "false"):
            self.slo.labels(model_name, met)
        # The model's children of the per-token series, looked up once (not per token).
        self.m_prompt_tokens = self.prompt_tokens.labels(model_name)
        self.m_generation_tokens = self.generation_tokens.labels(model_name)
        self.m_cache_queries = self.cache_queries.labels(model_name)
        self.m_cache_hits = self.cache_hits.labels(model_name)
        self.m_ttft = self.ttft.labels(model_name)
        self.m_itl = self.itl.labels(model_name)
        self.m_tpot = self.tpot.labels(model_name)
        self.m_e2e = self.e2e.labels(model_name)

    def register(self, collector: Collector) -> None:
        """Serve another collector's series (worker / cluster metrics) on /metrics too."""
        self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_error(self, status: int) -> None:
        self.errors.labels(self.model, str(status)).inc()

    def timer(self, arrival: float) -> "ChoiceTimer":
        return ChoiceTimer(self, arrival)


class ChoiceTimer:
    """Timing of one engine request; reports to RouterMetrics as tokens arrive."""

    def __init__(self, metrics: RouterMetrics, arrival: float) -> None:
        self.m = metrics
        self.arrival = arrival
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.cached = 0  # prompt tokens counted as prefix cache hits so far
        self.done = False

    def on_tokens(self, n: int, prompt_tokens: int, cached_tokens: int, now: float | None = None) -> None:
        """`cached_tokens`: the prompt tokens found in the prefix cache, as known so far
        (a disaggregated request learns them with its last batch, not its first)."""
        m = self.m
        if cached_tokens > self.cached:
            m.m_cache_hits.inc(cached_tokens - self.cached)
            self.cached = cached_tokens
        if n <= 0:
            return
        now = time.monotonic() if now is None else now
        if self.first is None:
            self.first = now
            m.m_ttft.observe(now - self.arrival)
            m.m_prompt_tokens.inc(prompt_tokens)
            m.m_cache_queries.inc(prompt_tokens)
        else:
            gap = (now - self.last) / n
            for _ in range(n):
                m.m_itl.observe(gap)
        self.last = now
        self.tokens += n
        m.m_generation_tokens.inc(n)

    def finish(self, reason: str, now: float | None = None) -> None:
        """Once per engine request; `reason` stop | length | abort."""
        if self.done:
            return
        self.done = True
        m, label = self.m, self.m.model
        m.success.labels(label, reason).inc()
        if reason not in OK_REASONS:
            return
        now = time.monotonic() if now is None else now
        m.m_e2e.observe(now - self.arrival)
        tpot = None
        if self.first is not None and self.tokens > 1:
            tpot = (self.last - self.first) / (self.tokens - 1)
            m.m_tpot.observe(tpot)
        ttft = None if self.first is None else self.first - self.arrival
        met = ttft is not None and ttft <= m.slo_ttft_s and (tpot is None or tpot <= m.slo_tpot_s)
        m.slo.labels(label, "true" if met else "false").inc()
