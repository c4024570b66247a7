"""An OTLP/HTTP traces receiver on 127.0.0.1 for the router's tests and the end-to-end
suites: what a collector would get from the router and from vLLM's own exporter
(`--otlp-traces-endpoint` with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf), decoded
with OpenTelemetry's protobuf classes."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

PATH = "/v1/traces"


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict


def _value(v) -> object:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def decode(body: bytes) -> list[Span]:
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    spans = []
    for rs in req.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(Span(
                    service=str(resource.get("service.name", "")), name=s.name,
                    trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(),
                    attributes={a.key: _value(a.value) for a in s.attributes}))
    return spans


class Receiver:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.content_types: list[str] = []  # of every export request
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != PATH:
                    self.send_response(404)
                    self.end_headers()
                    return
                spans = decode(body)
                with receiver._lock:
                    receiver.spans += spans
                    receiver.content_types.append(self.headers.get("Content-Type", ""))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{PATH}"

    def of_trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, services: set[str], timeout: float = 30.0) -> list[Span]:
        """The trace's spans once every service in `services` has sent one of it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = self.of_trace(trace_id)
            if services <= {s.service for s in spans}:
                return spans
            time.sleep(0.1)
        return self.of_trace(trace_id)


@contextmanager
def receiving() -> Iterator[Receiver]:
    r = Receiver()
    thread = threading.Thread(target=r.server.serve_forever, name="otlp", daemon=True)
    thread.start()
    try:
        yield r
    finally:
        r.server.shutdown()
        r.server.server_close()
        thread.join(10)
