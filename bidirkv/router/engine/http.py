"""HTTP/1.1 for the legs: the POSTs the router sends an engine on every turn.

A general client does much more per request (header defaults, cookies, hooks, timeout
objects), and on a router that sends two legs a turn that was a third of its CPU. This
module is the pool and the request it writes (one `transport.write`); connection.py
carries the exchange and reads the answer (`Response`). A connection goes back to its
engine's pool only when its answer arrived whole, kept alive and nothing failed, and is
closed after KEEPALIVE_S idle, before the engine drops it (uvicorn after 5 s). Timeouts
are deadlines of the connection's one timer. Health probes and the router's other calls
keep the general client (clients.py).
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any
from urllib.parse import urlsplit

from bidirkv.router.engine.connection import (
    ConnectError,
    Connection,
    ConnectTimeout,
    Response,
)

KEEPALIVE_S = 4.0  # idle connections are closed after it


class Target:
    """An engine's base URL, split once: where to connect and what to send."""

    __slots__ = ("key", "host", "port", "ssl", "authority", "prefix")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine URL {url!r}: expected http(s)://host[:port][/path]")
        secure = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if secure else 80)
        self.key = (parts.scheme, self.host, self.port)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if secure else None
        self.authority = parts.netloc.rpartition("@")[2]
        self.prefix = parts.path.rstrip("/")


def request_head(target: Target, path: str, headers: dict[str, str], length: int) -> bytes:
    """The request line and headers of a POST; ValueError for a header that would split
    the head (CR or LF in its name or value)."""
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    if lines.count("\n") != len(headers) or lines.count("\r") != len(headers):
        bad = next(k for k, v in headers.items() if any(c in k + v for c in "\r\n"))
        raise ValueError(f"header {bad!r}: a name or value may not contain CR or LF")
    if any(c in path for c in "\r\n "):
        raise ValueError(f"path {path!r}: may not contain CR, LF or a space")
    return (f"POST {target.prefix}{path} HTTP/1.1\r\nHost: {target.authority}\r\n{lines}"
            f"Content-Length: {length}\r\n\r\n").encode("utf-8", "surrogateescape")


class EngineHTTP:
    """POSTs to engines over kept-alive connections, one pool per engine. A response
    read whole puts its connection back on its engine's idle list itself (connection.py);
    the sweeper, scheduled while any connection is open, closes those idle too long."""

    def __init__(self) -> None:
        self._targets: dict[str, Target] = {}
        # Lists are never dropped: each connection holds its engine's.
        self._idle: dict[tuple[str, str, int], list[Connection]] = {}
        self._conns: set[Connection] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    async def post(self, url: str, path: str, body: bytes, headers: dict[str, str],
                   timeout: Any, fresh: bool = False,
                   first_byte_at: float | None = None) -> Response:
        """POST `body` to `url` + `path`; the response once its head has arrived.
        `timeout`: its `sock_connect`, `total` and `sock_read` (seconds or None) bound
        the connect, the whole exchange and each wait for bytes. `fresh`: on a new
        connection, never a pooled one. `first_byte_at` (loop time): TimeoutError
        unless the first bytes of a 200's body (an error answer whole) have come by
        then, the connect included."""
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = Target(url)
        request = request_head(target, path, headers, len(body)) + body
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadline = None if timeout.total is None else now + timeout.total
        conn = None if fresh else self._pooled(target.key, now)
        if conn is None:
            conn = await self._connect(loop, target, timeout.sock_connect, first_byte_at)
        return await conn.exchange(request, deadline, timeout.sock_read, first_byte_at)

    async def _connect(self, loop: asyncio.AbstractEventLoop, target: Target,
                       connect_s: float | None, first_byte_at: float | None) -> Connection:
        """A new connection; ConnectTimeout past `connect_s`, TimeoutError past
        `first_byte_at` when that comes first (a first-byte timeout, as once connected)."""
        if self._closed:
            raise ConnectError("the client is closed")
        conn = Connection(loop, self._idle.setdefault(target.key, []), self._conns.discard)
        at = None if connect_s is None else loop.time() + connect_s
        first = first_byte_at is not None and (at is None or first_byte_at < at)
        try:
            async with asyncio.timeout_at(first_byte_at if first else at):
                await loop.create_connection(
                    lambda: conn, target.host, target.port, ssl=target.ssl,
                    server_hostname=target.host if target.ssl else None)
        except TimeoutError:
            conn.abort()
            if first:
                raise
            raise ConnectTimeout(f"no connection to {target.authority} within "
                                 f"{connect_s} s") from None
        except OSError as exc:
            raise ConnectError(f"{target.authority}: {type(exc).__name__}: {exc}") from exc
        if self._closed:  # closed while connecting: nothing may go back to its pool
            conn.abort()
            raise ConnectError("the client is closed")
        if not conn.open:  # the engine spoke first, or hung up: no request may wait on it
            raise ConnectError(f"{target.authority}: closed as it connected")
        self._conns.add(conn)
        if self._sweeper is None:
            self._sweeper = loop.call_later(KEEPALIVE_S, self._sweep, loop)
        return conn

    def _pooled(self, key: tuple[str, str, int], now: float) -> Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()  # the most recent: the least likely to be dropped
            if conn.open and now - conn.idle_since < KEEPALIVE_S:
                return conn
            conn.abort()
        return None

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the connections idle for KEEPALIVE_S (an engine that gets no more
        requests would otherwise keep them until it drops them itself); come back when
        the oldest idle one would be, or after KEEPALIVE_S while any is in use (it may
        go idle meanwhile)."""
        self._sweeper = None
        now = loop.time()
        oldest = None
        for idle in self._idle.values():
            kept = []
            for conn in idle:
                if conn.open and now - conn.idle_since < KEEPALIVE_S:
                    kept.append(conn)
                    oldest = conn.idle_since if oldest is None else min(oldest, conn.idle_since)
                else:
                    conn.abort()
            idle[:] = kept
        if oldest is not None:
            self._sweeper = loop.call_at(oldest + KEEPALIVE_S, self._sweep, loop)
        elif self._conns:
            self._sweeper = loop.call_at(now + KEEPALIVE_S, self._sweep, loop)

    def close(self) -> None:
        """Close every connection, in use or idle."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for idle in self._idle.values():
            idle.clear()
        for conn in list(self._conns):
            conn.abort()
