"""OpenTelemetry traces of a request across the router and the workers (vLLM's
`--otlp-traces-endpoint`), exported over OTLP/HTTP (protobuf) by OpenTelemetry's SDK.

The router takes a W3C `traceparent` header from the client (or starts a trace) and
carries the context to the workers in gRPC metadata (the same `traceparent` header), so
one request's spans, made in three processes, form one tree:

    request (router, per engine request; parent: the client's span)
    ├─ queue            the router's admission queue
    ├─ remote_prefill   the Prefill call, as the router sees it
    │  └─ prefill       (prefill worker) the call: queued, computed, KV written
    │     └─ kv_transfer  (prefill worker) the last KV write issued to written
    ├─ decode_engine    (decode worker) the Decode call: reservation or admission to finish
    └─ decode           first token to last, as the router saw them

Spans that cover phases measured as they happened (the queue, the decode, the KV write)
are made afterwards with the measured start and end times. Off (no endpoint): every
call here is a cheap no-op, and nothing is imported from the SDK.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
SERVER, CLIENT = trace.SpanKind.SERVER, trace.SpanKind.CLIENT
_tracer: trace.Tracer | None = None  # None: tracing is off in this process
_provider = None


def configure(service: str, endpoint: str | None) -> None:
    """Export this process's spans to `endpoint` (an OTLP/HTTP collector: its base URL,
    such as http://collector:4318, or the full .../v1/traces), as `service`."""
    global _tracer, _provider
    if not endpoint:
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
    _provider = TracerProvider(resource=Resource.create({"service.name": service}))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url, timeout=5.0),
                                                    schedule_delay_millis=500, export_timeout_millis=5000))
    _tracer = _provider.get_tracer("tandem")
    log.info("traces: OTLP/HTTP to %s as %s", url, service)


def enabled() -> bool:
    return _tracer is not None


def shutdown(timeout_s: float = 5.0) -> None:
    """Send what is buffered (bounded) and stop."""
    global _tracer
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))
        _provider.shutdown()
    _tracer = None


def parent_from(headers: Mapping[str, str] | Iterable[tuple[str, str]], required: bool = False) -> Context | None:
    """The trace context in W3C headers (an HTTP request's, or gRPC metadata); without
    one, an empty context (a new trace), or None when `required` (a worker call that is
    not traced); None when tracing is off."""
    if _tracer is None:
        return None
    carrier = {k.lower(): v for k, v in (headers.items() if isinstance(headers, Mapping) else headers)}
    if required and "traceparent" not in carrier:
        return None
    return _PROPAGATOR.extract(carrier)


def metadata(ctx: Context | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying `ctx` (empty without one)."""
    if ctx is None or _tracer is None:
        return ()
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return tuple(carrier.items())


# wall clock minus the monotonic one, read once: every span of this process converts its
# monotonic readings with the same offset, so their order is the order they were read in
_WALL_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as the wall-clock nanoseconds spans carry."""
    return int(monotonic_s * 1e9) + _WALL_OFFSET_NS


def start(name: str, parent: Context | None, start_s: float | None = None, kind=trace.SpanKind.INTERNAL,
          attributes: dict | None = None):
    """A span under `parent` (None: tracing off or no parent: returns None), started at
    the monotonic time `start_s` (default now)."""
    if _tracer is None or parent is None:
        return None
    return _tracer.start_span(name, context=parent, kind=kind, attributes=attributes,
                              start_time=wall_ns(time.monotonic() if start_s is None else start_s))


def context_of(span) -> Context | None:
    return None if span is None else trace.set_span_in_context(span)


def end(span, end_s: float | None = None, error: str | None = None) -> None:
    if span is None:
        return
    if error:
        span.set_status(trace.Status(trace.StatusCode.ERROR, error))
    span.end(end_time=wall_ns(time.monotonic() if end_s is None else end_s))


def phase(name: str, parent_span, start_s: float, end_s: float, attributes: dict | None = None) -> None:
    """A finished span for a phase measured as it happened (monotonic start and end)."""
    if parent_span is None:
        return
    end(start(name, context_of(parent_span), start_s, attributes=attributes), end_s)
