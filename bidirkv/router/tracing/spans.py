"""Traces: a SERVER span per client request, a CLIENT span per upstream request (each
leg, each retry), and W3C trace context on every request to prefill and decode.
docs/observability.md says what each span holds and why the router, not the client,
decides what is sampled.

What a request gets is decided once, when it arrives (`Traces.request`): with an
exporter, spans are recorded by this router's own TracerProvider (never the global one:
several routers share a test process), sampled at `tracing.sampleRatio` by the router's
own draw, and an unsampled trace still carries its context upstream. Without one, a
client's valid `traceparent` goes on to both legs unchanged (a parent id of the router's
own would name a span no backend receives), and else nothing is added or allocated.
No prompt text, handle contents, tenant or credential goes into a span; a string a client
chose is cut to MAX_ATTRIBUTE_CHARS (the SDK's own limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.trace import (
    Span,
    SpanKind,
    Status,
    StatusCode,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from bidirkv.router.config import ConfigError, Tracing
from bidirkv.router.tracing.sampling import bounded, make_provider

log = logging.getLogger("bidirkv.router")

TRACEPARENT = "traceparent"
SCOPE = "bidirkv.router"
# Router close waits this long for the last spans to leave; an unreachable collector
# must not hold a pod's shutdown (the OTLP exporter retries for up to 10 s).
CLOSE_WAIT_S = 5.0
# Request outcomes (metrics.REQUEST_OUTCOMES) that are the router's or an engine's
# failure: the request span's status is ERROR for them, as for any 5xx.
FAILED_OUTCOMES = frozenset({"unavailable", "upstream_error", "timeout", "stream_error",
                             "internal_error"})
# Leg results that are not failures: a client leaving cancels its legs.
_LEG_OK = frozenset({"ok", "cancelled"})

_PROPAGATOR = TraceContextTextMapPropagator()


def passthrough(headers: Mapping[str, str]) -> Untraced:
    """The client's trace context as it came, for every upstream request (validated and
    written again by the propagator: a malformed `traceparent` is dropped)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=_PROPAGATOR.extract(headers))
    return Untraced(carrier) if carrier else UNTRACED


