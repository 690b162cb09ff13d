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
from collections import deque
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.build_info import build_info
from worker_runtime import tracing

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                         0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
GRAMMAR_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000)
FINISH_REASONS = ("stop", "length", "abort")
CLASSES = ("interactive", "batch")  # traffic classes, indexed by engine lane (0, 1)
PRESET_STATUSES = ("400", "401", "404", "429", "500", "503")
OK_REASONS = ("stop", "length")


class _LoadCollector(Collector):
    """Running engine requests, and those waiting per traffic class, read from
    admission when scraped."""

    def __init__(self, model: str, load: Callable[[], tuple[int, list[int]]]) -> None:
        self.model = model
        self.load = load

    def collect(self):
        running, waiting = self.load()
        g = GaugeMetricFamily("tandem:router_num_requests_running", "Engine requests admitted by the router and not "
                              "finished.", labels=["model_name"])
        g.add_metric([self.model], running)
        yield g
        g = GaugeMetricFamily("tandem:router_num_requests_waiting", "Engine requests queued in the router for "
                              "admission, per traffic class.", labels=["model_name", "class"])
        for cls, n in zip(CLASSES, waiting):
            g.add_metric([self.model, cls], n)
        yield g


class _Renamed(Collector):
    """Another metric's series under a second name (and help), read when scraped."""

    def __init__(self, metric, name: str, documentation: str) -> None:
        self.metric, self.name, self.documentation = metric, name, documentation

    def collect(self):
        old = self.metric._name
        for fam in self.metric.collect():
            fam.name, fam.documentation = self.name, self.documentation
            fam.samples = [s._replace(name=self.name + s.name[len(old):]) for s in fam.samples]
            yield fam


