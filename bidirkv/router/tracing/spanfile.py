"""Spans as JSON lines in a file: traces on a machine without a collector (the local
stack, `make demo`).

One finished span per line, in the shape of OTLP/JSON's span with its resource folded in
(ids in hex, times in unix nanoseconds, attributes as a plain object):

    {"traceId": "<32 hex>", "spanId": "<16 hex>", "parentSpanId": "<16 hex>" or "",
     "name": "POST /v1/chat/completions", "kind": "SPAN_KIND_SERVER",
     "startTimeUnixNano": 1700000000000000000, "endTimeUnixNano": ...,
     "attributes": {...}, "status": {"code": "STATUS_CODE_UNSET", "message": ""},
     "events": [{"name": ..., "timeUnixNano": ..., "attributes": {...}}],
     "resource": {"service.name": "bidir-kv-router", ...}, "scope": "bidirkv.router"}

It runs in the SDK's export thread (BatchSpanProcessor), never on the event loop. The file
is appended to and never rotated: it is meant for a stack that lives minutes.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from bidirkv.router.codec import dumps
from bidirkv.router.config import ConfigError

log = logging.getLogger("bidirkv.router")


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def span_record(span: ReadableSpan, resource: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """One span as the line the file holds; `resource`: its resource's attributes, when
    the caller has them already (one resource for every span of a router)."""
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "traceId": _hex(ctx.trace_id, 32) if ctx is not None else "",
        "spanId": _hex(ctx.span_id, 16) if ctx is not None else "",
        "parentSpanId": _hex(parent.span_id, 16) if parent is not None else "",
        "name": span.name,
        "kind": "SPAN_KIND_" + span.kind.name,
        "startTimeUnixNano": span.start_time,
        "endTimeUnixNano": span.end_time,
        "attributes": dict(span.attributes or {}),
        "status": {"code": "STATUS_CODE_" + span.status.status_code.name,
                   "message": span.status.description or ""},
        "events": [{"name": e.name, "timeUnixNano": e.timestamp,
                    "attributes": dict(e.attributes or {})} for e in span.events],
        "resource": resource if resource is not None else dict(span.resource.attributes),
        "scope": span.instrumentation_scope.name if span.instrumentation_scope else "",
    }


def span_line(span: ReadableSpan, resource: dict[str, Any] | None = None) -> bytes:
    record = span_record(span, resource)
    try:
        return dumps(record) + b"\n"
    except TypeError:
        # An attribute value the SDK accepts and JSON has no type for (bytes): written as
        # text rather than losing the whole batch.
        return json.dumps(record, separators=(",", ":"), default=str).encode() + b"\n"


class SpanFileExporter(SpanExporter):
    """Appends each batch of spans to `path`, one JSON object a line."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            # Opened once, at start: a path the router cannot write fails the start (or
            # the reload), not every export later.
            self._file = open(path, "ab")
        except OSError as exc:
            raise ConfigError(f"tracing.file: cannot open {path!r} for appending: "
                              f"{exc.strerror or exc}") from None
        self._lock = threading.Lock()
        self._failed = False
        # id(resource) -> its attributes: a router's spans share one resource.
        self._resources: dict[int, dict[str, Any]] = {}

    def _resource(self, span: ReadableSpan) -> dict[str, Any]:
        key = id(span.resource)
        found = self._resources.get(key)
        if found is None:
            found = self._resources[key] = dict(span.resource.attributes)
        return found

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        text = b"".join(span_line(s, self._resource(s)) for s in spans)
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            try:
                self._file.write(text)
                # Each batch reaches the OS whole: a reader (the demo) sees complete lines.
                self._file.flush()
            except OSError as exc:
                if not self._failed:  # once: a full disk must not flood the log
                    log.error("cannot write spans to %s: %s", self.path, exc.strerror or exc)
                    self._failed = True
                return SpanExportResult.FAILURE
        self._failed = False
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
