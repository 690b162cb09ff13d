"""Every metric on synthetic timelines with answers worked out by hand."""
from __future__ import annotations

import numpy as np
import pytest

from bench.metrics import describe, goodput, itl_samples, meets_slo, percentile, run_duration, summarize, tpot
from bench.records import RequestRecord

pytestmark = pytest.mark.unit


def rec(index, sent, times, tokens=None, out=None, inp=10, error=None, finished=None,
        scheduled=None):
    tokens = tokens or [1] * len(times)
    return RequestRecord(
        index=index, scheduled=sent if scheduled is None else scheduled, sent=sent,
        chunk_times=list(times), chunk_tokens=list(tokens),
        finished=finished if finished is not None else (times[-1] if times else 0.5),
        input_tokens=inp, output_tokens=sum(tokens) if out is None else out,
        expected_output_tokens=sum(tokens), error=error)


# A: 4 single-token chunks.  B: one token.  C: failed.  D: 2 chunks carrying 2 + 3 tokens.
A = rec(0, 0.0, [0.1, 0.3, 0.6, 1.0], inp=10)
B = rec(1, 0.5, [0.2], inp=20, scheduled=0.4)
C = rec(2, 1.0, [], inp=30, error="http_500: boom", finished=0.5)
D = rec(3, 0.9, [0.5, 1.1], tokens=[2, 3], inp=40)
RUN = [A, B, C, D]


def test_percentile_linear_interpolation_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    rng = np.random.default_rng(1)
    data = rng.lognormal(size=101).tolist()
    for p in (1, 25, 50, 90, 99, 99.9):
        assert percentile(data, p) == pytest.approx(float(np.percentile(data, p)))
    with pytest.raises(ValueError):
        percentile([], 50)


def test_describe_empty_and_values():
    d = describe([1.0, 2.0, 3.0, 4.0], (50, 99), scale=1000)
    assert d["count"] == 4 and d["mean"] == 2500 and d["p50"] == 2500 and d["p99"] == pytest.approx(3970)
    assert d["std"] == pytest.approx(1000 * np.std([1, 2, 3, 4]))
    assert d["min"] == 1000 and d["max"] == 4000
    empty = describe([], (50, 99.9))
    assert empty["count"] == 0 and empty["mean"] is None and empty["p99_9"] is None


def test_ttft_e2e_tpot_per_request():
    assert (A.ttft, A.e2e) == (0.1, 1.0)
    assert tpot(A) == pytest.approx(0.3)          # (1.0 - 0.1) / (4 - 1)
    assert tpot(D) == pytest.approx(0.15)         # (1.1 - 0.5) / (5 - 1)
    assert tpot(B) is None                        # 1-token output: no TPOT
    assert C.ttft is None and C.e2e is None and tpot(C) is None


def test_tpot_uses_server_count_when_chunks_disagree():
    r = rec(0, 0.0, [0.1, 0.5], out=5)            # 2 chunks, usage says 5 tokens
    assert tpot(r) == pytest.approx(0.1)
    assert rec(0, 0.0, [0.1, 0.5], out=1).output_tokens == 1 and tpot(
        rec(0, 0.0, [0.1, 0.5], out=1)) is None


def test_itl_splits_multi_token_chunks():
    assert itl_samples(A) == pytest.approx([0.2, 0.3, 0.4])
    # D: the 2nd token of the first chunk arrived with it (gap 0); the 0.6 s gap before
    # the 3-token chunk is split into three gaps of 0.2 s.
    assert itl_samples(D) == pytest.approx([0.0, 0.2, 0.2, 0.2])
    assert itl_samples(B) == [] and itl_samples(C) == []
    for r in (A, D):  # invariants: output_tokens - 1 samples summing to E2E - TTFT
        assert len(itl_samples(r)) == r.output_tokens - 1
        assert sum(itl_samples(r)) == pytest.approx(r.e2e - r.ttft)


def test_run_duration_is_end_of_last_request():
    assert run_duration(RUN) == pytest.approx(2.0)    # D: sent 0.9 + 1.1
    assert run_duration([]) == 0.0


def test_goodput_requires_every_slo():
    # ttft 600 / tpot 300: A (100 ms, 300 ms: boundary meets), B (1 token), D; C failed.
    gp = goodput(RUN, {"ttft": 600, "tpot": 300}, duration=2.0)
    assert gp["good_requests"] == 3 and gp["requests_per_s"] == 1.5
    assert gp["attainment"] == 0.75
    # ttft 250 / tpot 250: A misses TPOT (300), D misses TTFT (500); B meets both.
    assert goodput(RUN, {"ttft": 250, "tpot": 250}, 2.0)["good_requests"] == 1
    assert meets_slo(B, {"tpot": 0.001})           # a 1-token output meets any TPOT SLO
    assert not meets_slo(C, {"ttft": 1e9})
    assert meets_slo(A, {"e2e": 1000}) and not meets_slo(A, {"e2e": 999})
    with pytest.raises(ValueError):
        goodput(RUN, {"itl": 5}, 1.0)


def test_summary_throughput_and_latency():
    s = summarize(RUN, {"ttft": 600, "tpot": 300})
    assert s["duration_s"] == pytest.approx(2.0)
    assert s["requests"] == {"total": 4, "completed": 3, "failed": 1}
    t = s["throughput"]
    assert t["requests_per_s"] == pytest.approx(1.5)
    assert t["output_tokens_per_s"] == pytest.approx(5.0)   # (4 + 1 + 5) / 2
    assert t["input_tokens_per_s"] == pytest.approx(35.0)   # (10 + 20 + 40) / 2, not C
    assert t["total_tokens_per_s"] == pytest.approx(40.0)
    lat = s["latency_ms"]
    assert lat["ttft"]["mean"] == pytest.approx(800 / 3)    # 100, 200, 500
    assert lat["ttft"]["p50"] == pytest.approx(200)
    assert lat["ttft"]["p90"] == pytest.approx(440)
    assert lat["ttft"]["p99"] == pytest.approx(494)
    assert lat["tpot"]["count"] == 2 and lat["tpot"]["mean"] == pytest.approx(225)
    assert lat["itl"]["count"] == 7 and lat["itl"]["mean"] == pytest.approx(1500 / 7)
    assert lat["e2e"]["max"] == pytest.approx(1100)
    assert lat["client_queue"]["max"] == pytest.approx(100)  # B: scheduled 0.4, sent 0.5
    assert s["goodput"]["good_requests"] == 3
    assert s["failures"] == {"http_500": {"count": 1, "example": "http_500: boom"}}
    assert s["mean_concurrency"] == pytest.approx(1.4)       # (1.0 + 0.2 + 0.5 + 1.1) / 2
    assert s["tokens"]["output_tokens_source"] == {"chunks": 3}


def test_summary_given_duration_and_no_slo():
    s = summarize(RUN, duration=4.0)
    assert s["throughput"]["requests_per_s"] == pytest.approx(0.75)
    assert s["goodput"] is None


def test_summary_of_all_failed_run_has_no_latency():
    s = summarize([C])
    assert s["requests"]["completed"] == 0
    assert s["latency_ms"]["ttft"]["count"] == 0 and s["latency_ms"]["ttft"]["p99"] is None
    assert s["throughput"]["requests_per_s"] == 0.0


def test_output_length_mismatch_is_counted():
    short = rec(0, 0.0, [0.1, 0.2])
    short.expected_output_tokens = 4
    assert summarize([A, short])["tokens"]["output_len_mismatches"] == 1


def test_record_roundtrip():
    assert RequestRecord.from_dict(D.to_dict()) == D
