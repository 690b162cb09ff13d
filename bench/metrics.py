"""Pure functions from recorded timelines to benchmark metrics (definitions: docs/bench.md).

Definitions, as in vLLM's `bench serve` unless said otherwise:
- TTFT: first token-carrying chunk minus send time.
- E2E: last token-carrying chunk minus send time.
- TPOT (per request): (E2E - TTFT) / (output_tokens - 1); undefined (excluded from the
  TPOT statistics, and counted as meeting a TPOT SLO) when output_tokens <= 1.
- ITL: the gaps between consecutive token-carrying chunks. Where a chunk is known to
  carry k > 1 tokens, its gap is split into k equal samples (gap / k) (SGLang's choice);
  vLLM keeps one sample per chunk. Extra tokens in the first chunk add zero gaps. With
  one token per chunk both definitions agree.
- Throughput: totals over completed requests divided by the run duration (start of the
  timed run to the end of the last request).
- Goodput (DistServe): completed requests meeting every given SLO, per second.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from bench.records import RequestRecord

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
SLO_METRICS = ("ttft", "tpot", "e2e")


def percentile(values: Sequence[float], p: float) -> float:
    """numpy.percentile(values, p) with its default linear interpolation."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    rank = p / 100.0 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def describe(values: Sequence[float], percentiles: Iterable[float] = DEFAULT_PERCENTILES,
             scale: float = 1.0) -> dict[str, Any]:
    """count, mean, std (population, like numpy), min, max and pNN, each times `scale`."""
    pcts = list(percentiles)
    out: dict[str, Any] = {"count": len(values)}
    if not values:
        out.update({k: None for k in ("mean", "std", "min", "max")})
        out.update({_pkey(p): None for p in pcts})
        return out
    mean = math.fsum(values) / len(values)
    var = math.fsum((v - mean) ** 2 for v in values) / len(values)
    out.update(mean=mean * scale, std=math.sqrt(var) * scale,
               min=min(values) * scale, max=max(values) * scale)
    out.update({_pkey(p): percentile(values, p) * scale for p in pcts})
    return out


def _pkey(p: float) -> str:
    return f"p{p:g}".replace(".", "_")


def tpot(rec: RequestRecord) -> float | None:
    if rec.ttft is None or rec.e2e is None or rec.output_tokens <= 1:
        return None
    return (rec.e2e - rec.ttft) / (rec.output_tokens - 1)


def itl_samples(rec: RequestRecord) -> list[float]:
    """Per-token inter-token gaps of one completed request (see module docstring)."""
    if not rec.ok or not rec.chunk_times:
        return []
    tokens = rec.chunk_tokens or [1] * len(rec.chunk_times)
    samples = [0.0] * max(tokens[0] - 1, 0)
    for prev, cur, k in zip(rec.chunk_times, rec.chunk_times[1:], tokens[1:]):
        k = max(k, 1)
        samples.extend([(cur - prev) / k] * k)
    return samples


def meets_slo(rec: RequestRecord, slo_ms: dict[str, float]) -> bool:
    """True when a completed request meets every SLO; a 1-token output meets any TPOT SLO."""
    if not rec.ok:
        return False
    values = {"ttft": rec.ttft, "tpot": tpot(rec) or 0.0, "e2e": rec.e2e}
    for name, limit_ms in slo_ms.items():
        value = values[name]
        if value is None or value * 1000.0 > limit_ms:
            return False
    return True


def run_duration(records: Sequence[RequestRecord]) -> float:
    """Seconds from the start of the timed run (offset 0) to the end of its last request."""
    return max((r.end for r in records), default=0.0)


def failure_reasons(records: Iterable[RequestRecord]) -> dict[str, dict[str, Any]]:
    """Failures grouped by kind (the error text before its first ':'), with one example."""
    out: dict[str, dict[str, Any]] = {}
    for rec in records:
        if rec.ok:
            continue
        kind = rec.error.split(":", 1)[0].strip() or "error"
        entry = out.setdefault(kind, {"count": 0, "example": rec.error})
        entry["count"] += 1
    return out


def latency_series(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Per-metric samples (seconds) of the completed requests: ttft, tpot, itl, e2e
    and client_queue (scheduled -> sent, the client's own lateness)."""
    done = [r for r in records if r.ok]
    return {
        "ttft": [r.ttft for r in done],
        "tpot": [t for t in map(tpot, done) if t is not None],
        "itl": [s for r in done for s in itl_samples(r)],
        "e2e": [r.e2e for r in done],
        "client_queue": [r.sent - r.scheduled for r in done],
    }


def latency_stats(records: Sequence[RequestRecord], percentiles: Iterable[float]
                  ) -> dict[str, dict[str, Any]]:
    pcts = list(percentiles)
    return {name: describe(vals, pcts, scale=1000.0) for name, vals in latency_series(records).items()}


def token_stats(records: Sequence[RequestRecord]) -> dict[str, Any]:
    done = [r for r in records if r.ok]
    sources: dict[str, int] = {}
    for r in done:
        sources[r.output_tokens_source] = sources.get(r.output_tokens_source, 0) + 1
    return {
        "input": sum(r.input_tokens for r in done),
        "output": sum(r.output_tokens for r in done),
        "expected_output": sum(r.expected_output_tokens for r in done),
        "output_len_mismatches": sum(
            1 for r in done if r.expected_output_tokens and r.output_tokens
            != r.expected_output_tokens),
        "output_tokens_source": sources,
    }


def summarize(records: Sequence[RequestRecord], slo_ms: dict[str, float] | None = None,
              percentiles: Iterable[float] = DEFAULT_PERCENTILES,
              duration: float | None = None) -> dict[str, Any]:
    """All metrics of one run: throughput and latency reported separately."""
    pcts = list(percentiles)
    dur = run_duration(records) if duration is None else duration
    done = [r for r in records if r.ok]
    tokens = token_stats(records)
    per_s = (lambda x: x / dur) if dur > 0 else (lambda x: 0.0)
    summary: dict[str, Any] = {
        "requests": {"total": len(records), "completed": len(done),
                     "failed": len(records) - len(done)},
        "duration_s": dur,
        "throughput": {
            "requests_per_s": per_s(len(done)),
            "input_tokens_per_s": per_s(tokens["input"]),
            "output_tokens_per_s": per_s(tokens["output"]),
            "total_tokens_per_s": per_s(tokens["input"] + tokens["output"]),
        },
        "mean_concurrency": per_s(math.fsum(r.finished for r in records)),
        "tokens": tokens,
        "latency_ms": latency_stats(records, pcts),
        "goodput": None,
        "failures": failure_reasons(records),
    }
    if slo_ms:
        summary["goodput"] = goodput(records, slo_ms, dur)
    return summary


def goodput(records: Sequence[RequestRecord], slo_ms: dict[str, float],
            duration: float) -> dict[str, Any]:
    unknown = set(slo_ms) - set(SLO_METRICS)
    if unknown:
        raise ValueError(f"unknown SLO metric(s) {sorted(unknown)}; use {SLO_METRICS}")
    good = sum(1 for r in records if meets_slo(r, slo_ms))
    return {
        "slo_ms": dict(slo_ms),
        "good_requests": good,
        "requests_per_s": good / duration if duration > 0 else 0.0,
        "attainment": good / len(records) if records else 0.0,
    }


def by_category(records: Sequence[RequestRecord]) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = {}
    for rec in records:
        groups.setdefault(rec.category, []).append(rec)
    return groups
