"""An OTLP/HTTP trace receiver in the test process (what an OpenTelemetry collector's
otlphttp receiver does for traces: POST /v1/traces, a protobuf ExportTraceServiceRequest,
decoded with OpenTelemetry's own proto classes). It keeps every span with its service."""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict
    error: bool


class OTLPReceiver:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._add(ExportTraceServiceRequest.FromString(body))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _add(self, req: ExportTraceServiceRequest) -> None:
        got = []
        for rs in req.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in s.attributes}
                    got.append(Span(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                    s.start_time_unix_nano, s.end_time_unix_nano, attrs, s.status.code == 2))
        with self._lock:
            self.spans.extend(got)

    def trace(self, trace_id: str, names: set[str], timeout_s: float = 30.0) -> dict[str, Span]:
        """The spans of one trace by name, once every name in `names` arrived (bounded)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = {s.name: s for s in self.spans if s.trace_id == trace_id}
            if names <= set(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.2)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
