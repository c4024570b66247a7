"""The router's HTTP client sessions, and the one retry a stale kept-alive connection gets.

An engine closes idle keep-alive connections on its own clock, and a stalled one closes
a batch of them when it runs again: a request written to one fails before any response
head while the engine is fine, and taking the engine out would turn one stall into a
health-check interval of errors. So such a POST to P is sent once more to the same P on
a new (never pooled) connection, with the same X-Request-Id and body, handle included:
P admits a handle once (`replayed`), so at worst the retry is served without reuse. The
decode leg carries a single-use proof and keeps its own retry (datapath/flow.py).

`Clients` holds the legs' own clients (http.py) and an aiohttp session for everything
else (health probes, /v1/models, residency calls).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from bidirkv.router.codec import loads
from bidirkv.router.config import RouterConfig
from bidirkv.router.engine.bodies import upstream_headers
from bidirkv.router.engine.connection import Response
from bidirkv.router.engine.failures import (
    UPSTREAM_FAILURES,
    UpstreamFailure,
    classify,
    stale_connection,
)
from bidirkv.router.engine.http import KEEPALIVE_S, EngineHTTP
from bidirkv.router.metrics import Metrics
from bidirkv.router.pool.backends import Backend
from bidirkv.router.tracing.spans import UNTRACED, Leg

log = logging.getLogger("bidirkv.router")

STALE_RETRY = "prefill_stale_connection"


@dataclass(frozen=True)
class ClientTimeouts:
    """The client timeouts of one config (a reload swaps the whole set; a request in
    flight keeps the one it started with). The legs' client (http.py) reads
    `prefill` and `decode` as bounds on the connect (sock_connect), the whole exchange
    (total) and each wait for bytes (sock_read); aiohttp's session takes `probe`, and
    `prefill` for a client's GET /v1/models (datapath/flow.py)."""

    prefill: aiohttp.ClientTimeout
    decode: aiohttp.ClientTimeout
    probe: aiohttp.ClientTimeout


def client_timeouts(cfg: RouterConfig) -> ClientTimeouts:
    t = cfg.timeouts
    probe = max(1.0, min(5.0, cfg.health_check_interval_seconds))
    return ClientTimeouts(
        prefill=aiohttp.ClientTimeout(total=t.prefill_seconds, sock_connect=t.connect_seconds),
        decode=aiohttp.ClientTimeout(total=None, sock_connect=t.connect_seconds,
                                     sock_read=t.decode_seconds),
        probe=aiohttp.ClientTimeout(total=probe, sock_connect=t.connect_seconds),
    )


def open_session() -> aiohttp.ClientSession:
    """Keep-alive connections for the router's calls other than the legs."""
    # Idle connections are dropped before vLLM's server drops them (uvicorn's 5 s
    # keep-alive), so after an idle gap the first request does not meet a closed one.
    connector = aiohttp.TCPConnector(limit=4096, limit_per_host=0, ttl_dns_cache=10,
                                     keepalive_timeout=KEEPALIVE_S)
    return aiohttp.ClientSession(
        connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",),
        cookie_jar=aiohttp.DummyCookieJar(),
    )


class Clients:
    """The router's clients: the legs' POSTs (with the stale-connection retry, and the
    prefill leg's request) and a session for the rest."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.session: aiohttp.ClientSession | None = None
        self.engines: EngineHTTP | None = None

    def open(self) -> aiohttp.ClientSession:
        self.session, self.engines = open_session(), EngineHTTP()
        return self.session

    async def close(self) -> None:
        if self.engines is not None:
            self.engines.close()
        if self.session is not None:
            await self.session.close()

    @property
    def pooled(self) -> aiohttp.ClientSession:
        assert self.session is not None, "the router has not started"
        return self.session

    async def post(self, b: Backend, path: str, payload: bytes | Callable[[], bytes],
                   rid: str, auth: str | None, timeout: aiohttp.ClientTimeout,
                   retry_stale: bool = True, span: Leg = UNTRACED,
                   first_byte_s: float | None = None) -> Response:
        """The response, its head read; the caller closes it. A callable payload is built
        again for the stale-connection retry: the body carries a single-use proof, which
        the engine may have seen on the first attempt. `span`: the upstream request's
        span, whose context the request carries (the retry gets a span of its own).
        `timeout`: its sock_connect, total and sock_read bound the request;
        `first_byte_s`: TimeoutError unless the first bytes of a 200's body (an error
        answer whole) came within it, the retry included."""
        engines = self.engines
        assert engines is not None, "the router has not started"
        headers = upstream_headers(rid, auth, span.headers)
        first_at = None if first_byte_s is None else \
            asyncio.get_running_loop().time() + first_byte_s
        try:
            return await engines.post(b.url, path, payload() if callable(payload) else payload,
                                      headers, timeout, first_byte_at=first_at)
        except UPSTREAM_FAILURES as exc:
            if not retry_stale or not stale_connection(exc):
                raise
            self.metrics.retries.labels(STALE_RETRY).inc()
            log.info("kept-alive connection to %s failed before a response (%s); retrying "
                     "on a new connection rid=%s", b.url, classify(exc)[1], rid)
            span.resend("stale_connection")
            headers = upstream_headers(rid, auth, span.headers)
        return await engines.post(b.url, path, payload() if callable(payload) else payload,
                                  headers, timeout, fresh=True, first_byte_at=first_at)

    async def post_prefill(self, p: Backend, path: str,
                           payload: bytes | Callable[[], bytes], rid: str,
                           auth: str | None, timeout: aiohttp.ClientTimeout,
                           span: Leg = UNTRACED) -> dict[str, Any]:
        try:
            resp = await self.post(p, path, payload, rid, auth, timeout, span=span)
            async with resp:
                body = await resp.read()
                status = resp.status
        except UPSTREAM_FAILURES as exc:
            kind, detail = classify(exc)
            raise UpstreamFailure("prefill", p, kind, detail=detail) from None
        if status != 200:
            raise UpstreamFailure("prefill", p, "status", status, body, f"HTTP {status}")
        try:
            data = loads(body)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise UpstreamFailure("prefill", p, "protocol", detail="reply is not a JSON object")
        return data
