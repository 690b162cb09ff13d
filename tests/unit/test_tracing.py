"""worker_runtime/tracing.py: spans exported over OTLP/HTTP to a receiver in this
process, parented under a W3C traceparent, carried on as gRPC metadata; off, a no-op."""

from __future__ import annotations

import time

import pytest

from tests.harness.otlp import OTLPReceiver
from worker_runtime import tracing

pytestmark = pytest.mark.unit

TRACE, PARENT = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


def test_off_every_call_is_a_no_op():
    assert not tracing.enabled()
    assert tracing.parent_from({"traceparent": f"00-{TRACE}-{PARENT}-01"}) is None
    assert tracing.start("x", None) is None and tracing.metadata(None) == ()
    tracing.phase("y", None, 0.0, 1.0)
    tracing.end(None)


def test_spans_reach_the_receiver_under_the_callers_span_and_travel_as_metadata():
    rx = OTLPReceiver()
    tracing.configure("tandem-test", rx.url)
    try:
        assert tracing.parent_from([("x-other", "1")], required=True) is None  # an untraced call
        parent = tracing.parent_from({"Traceparent": f"00-{TRACE}-{PARENT}-01"})
        t0 = time.monotonic()
        root = tracing.start("request", parent, t0, tracing.SERVER, {"tandem.prompt_tokens": 7})
        carried = dict(tracing.metadata(tracing.context_of(root)))
        assert carried["traceparent"].startswith(f"00-{TRACE}-")
        # the next process: its parent from the metadata
        child = tracing.start("prefill", tracing.parent_from(list(carried.items()), required=True))
        tracing.phase("kv_transfer", child, t0 + 0.001, t0 + 0.002, {"tandem.kv_bytes": 4096})
        tracing.end(child, error="boom")
        tracing.end(root, t0 + 0.003)
    finally:
        tracing.shutdown()
    try:
        spans = rx.trace(TRACE, {"request", "prefill", "kv_transfer"}, timeout_s=10)
        assert spans["request"].parent_id == PARENT and spans["request"].service == "tandem-test"
        assert spans["prefill"].parent_id == spans["request"].span_id
        assert spans["kv_transfer"].parent_id == spans["prefill"].span_id
        assert spans["kv_transfer"].end_ns - spans["kv_transfer"].start_ns == pytest.approx(1e6, abs=1e3)
        assert spans["request"].attributes["tandem.prompt_tokens"] == 7
        assert spans["prefill"].error and not spans["request"].error
    finally:
        rx.close()
    assert not tracing.enabled()