@functools.lru_cache(maxsize=1024)
def upstream_attributes(base_url: str, path: str) -> dict[str, Any]:
    """server.address, server.port and url.full of a request to `base_url` + `path`
    (without any userinfo the URL held)."""
    parts = urlsplit(base_url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    shown = f"[{host}]" if ":" in host else host
    return {"server.address": host, "server.port": port,
            "url.full": f"{parts.scheme}://{shown}:{port}{parts.path}{path}"}


class Untraced:
    """A request, and each of its upstream requests, with nothing recorded: `headers`
    is what every upstream request carries (the client's trace context, or None)."""

    __slots__ = ("headers",)
    recording = False

    def __init__(self, headers: dict[str, str] | None) -> None:
        self.headers = headers

    def leg(self, leg: str, url: str, path: str, method: str = "POST") -> Untraced:
        return self

    def set(self, key: str, value: Any) -> None:
        pass

    def resend(self, reason: str) -> None:
        pass

    def update(self, attrs: dict[str, Any]) -> None:
        pass

    def end(self, *_: Any) -> None:
        pass


UNTRACED = Untraced(None)


class RequestTrace:
    """The SERVER span of one client request; `leg` starts the span of an upstream
    request under it. Ended exactly once (`end`).

    Attributes learnt on the way are gathered here and handed to the span once, when it
    ends: each call into the SDK's span checks and locks, and it is per request."""

    __slots__ = ("traces", "span", "context", "recording", "attrs", "_attempts")

    def __init__(self, traces: Traces, span: Span) -> None:
        self.traces = traces
        self.span = span
        self.context = set_span_in_context(span)  # the parent of every leg
        self.recording = span.is_recording()
        self.attrs: dict[str, Any] = {}
        self._attempts: dict[str, int] = {}

    def leg(self, leg: str, url: str, path: str, method: str = "POST") -> LegTrace:
        """The span of one upstream request of `leg` (its name); a leg's retries are
        its attempts 1, 2, ... (`bidirkv.leg.attempt`, absent on the first: every
        attribute costs the SDK ~2 us to check)."""
        attempt = self._attempts.get(leg, 0)
        self._attempts[leg] = attempt + 1
        attrs = {"http.request.method": method, **upstream_attributes(url, path)}
        if attempt:
            attrs["bidirkv.leg.attempt"] = attempt
        return LegTrace(self, leg, attrs)

    def set(self, key: str, value: Any) -> None:
        if self.recording and value is not None:
            self.attrs[key] = bounded(value)

    def update(self, attrs: dict[str, Any]) -> None:
        """Attributes gathered elsewhere (what the request became), set as one."""
        if self.recording:
            self.attrs.update({k: bounded(v) for k, v in attrs.items()})

    def end(self, status: int | None = None, outcome: str = "ok") -> None:
        span = self.span
        if self.recording:
            attrs = self.attrs
            attrs["bidirkv.outcome"] = outcome
            if status is not None:
                attrs["http.response.status_code"] = status
            failed = status is not None and status >= 500
            if failed or outcome in FAILED_OUTCOMES:
                attrs["error.type"] = str(status) if failed else outcome
                span.set_status(Status(StatusCode.ERROR, outcome))
            span.set_attributes(attrs)
        span.end()
        self.traces.finished()


class LegTrace:
    """The CLIENT span of one upstream request and the trace context it carries."""

    __slots__ = ("request", "recording", "name", "attrs", "later", "span", "headers")

    def __init__(self, request: RequestTrace, name: str, attrs: dict[str, Any]) -> None:
        self.request = request
        self.recording = request.recording  # decided once, with the request's span
        self.name = name
        self.attrs = attrs  # known at the start: given to the span as it starts
        self.later: dict[str, Any] = {}  # learnt on the way: given to it as it ends
        self._start()

    def _start(self) -> None:
        tracer = self.request.traces.tracer
        assert tracer is not None
        self.span = tracer.start_span(self.name, self.request.context, SpanKind.CLIENT,
                                      self.attrs)
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=set_span_in_context(self.span))
        self.headers = carrier

    def set(self, key: str, value: Any) -> None:
        if value is not None and self.request.recording:
            self.later[key] = bounded(value)

    def resend(self, reason: str) -> None:
        """The same request sent again (a stale kept-alive connection): this span ends
        as `reason`, and a sibling with http.request.resend_count takes its place."""
        attrs = {**self.attrs, **self.later}
        attrs["http.request.resend_count"] = attrs.get("http.request.resend_count", 0) + 1
        self.end(reason)
        self.attrs, self.later = attrs, {}
        self._start()

    def end(self, result: str, status: int | None = None) -> None:
        span = self.span
        if self.request.recording:
            attrs = self.later
            attrs["bidirkv.leg.result"] = result
            if status is not None:
                attrs["http.response.status_code"] = status
            if result not in _LEG_OK:
                attrs["error.type"] = str(status) if status is not None and status >= 400 \
                    else result
                span.set_status(Status(StatusCode.ERROR, result))
            span.set_attributes(attrs)
        span.end()


# What a request (or one upstream request) gets; both kinds answer the same calls.
Trace = RequestTrace | Untraced
Leg = LegTrace | Untraced


