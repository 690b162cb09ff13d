"""Arrival processes: offsets (seconds from the start of the run) of request arrivals.

Inter-arrival gaps are gamma-distributed with shape k = burstiness and mean 1/rate
(scale 1 / (rate * k)), as in vLLM: k = 1 is a Poisson process (exponential gaps),
k < 1 burstier, k > 1 more regular, k = inf a constant gap. Rate inf sends every
request at offset 0 (then --max-concurrency is what limits the load). Unlike vLLM, the
offsets are not rescaled to end exactly at n / rate: they are a plain renewal process,
which also works when the run is bounded by a duration instead of a count.
"""
from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np


def parse_rate(text: str | float) -> float:
    """A request rate in requests/s: a positive number or "inf"."""
    rate = float(text)
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 or inf, got {text!r}")
    return rate


def parse_rates(text: str) -> list[float]:
    """A --sweep list such as "1,2,4,inf"."""
    rates = [parse_rate(x) for x in text.split(",") if x.strip()]
    if not rates:
        raise ValueError("--sweep needs at least one rate, e.g. 1,2,inf")
    return rates


def arrival_offsets(rate: float, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Infinite, non-decreasing arrival offsets starting at the first gap (or 0 for inf)."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        while True:
            yield 0.0
    rng = np.random.default_rng([seed, 1000])
    t = 0.0
    while True:
        if math.isinf(burstiness):
            t += 1.0 / rate
        else:
            t += float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))
        yield t
