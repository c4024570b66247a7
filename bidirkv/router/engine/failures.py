"""How a leg fails and what the client is told: the upstream failure kinds, how a client
error reads (the legs' own client, connection.py, or aiohttp's for probes and the rest),
and the answers a failed or impossible leg gives."""

from __future__ import annotations

import math

import aiohttp
from aiohttp import web

from bidirkv.router.engine.connection import (
    ConnectError,
    ConnectTimeout,
    Disconnected,
    EngineHTTPError,
    ProtocolError,
)
from bidirkv.router.pool.backends import Backend
from bidirkv.router.request.replies import json_error, json_response
from bidirkv.router.request.validation import error_body


class UpstreamFailure(Exception):
    """A leg that did not deliver. kind: connect | status | timeout | protocol."""

    def __init__(self, leg: str, backend: Backend, kind: str, status: int | None = None,
                 body: bytes = b"", detail: str = "") -> None:
        super().__init__(f"{leg} {backend.url}: {kind} {status or ''} {detail}".strip())
        self.leg = leg
        self.backend = backend
        self.kind = kind
        self.status = status
        self.body = body
        self.detail = detail

    @property
    def client_error(self) -> bool:
        return self.kind == "status" and self.status is not None and 400 <= self.status < 500

    @property
    def result(self) -> str:
        """The leg's result as its span records it."""
        return "upstream_client_error" if self.client_error else self.kind

    @property
    def backend_down(self) -> bool:
        return self.kind == "connect" or (
            self.kind == "status" and self.status is not None and self.status >= 500
        )


def classify(exc: BaseException) -> tuple[str, str]:
    """(kind, detail) of a client failure: connect (the connection could not be opened
    or was lost), timeout, or protocol (an answer that is not HTTP as the legs read it)."""
    if isinstance(exc, ConnectTimeout | aiohttp.ConnectionTimeoutError):
        return "connect", "connect timeout"
    if isinstance(exc, ProtocolError):
        return "protocol", str(exc)
    if isinstance(exc, ConnectError):
        cause = exc.__cause__
        return "connect", type(cause).__name__ if cause is not None else "connect failed"
    if isinstance(exc, Disconnected):
        return "connect", "disconnected"
    if isinstance(exc, TimeoutError):
        return "timeout", "timed out"
    return "connect", type(exc).__name__


UPSTREAM_FAILURES = (EngineHTTPError, aiohttp.ClientError, TimeoutError, OSError)


def stale_connection(exc: BaseException) -> bool:
    """True for how a request fails on a kept-alive connection the engine had already
    closed: the connection, one that had carried a request before, lost before any of
    the answer. A failed connect is never one (that is a new connection, and the engine
    is not listening)."""
    return isinstance(exc, Disconnected) and exc.before_head and exc.reused


def unavailable(role: str, health_interval_s: float) -> web.Response:
    """503 for a pool with no healthy engine, retried after one health round."""
    retry = str(max(1, math.ceil(health_interval_s)))
    return json_error(503, f"no healthy {role} engine; retry later", "service_unavailable",
                      headers={"Retry-After": retry})


def failure_response(f: UpstreamFailure, rid: str) -> web.Response:
    if f.kind == "timeout":
        return json_error(504, f"{f.leg} engine timed out (request {rid})", "upstream_timeout")
    what = f"HTTP {f.status}" if f.kind == "status" else f.kind
    return json_error(502, f"{f.leg} engine failed: {what} (request {rid})", "upstream_error")


def outcome_of(f: UpstreamFailure) -> str:
    return "timeout" if f.kind == "timeout" else "upstream_error"


def rejected(f: UpstreamFailure) -> web.Response:
    """An engine's 4xx, returned to the client as it came."""
    return json_response(f.status or 400, f.body or error_body(
        f"{f.leg} engine rejected the request: HTTP {f.status}", "invalid_request_error"))