class Traces:
    """One router's traces: its TracerProvider (None without an exporter) and the
    requests it has in flight, so that a provider replaced by a reload is shut down
    only once its last request has ended."""

    def __init__(self, cfg: Tracing) -> None:
        self.cfg = cfg
        self.provider = make_provider(cfg) if cfg.enabled else None
        self.tracer = self.provider.get_tracer(SCOPE) if self.provider is not None \
            else None
        self.active = 0
        self.retired = False
        self._closing = False
        self._closed = threading.Event()
        self._lock = threading.Lock()

    def request(self, method: str, route: str, headers: Mapping[str, str]) -> Trace:
        """The trace of a client request to `route` (its template: no conversation id
        in a span)."""
        tracer = self.tracer
        if tracer is None:
            return passthrough(headers) if TRACEPARENT in headers else UNTRACED
        parent = _PROPAGATOR.extract(headers) if TRACEPARENT in headers else None
        span = tracer.start_span(f"{method} {route}", parent, SpanKind.SERVER, {
            "http.request.method": method, "http.route": route, "url.path": route,
            "url.scheme": "http"})
        if not span.get_span_context().is_valid:  # the SDK disabled (OTEL_SDK_DISABLED)
            return passthrough(headers) if parent is not None else UNTRACED
        self.active += 1
        return RequestTrace(self, span)

    @property
    def shut_down(self) -> bool:
        """True once the provider has exported what it had and closed its exporters."""
        return self._closed.is_set()

    def finished(self) -> None:
        self.active -= 1
        if self.retired and self.active == 0:
            self._shutdown_in_background()

    def retire(self) -> None:
        """Replaced (a reload): shut down once no request of this provider is left."""
        self.retired = True
        if self.active == 0:
            self._shutdown_in_background()

    def _shutdown(self) -> None:
        if self.provider is None:
            return
        with self._lock:
            first, self._closing = not self._closing, True
        if not first:  # another thread is at it: done when it is
            self._closed.wait()
            return
        # Exports what is queued, then closes the exporters (blocking: never on the loop).
        try:
            self.provider.shutdown()
        finally:
            self._closed.set()

    def _shutdown_in_background(self) -> None:
        if self.provider is None:
            return
        threading.Thread(target=self._shutdown, name="bidirkv-traces-shutdown",
                         daemon=True).start()

    async def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Flush and shut down, waiting at most `wait_s` (the rest is given up)."""
        if self.provider is None:
            return
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def run() -> None:
            try:
                self._shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is gone already
                    loop.call_soon_threadsafe(done.set)

        # A thread of its own, not the loop's executor: asyncio's shutdown waits for the
        # executor's threads, so a stuck export would hold the process after all.
        threading.Thread(target=run, name="bidirkv-traces-close", daemon=True).start()
        try:
            await asyncio.wait_for(done.wait(), wait_s)
        except TimeoutError:
            log.warning("spans still being exported after %.0f s at shutdown; given up",
                        wait_s)


async def traced(trace: Trace, handler: Callable[[], Awaitable[tuple[Any, str]]]
                 ) -> tuple[Any, str]:
    """Run a route's handler, which returns (response, outcome), and end the request's
    span exactly once however it leaves: a client gone is `cancelled`, anything else
    raised is the 500 the middleware answers."""
    try:
        resp, outcome = await handler()
    except (asyncio.CancelledError, ConnectionError):  # the client went away
        trace.end(None, "cancelled")
        raise
    except BaseException:
        trace.end(500, "internal_error")
        raise
    trace.end(resp.status, outcome)
    return resp, outcome


def replace(current: Traces, cfg: Tracing) -> Traces:
    """The traces of a reloaded config: `current` when its settings are unchanged or the
    new ones cannot start (logged), else a new provider, `current` retired."""
    if cfg == current.cfg:
        return current
    try:
        new = Traces(cfg)
    except ConfigError as exc:
        log.error("tracing settings not applied, keeping the running ones: %s", exc)
        return current
    current.retire()
    log.info("tracing settings applied: %s", describe(cfg))
    return new


def describe(cfg: Tracing) -> str:
    if not cfg.enabled:
        return "no exporter (a client's traceparent is passed on)"
    where = [w for w in (cfg.otlp_endpoint, cfg.file and f"file {cfg.file}") if w]
    return f"spans to {' and '.join(where)}, sampled at {cfg.sample_ratio:g}"

