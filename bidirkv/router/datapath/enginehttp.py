"""HTTP/1.1 for the legs: the POSTs the router sends an engine on every turn.

The legs need little of HTTP: one POST with a JSON body, an answer read whole (prefill)
or relayed as it streams (decode), kept-alive connections. A general client does much
more on every request (header defaults, cookies, tracing hooks, timeout objects), and on
a router that sends two legs a turn that was a third of its CPU. This one does what the
legs need (engineconn.py reads and writes the bytes):

- one `transport.write` a request, head and body;
- one pool of idle connections per engine: a connection goes back only when its answer
  arrived whole, HTTP/1.1 without `Connection: close`, and nothing failed; it is closed
  after KEEPALIVE_S idle, before an engine drops it on its own clock (uvicorn after 5 s).
  An answer closed early (the client left, a failure, a cancellation) closes its
  connection;
- timeouts: the connect, the whole exchange (from the request to the end of its answer)
  and each wait for the next bytes.

Health probes and the router's other calls keep the general client (sessions.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

from bidirkv.router.datapath.engineconn import (
    DONE,
    HEAD,
    KEEPALIVE_S,
    ConnectError,
    Connection,
    ConnectTimeout,
    Target,
    request_head,
)


class Response:
    """An engine's answer: its status, its body read whole or as it comes. Close it (or
    use `async with`): an answer read to its end gives its connection back to the pool,
    any other closes it."""

    __slots__ = ("status", "reused", "_conn", "_client")

    def __init__(self, conn: Connection, client: EngineHTTP, reused: bool) -> None:
        self.status = conn.status
        self.reused = reused
        self._conn: Connection | None = conn
        self._client = client

    async def readany(self) -> bytes:
        """What has arrived (waiting for some when nothing has); b"" at the end."""
        conn = self._conn
        while conn is not None:
            if conn.chunks:
                return conn.take()
            if conn.error is not None:
                raise conn.error
            if conn.stage == DONE:
                self.close()
                break
            await conn.wait()
        return b""

    async def read(self) -> bytes:
        parts = []
        while data := await self.readany():
            parts.append(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._client.release(conn)

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class EngineHTTP:
    """POSTs to engines over kept-alive connections, one pool per engine."""

    def __init__(self) -> None:
        self._targets: dict[str, Target] = {}
        self._idle: dict[tuple[str, str, int], list[Connection]] = {}
        self._conns: set[Connection] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    async def post(self, url: str, path: str, body: bytes, headers: dict[str, str],
                   timeout: Any, fresh: bool = False) -> Response:
        """POST `body` to `url` + `path`; the response once its head has arrived.
        `timeout`: its `sock_connect`, `total` and `sock_read` (seconds or None) bound
        the connect, the whole exchange and each wait for bytes. `fresh`: on a new
        connection, never a pooled one."""
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = Target(url)
        data = request_head(target, path, headers, len(body)) + body
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadline = None if timeout.total is None else now + timeout.total
        conn = None if fresh else self._pooled(target.key, now)
        if conn is None:
            conn = await self._connect(loop, target, timeout.sock_connect)
        reused = conn.send(data, deadline, timeout.sock_read)
        while conn.stage == HEAD and conn.error is None:
            await conn.wait()
        if conn.error is not None:
            conn.abort()
            raise conn.error
        return Response(conn, self, reused)

    async def _connect(self, loop: asyncio.AbstractEventLoop, target: Target,
                       connect_s: float | None) -> Connection:
        if self._closed:
            raise ConnectError("the client is closed")
        conn = Connection(loop, target.key, self._conns.discard)
        try:
            async with asyncio.timeout(connect_s):
                await loop.create_connection(
                    lambda: conn, target.host, target.port, ssl=target.ssl,
                    server_hostname=target.host if target.ssl else None)
        except TimeoutError:
            conn.abort()
            raise ConnectTimeout(f"no connection to {target.authority} within "
                                 f"{connect_s} s") from None
        except OSError as exc:
            raise ConnectError(f"{target.authority}: {type(exc).__name__}: {exc}") from exc
        if conn.open:
            self._conns.add(conn)
        return conn

    def _pooled(self, key: tuple[str, str, int], now: float) -> Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()  # the most recent: the least likely to be dropped
            if conn.open and now - conn.idle_since < KEEPALIVE_S:
                return conn
            conn.abort()
        return None

    def release(self, conn: Connection) -> None:
        """A response's connection: back to its pool when its answer was read whole and
        it may carry another, else closed."""
        if self._closed or not conn.reusable():
            conn.abort()
            return
        loop = conn.loop
        conn.reset(loop.time())
        self._idle.setdefault(conn.key, []).append(conn)
        if self._sweeper is None:
            self._sweeper = loop.call_later(KEEPALIVE_S, self._sweep, loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the connections idle for KEEPALIVE_S (an engine that gets no more
        requests would otherwise keep them until it drops them itself)."""
        self._sweeper = None
        now = loop.time()
        oldest = now
        for key, idle in list(self._idle.items()):
            kept = []
            for conn in idle:
                if conn.open and now - conn.idle_since < KEEPALIVE_S:
                    kept.append(conn)
                    oldest = min(oldest, conn.idle_since)
                else:
                    conn.abort()
            if kept:
                self._idle[key] = kept
            else:
                del self._idle[key]
        if self._idle:
            self._sweeper = loop.call_at(oldest + KEEPALIVE_S, self._sweep, loop)

    def close(self) -> None:
        """Close every connection, in use or idle."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._idle.clear()
        for conn in list(self._conns):
            conn.abort()
