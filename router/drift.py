"""The drift monitor: is live traffic still the traffic the cluster was tuned for?

Each router keeps the engine requests that finished within the last `window_s` seconds
(at most the latest MAX_SAMPLES of them)
(prompt and output tokens, prompt tokens found cached, traffic class, arrival) and
compares that picture with a reference: the `workload` section of the profile the
cluster was started with (`tandem serve --config PROFILE`, as `tandem tune` writes it),
or, without one, the first window of live traffic that held `min_requests` requests
(baseline first, then watch).

One distance per dimension, on one scale where 1.0 means "outside what the profile was
tuned for":

    prompt_tokens, output_tokens   max over p50 and p90 of |log2(live / reference)|:
                                   1.0 = the quantile doubled or halved
    arrival_rate                   |log2(live / reference)| (requests/s this router saw)
    prefix_hit_rate, batch_share   |live - reference| / 0.25: 1.0 = 25 points apart

Exported as `tandem:profile_drift{dimension}` (none until the window holds
`min_requests` requests and a reference exists); the TandemProfileDrift alert fires on
any dimension above 1 for 15 minutes. With several routers, each sees its share of the
arrivals: give the profile's `arrival_rate` per router.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import ValidationError

from router.profile import ProfileError, Workload, field_errors

log = logging.getLogger(__name__)

DIMENSIONS = ("prompt_tokens", "output_tokens", "arrival_rate", "prefix_hit_rate", "batch_share")
LENGTHS = ("prompt_tokens", "output_tokens")
SHARES = ("prefix_hit_rate", "batch_share")
SHARE_SCALE = 0.25


@dataclass(frozen=True)
class _Done:
    at: float
    prompt: int
    output: int
    cached: int
    batch: bool


def percentile(values: list[float], q: float) -> float:
    """numpy's default (linear) percentile, without importing numpy into the router."""
    v = sorted(values)
    x = (len(v) - 1) * q / 100
    lo = int(x)
    hi = min(lo + 1, len(v) - 1)
    return float(v[lo] + (v[hi] - v[lo]) * (x - lo))


def summarize(done: list[_Done], span_s: float) -> dict:
    """The traffic picture of `done` (finished over `span_s` seconds), in the profile's
    `workload` shape."""
    prompts = [d.prompt for d in done]
    outputs = [d.output for d in done]
    total_prompt = sum(prompts)
    return {
        "requests": len(done),
        "prompt_tokens": {"p50": percentile(prompts, 50), "p90": percentile(prompts, 90)},
        "output_tokens": {"p50": percentile(outputs, 50), "p90": percentile(outputs, 90)},
        "arrival_rate": len(done) / span_s if span_s > 0 else 0.0,
        "prefix_hit_rate": float(sum(d.cached for d in done) / total_prompt) if total_prompt else 0.0,
        "batch_share": sum(d.batch for d in done) / len(done),
    }


def check_reference(ref) -> dict:
    """A profile's `workload` (router/profile.py's Workload, or its mapping), checked, as
    the plain mapping the monitor compares with live traffic. ProfileError names the field."""
    if not isinstance(ref, Workload):
        try:
            ref = Workload.model_validate(ref)
        except ValidationError as e:
            raise ProfileError("workload: " + field_errors(e)) from None
    return ref.model_dump()


def distances(live: dict, ref: dict) -> dict[str, float]:
    out = {}
    for d in LENGTHS:
        out[d] = max(abs(math.log2(max(live[d][q], 1e-9) / ref[d][q])) for q in ("p50", "p90"))
    out["arrival_rate"] = abs(math.log2(max(live["arrival_rate"], 1e-9) / ref["arrival_rate"]))
    for d in SHARES:
        out[d] = abs(live[d] - ref[d]) / SHARE_SCALE
    return out


class DriftMonitor:
    # Requests kept at most: the quantiles are sorted on every scrape, on the router's
    # event loop, so a busy router judges its latest MAX_SAMPLES requests of the window.
    MAX_SAMPLES = 20_000

    def __init__(self, reference: dict | None = None, window_s: float = 600.0, min_requests: int = 50,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.reference = None if reference is None else check_reference(reference)
        self.reference_source = "profile" if reference is not None else None
        self.window_s = window_s
        self.min_requests = max(1, min_requests)
        self._clock = clock
        self._born = clock()
        self._done: deque[_Done] = deque(maxlen=self.MAX_SAMPLES)

    def record(self, prompt_tokens: int, output_tokens: int, cached_tokens: int, batch: bool) -> None:
        """One finished engine request."""
        now = self._clock()
        self._done.append(_Done(now, prompt_tokens, output_tokens, cached_tokens, batch))
        self._forget(now)
        if self.reference is None and len(self._done) >= self.min_requests:
            self.reference = self._live(now)
            self.reference_source = "first traffic"
            log.info("drift monitor: no workload in the profile; the first %d requests are the reference (%s)",
                     len(self._done), _brief(self.reference))

    def _forget(self, now: float) -> None:
        while self._done and self._done[0].at < now - self.window_s:
            self._done.popleft()

    def _live(self, now: float) -> dict:
        span = min(self.window_s, now - self._born)
        if len(self._done) == self.MAX_SAMPLES:  # the window is longer than what is kept: the kept span
            span = now - self._done[0].at
        return summarize(list(self._done), span)

    def snapshot(self) -> dict:
        """{"reference", "live", "drift"} (drift None until both exist)."""
        now = self._clock()
        self._forget(now)
        live = self._live(now) if len(self._done) >= self.min_requests else None
        drift = distances(live, self.reference) if live and self.reference else None
        return {"reference": self.reference, "reference_source": self.reference_source, "live": live,
                "drift": drift, "window_s": self.window_s, "min_requests": self.min_requests}


def _brief(w: dict) -> str:
    return (f"prompt p50 {w['prompt_tokens']['p50']:.0f}, output p50 {w['output_tokens']['p50']:.0f}, "
            f"{w['arrival_rate']:.2f} req/s, prefix hits {w['prefix_hit_rate']:.0%}, batch {w['batch_share']:.0%}")


class DriftCollector(Collector):
    """`tandem:profile_drift{model_name, dimension}`, computed when scraped."""

    def __init__(self, model: str, monitor: DriftMonitor) -> None:
        self.model = model
        self.monitor = monitor

    def collect(self):
        g = GaugeMetricFamily("tandem:profile_drift", "Distance of live traffic from the profile's workload, per "
                              "dimension (1.0: outside what the profile was tuned for; router/drift.py).",
                              labels=["model_name", "dimension"])
        drift = self.monitor.snapshot()["drift"]
        for dim, value in (drift or {}).items():
            g.add_metric([self.model, dim], value)
        yield g