class RouterMetrics:
    def __init__(self, model_name: str, slos: dict[str, tuple[float, float]],
                 load: Callable[[], tuple[int, list[int]]] = lambda: (0, [0, 0])) -> None:
        """`slos`: per traffic class (CLASSES), its (TTFT, TPOT) targets in seconds."""
        self.model = model_name
        self.slos = [slos[c] for c in CLASSES]
        self.drift = None  # a router/drift.py DriftMonitor, fed with every successful engine request
        # (when, TTFT met, TPOT met or None) of recent successful requests: the autoscaler's SLO signal
        self.recent: deque[tuple[float, bool, bool | None]] = deque(maxlen=20_000)
        self.registry = CollectorRegistry()
        reg, m, mc = self.registry, ["model_name"], ["model_name", "class"]
        self.registry.register(_LoadCollector(model_name, load))
        info = build_info()
        Gauge("tandem:build_info", "The tandem this process runs (1): its version and commit.",
              ["component", "version", "commit"], registry=reg).labels("router", info["version"], info["commit"]).set(1)
        # vLLM's names and labels wherever tandem measures the same thing (vllm:X is tandem:X)
        self.success = Counter("tandem:request_success", "Finished engine requests by finish reason.",
                               m + ["finished_reason"], registry=reg)
        self.errors = Counter("tandem:request_errors", "HTTP requests answered with an error, by status.",
                              m + ["status"], registry=reg)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens of engine requests.", m, registry=reg)
        self.generation_tokens = Counter("tandem:generation_tokens", "Generated tokens.", m, registry=reg)
        self.cache_queries = Counter("tandem:router_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                     "cache (every prompt token: usage's prompt_tokens).", m, registry=reg)
        self.cache_hits = Counter("tandem:router_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  m, registry=reg)
        self.slo = Counter("tandem:slo_attainment", "Successful engine requests that met / missed their traffic "
                           "class's TTFT and TPOT SLOs.", mc + ["met"], registry=reg)
        self.goodput_tokens = Counter("tandem:goodput_tokens", "Output tokens of engine requests that met their "
                                      "class's SLOs.", mc, registry=reg)
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Arrival to first token.", mc,
                              buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("tandem:inter_token_latency_seconds", "Time between consecutive tokens.", mc,
                             buckets=TOKEN_LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram("tandem:request_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", mc,
                              buckets=TOKEN_LATENCY_BUCKETS, registry=reg)
        # vLLM's older name of the inter-token latency: the same histogram under a second
        # name, copied at scrape time (not observed twice a token)
        reg.register(_Renamed(self.itl, "tandem:time_per_output_token_seconds",
                              "Time between consecutive tokens, per token (vLLM's older name of the inter-token "
                              "latency)."))
        phases = (("queue", "Arrival to leaving the router's admission queue.", TTFT_BUCKETS),
                  ("prefill", "Leaving the admission queue to the first token (the engine's queue, the "
                   "prefill and, disaggregated, the KV transfer).", TTFT_BUCKETS),
                  ("decode", "First token to last.", E2E_BUCKETS),
                  ("inference", "Leaving the admission queue to the last token.", E2E_BUCKETS))
        self.phase = {name: Histogram(f"tandem:request_{name}_time_seconds", doc, mc, buckets=b, registry=reg)
                      for name, doc, b in phases}
        self.req_prompt = Histogram("tandem:request_prompt_tokens", "Prompt tokens per finished request.", mc,
                                    buckets=COUNT_BUCKETS, registry=reg)
        self.req_generation = Histogram("tandem:request_generation_tokens", "Generated tokens per finished "
                                        "request.", mc, buckets=COUNT_BUCKETS, registry=reg)
        self.req_max_tokens = Histogram("tandem:request_params_max_tokens", "max_tokens of finished requests.",
                                        mc, buckets=COUNT_BUCKETS, registry=reg)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "Arrival to last token.", mc,
                             buckets=E2E_BUCKETS, registry=reg)
        self.grammar_compile = Histogram("tandem:grammar_compile_seconds", "Compiling a request's structured-output "
                                         "spec (off the event loop), those that compiled and those refused.", m,
                                         buckets=GRAMMAR_BUCKETS, registry=reg)
        self.grammar_failures = Counter("tandem:grammar_compile_failures", "Structured-output specs refused, by "
                                        "reason: too_large (over --max-grammar-bytes), timeout, invalid.",
                                        ["model_name", "reason"], registry=reg)
        # the SLO targets themselves, so one alert rule serves every deployment's SLOs
        # (deploy/monitoring: p99 TTFT / TPOT per class compared with these)
        for name, i, what in (("tandem:slo_ttft_seconds", 0, "TTFT"), ("tandem:slo_tpot_seconds", 1, "TPOT")):
            g = Gauge(name, f"The router's {what} SLO target per traffic class (--slo-{what.lower()}-ms, "
                      f"--batch-slo-{what.lower()}-ms).", mc, registry=reg)
            for cls, slo in zip(CLASSES, self.slos):
                g.labels(model_name, cls).set(slo[i])
        for reason in FINISH_REASONS:  # series exist (at 0) before the first event
            self.success.labels(model_name, reason)
        for status in PRESET_STATUSES:
            self.errors.labels(model_name, status)
        for reason in ("too_large", "timeout", "invalid"):
            self.grammar_failures.labels(model_name, reason)
        for cls in CLASSES:
            for met in ("true", "false"):
                self.slo.labels(model_name, cls, met)
            self.goodput_tokens.labels(model_name, cls)
        # The model's children of the per-token series, looked up once (not per token);
        # the latency ones per class (index: the engine lane).
        self.m_prompt_tokens = self.prompt_tokens.labels(model_name)
        self.m_generation_tokens = self.generation_tokens.labels(model_name)
        self.m_cache_queries = self.cache_queries.labels(model_name)
        self.m_cache_hits = self.cache_hits.labels(model_name)
        self.c_ttft = [self.ttft.labels(model_name, c) for c in CLASSES]
        self.c_itl = [self.itl.labels(model_name, c) for c in CLASSES]
        self.c_tpot = [self.tpot.labels(model_name, c) for c in CLASSES]
        self.c_e2e = [self.e2e.labels(model_name, c) for c in CLASSES]

    def register(self, collector: Collector) -> None:
        """Serve another collector's series (worker / cluster metrics) on /metrics too."""
        self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_error(self, status: int) -> None:
        self.errors.labels(self.model, str(status)).inc()

    def admission_limits(self, max_running: int, max_waiting: int, queue_timeout_s: float) -> None:
        """The router's admission settings as gauges, so a dashboard or a benchmark of the
        defaults shows what sheds load (--max-concurrent-requests, --max-queued-requests,
        --queue-timeout-s)."""
        for name, doc, value in (
                ("tandem:admission_max_running", "Engine requests the router admits at once "
                 "(--max-concurrent-requests, weighted).", max_running),
                ("tandem:admission_max_waiting", "Engine requests the router queues before it answers 429 "
                 "(--max-queued-requests, weighted).", max_waiting),
                ("tandem:admission_queue_timeout_seconds", "How long a request waits in the router's queue "
                 "before it is answered 503 (--queue-timeout-s).", queue_timeout_s)):
            Gauge(name, doc, ["model_name"], registry=self.registry).labels(self.model).set(value)

    def recent_slo(self, window_s: float = 30.0, now: float | None = None) -> dict[str, int]:
        """TTFT and TPOT SLOs met, out of the successful requests of the last `window_s`."""
        now = time.monotonic() if now is None else now
        while self.recent and self.recent[0][0] < now - window_s:
            self.recent.popleft()
        tpots = [t for _, _, t in self.recent if t is not None]
        return {"ttft_met": sum(t for _, t, _ in self.recent), "ttft_total": len(self.recent),
                "tpot_met": sum(tpots), "tpot_total": len(tpots)}

    def timer(self, arrival: float, cls: int = 0, max_tokens: int | None = None) -> "ChoiceTimer":
        """`cls`: the request's traffic class (0 interactive, 1 batch). Made as the request
        leaves the admission queue."""
        return ChoiceTimer(self, arrival, cls, max_tokens)


class ChoiceTimer:
    """Timing of one engine request; reports to RouterMetrics as tokens arrive."""

    def __init__(self, metrics: RouterMetrics, arrival: float, cls: int = 0, max_tokens: int | None = None) -> None:
        self.m = metrics
        self.cls = cls
        self.arrival = arrival
        self.admitted = time.monotonic()  # made as it leaves the admission queue
        self.max_tokens = max_tokens
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.cached = 0  # prompt tokens counted as prefix cache hits so far
        self.prompt_tokens = 0
        self.done = False
        self.span = None  # the engine request's trace span (worker_runtime/tracing.py), when traced

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
            self.prompt_tokens = prompt_tokens
            m.c_ttft[self.cls].observe(now - self.arrival)
            m.m_prompt_tokens.inc(prompt_tokens)
            m.m_cache_queries.inc(prompt_tokens)
        else:
            gap = (now - self.last) / n
            itl = m.c_itl[self.cls]
            for _ in range(n):
                itl.observe(gap)
        self.last = now
        self.tokens += n
        m.m_generation_tokens.inc(n)

    def finish(self, reason: str, now: float | None = None) -> None:
        """Once per engine request; `reason` stop | length | abort."""
        if self.done:
            return
        self.done = True
        now = time.monotonic() if now is None else now
        if self.span is not None:
            self._trace(reason, now)
        m, label = self.m, self.m.model
        m.success.labels(label, reason).inc()
        if reason not in OK_REASONS:
            return
        cls = self.cls
        m.c_e2e[cls].observe(now - self.arrival)
        name = CLASSES[cls]
        admitted = max(self.admitted, self.arrival)
        m.phase["queue"].labels(label, name).observe(admitted - self.arrival)
        if self.first is not None:
            m.phase["prefill"].labels(label, name).observe(max(0.0, self.first - admitted))
            m.phase["decode"].labels(label, name).observe(self.last - self.first)
            m.phase["inference"].labels(label, name).observe(max(0.0, self.last - admitted))
        m.req_prompt.labels(label, name).observe(self.prompt_tokens)
        m.req_generation.labels(label, name).observe(self.tokens)
        if self.max_tokens is not None:
            m.req_max_tokens.labels(label, name).observe(self.max_tokens)
        tpot = None
        if self.first is not None and self.tokens > 1:
            tpot = (self.last - self.first) / (self.tokens - 1)
            m.c_tpot[cls].observe(tpot)
        ttft = None if self.first is None else self.first - self.arrival
        slo_ttft, slo_tpot = m.slos[cls]
        ttft_met = ttft is not None and ttft <= slo_ttft
        tpot_met = None if tpot is None else tpot <= slo_tpot
        m.recent.append((now, ttft_met, tpot_met))
        met = ttft_met and tpot_met is not False
        m.slo.labels(label, CLASSES[cls], "true" if met else "false").inc()
        if met:
            m.goodput_tokens.labels(label, CLASSES[cls]).inc(self.tokens)
        if m.drift is not None:
            m.drift.record(self.prompt_tokens, self.tokens, self.cached, cls == 1)

    def _trace(self, reason: str, now: float) -> None:
        """The request's spans from what was measured: its time in the router's queue,
        and its decode (first token to last, as the router saw them)."""
        span, admitted = self.span, max(self.admitted, self.arrival)
        tracing.phase("queue", span, self.arrival, admitted)
        if self.first is not None:
            tracing.phase("decode", span, self.first, self.last, {"gen_ai.usage.output_tokens": self.tokens})
        span.set_attribute("tandem.finish_reason", reason)
        tracing.end(span, now, None if reason in OK_REASONS else reason)
