"""One connection to an engine (`Connection`) and the answer read from it (`Response`), for
the legs' HTTP/1.1 client (http.py: the pool, the request written, when a connection
goes back to its pool). Each read is parsed in one pass: the head (HEAD_LIMIT) and a
chunk-size or trailer line (LINE_LIMIT) are bounded, a chunk size is hex digits, a chunk
ends with CRLF; the body ends by Content-Length, with the last chunk, or at the close. A
wait for bytes ends at the exchange's deadline, at its first-byte deadline (until a 200's
first body bytes are read; an error answer is read whole under it) or after the per-read
timeout: one timer per connection, moved only when a wait must end before it fires.
Reading pauses while over HIGH_WATER bytes wait unread, resuming as they are read.
"""

from __future__ import annotations

import asyncio
from typing import Any

HEAD_LIMIT = 64 * 1024
LINE_LIMIT = 4 * 1024  # a chunk-size line or one trailer line
HIGH_WATER = 64 * 1024
HEX = b"0123456789abcdefABCDEF"

# What a connection is reading.
IDLE, HEAD, LENGTH, CHUNK_SIZE, CHUNK_DATA, CHUNK_END, TRAILER, UNTIL_CLOSE, DONE = range(9)


class EngineHTTPError(Exception):
    """A leg's HTTP exchange that failed."""


class ConnectError(EngineHTTPError):
    """No connection could be opened (the engine is not listening, or unreachable)."""


class ConnectTimeout(ConnectError):
    """No connection within the connect timeout."""


class Disconnected(EngineHTTPError):
    """The connection was lost before the answer ended. `before_head`: before any of the
    answer's head; `reused`: the connection had carried a request before."""

    def __init__(self, message: str, before_head: bool, reused: bool) -> None:
        super().__init__(message)
        self.before_head = before_head
        self.reused = reused


class ProtocolError(EngineHTTPError):
    """An answer that is not HTTP/1.1 as this client reads it."""


def parse_head(head: bytes) -> tuple[int, bool, int | None, bool]:
    """(status, keep_alive, content_length, chunked) of a response head (without its
    blank line). ProtocolError for a head this client does not read."""
    lines = head.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code = rest[:3]
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit() \
            or rest[3:4] not in (b"", b" "):
        raise ProtocolError(f"bad status line {lines[0][:80]!r}")
    keep_alive, length, chunked, encoded = version == b"HTTP/1.1", None, False, False
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise ProtocolError(f"bad header line {line[:80]!r}")
        name, value = name.lower(), value.strip()
        if name == b"content-length":
            if not value.isdigit() or (length is not None and int(value) != length):
                raise ProtocolError(f"bad Content-Length {value[:40]!r}")
            length = int(value)
        elif name == b"transfer-encoding":
            encoded = True
            chunked = value.lower().rpartition(b",")[2].strip() == b"chunked"
        elif name == b"connection":
            if b"close" in (t.strip() for t in value.lower().split(b",")):
                keep_alive = False
    if encoded:
        # Transfer-Encoding decides the body; with a Content-Length beside it, or not
        # chunked (read until close), the connection is not used again.
        keep_alive = keep_alive and chunked and length is None
        length = None
    elif length is None:
        keep_alive = False
    return int(code), keep_alive, length, chunked


def chunk_size(line: bytes) -> int:
    """The size a chunk-size line (without its CRLF) announces; ProtocolError unless it is
    hex digits, with an extension after ";" allowed."""
    size = line.partition(b";")[0].strip()
    # Hex digits only: int(..., 16) alone would also take a sign, "0x" and underscores.
    if not size or size.strip(HEX):
        raise ProtocolError(f"bad chunk size {line[:40]!r}")
    return int(size, 16)


def find_end(data: bytes, i: int, end: bytes, limit: int, what: str) -> int:
    """Where `end`, closing the part that starts at `i`, begins; -1 while it has not
    arrived; ProtocolError once more than `limit` bytes came without it."""
    at = data.find(end, i, i + limit + len(end))
    if at < 0 and len(data) - i > limit:
        raise ProtocolError(f"{what} over {limit} bytes")
    return at


class Connection(asyncio.Protocol):
    """One connection to an engine and its answer; `idle`: its engine's idle connections."""

    def __init__(self, loop: asyncio.AbstractEventLoop, idle: list[Connection],
                 on_lost: Any) -> None:
        self.loop, self.idle, self._on_lost = loop, idle, on_lost
        self.transport: asyncio.Transport | None = None
        self.requests = 0  # requests sent on it, this one included
        self.idle_since = 0.0
        self.stage = IDLE
        self.rest = b""  # the start of a head or of chunk framing, not yet parsed
        self.chunks: list[bytes] = []  # body bytes not yet read
        self.buffered = self.status = self.remaining = 0
        self.error: BaseException | None = None
        self.open = self.keep_alive = self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.first_by: float | None = None  # set only while sooner than total_by
        self.total_by: float | None = None
        self.read_s: float | None = None
        self.wait_until: float | None = None  # when the wait in progress times out
        self.timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol --------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.open = True

    def data_received(self, data: bytes) -> None:
        if self.stage == IDLE or self.stage == DONE:
            # Bytes nobody asked for: this connection cannot carry another request.
            self.keep_alive = False
            if self.stage == IDLE:
                self.abort()
            return
        if self.rest:
            data, self.rest = self.rest + data, b""
        try:
            at = self._parse(data)
        except ProtocolError as exc:
            self.error = exc
            self.abort()
        else:
            self.rest = data[at:]
        if self.buffered > HIGH_WATER and not self.paused and self.open:
            self.paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.stage == UNTIL_CLOSE:
            self.stage = DONE
        elif self.stage not in (IDLE, DONE) and self.error is None:
            before = self.stage == HEAD
            why = f"{type(exc).__name__}: {exc}" if exc else "closed by the engine"
            self.error = Disconnected(
                f"connection lost {'before the response' if before else 'mid-response'}"
                f" ({why})", before, self.requests > 1)
        self._wake()
        self._on_lost(self)

    # -- parsing: each returns where the bytes it did not take start ---------------
    def _parse(self, data: bytes) -> int:
        i, n = 0, len(data)
        while i < n:
            stage = self.stage
            if CHUNK_SIZE <= stage <= CHUNK_END:
                i = self._chunked(data, i)
                if self.stage != TRAILER:
                    return i  # the body's bytes so far taken, or more needed
            elif stage == HEAD:
                at = find_end(data, i, b"\r\n\r\n", HEAD_LIMIT, "response head")
                if at < 0:
                    return i
                self._start_body(data[i:at])
                i = at + 4
            elif stage == LENGTH or stage == UNTIL_CLOSE:
                take = n - i if stage == UNTIL_CLOSE else min(self.remaining, n - i)
                self.chunks.append(data[i:i + take])
                self.buffered += take
                i += take
                self.remaining -= take
                if self.remaining == 0 and stage == LENGTH:
                    self.stage = DONE
            elif stage == TRAILER:
                at = find_end(data, i, b"\r\n", LINE_LIMIT, "chunk line")
                if at < 0:
                    return i
                self.stage = TRAILER if at > i else DONE
                i = at + 2
            else:  # DONE with bytes after the answer: not ours to read
                self.keep_alive = False
                return n
        return i

    def _chunked(self, data: bytes, i: int) -> int:
        """Every complete chunk from `i` on, in one pass; the stage says what comes next
        (TRAILER after the last chunk)."""
        stage, remaining, chunks, n, got = self.stage, self.remaining, self.chunks, len(data), 0
        try:
            while True:
                if stage == CHUNK_SIZE:
                    at = find_end(data, i, b"\r\n", LINE_LIMIT, "chunk line")
                    if at < 0:
                        break
                    remaining, i = chunk_size(data[i:at]), at + 2
                    if remaining == 0:
                        stage = TRAILER
                        break
                    stage = CHUNK_DATA
                if stage == CHUNK_DATA:
                    end = i + remaining
                    if end > n:
                        if i < n:
                            chunks.append(data[i:])
                            got += n - i
                            remaining, i = end - n, n
                        break
                    chunks.append(data[i:end])
                    got += remaining
                    i, stage = end, CHUNK_END
                if n - i < 2:
                    break
                if data[i] != 13 or data[i + 1] != 10:
                    raise ProtocolError("chunk not followed by CRLF")
                i, stage = i + 2, CHUNK_SIZE
                if i == n:
                    break
        finally:
            self.stage, self.remaining = stage, remaining
            self.buffered += got
        return i

    def _start_body(self, head: bytes) -> None:
        status, self.keep_alive, length, chunked = parse_head(head)
        if 100 <= status < 200:
            return  # an interim answer; the real head follows
        self.status = status
        if status in (204, 304) or length == 0:
            self.stage = DONE
        elif chunked:
            self.stage = CHUNK_SIZE
        elif length is not None:
            self.stage, self.remaining = LENGTH, length
        else:
            self.stage = UNTIL_CLOSE

    # -- the exchange ------------------------------------------------------------
    async def exchange(self, request: bytes, deadline: float | None, read_s: float | None,
                       first_by: float | None = None) -> Response:
        """Write `request`; the response once its head has arrived. Bounds: `deadline` the
        exchange, `first_by` its first body bytes (loop times), `read_s` each wait."""
        self.send(request, deadline, read_s, first_by)
        while self.stage == HEAD and self.error is None:
            await self.wait()
        if self.error is not None:
            self.abort()
            raise self.error
        return Response(self)

    def send(self, request: bytes, deadline: float | None, read_s: float | None,
             first_by: float | None = None) -> None:
        """Write a request (`requests` counts it)."""
        self.requests += 1
        self.stage, self.status, self.error = HEAD, 0, None
        self.read_s, self.total_by = read_s, deadline
        self.first_by = first_by if first_by is not None and (
            deadline is None or first_by < deadline) else None
        self.transport.write(request)  # type: ignore[union-attr]

    def take(self) -> bytes:
        if self.first_by is not None and self.status == 200:
            self.first_by = None
        data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.open:
            self.paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        return data

    async def wait(self) -> None:
        """Until the connection has news (bytes, the end, a failure) or a timeout; any
        failure here (a timeout, a cancellation) closes the connection."""
        fut = self.waiter = self.loop.create_future()
        when = self.first_by if self.first_by is not None else self.total_by
        if self.read_s is not None:
            at = self.loop.time() + self.read_s
            when = at if when is None else min(when, at)
        self.wait_until = when
        # Moved only when this wait must end sooner; fired early, it is set again.
        if when is not None and (self.timer is None or self.timer.when() > when):
            self._set_timer(when)
        try:
            await fut
        except BaseException:
            self.abort()
            raise
        finally:
            self.waiter = None

    def _set_timer(self, when: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_at(when, self._timer_fired, when)

    def _timer_fired(self, at: float) -> None:
        self.timer = None
        fut, until = self.waiter, self.wait_until
        if fut is None or fut.done() or until is None:
            return  # no wait in progress: the next one sets the timer
        if until <= at:
            fut.set_exception(TimeoutError())
        else:
            self._set_timer(until)

    def reusable(self) -> bool:
        return (self.open and self.stage == DONE and self.keep_alive and self.error is None
                and not self.rest and not self.chunks)

    def reset(self, now: float) -> None:
        self.stage, self.idle_since = IDLE, now
        self.first_by = self.total_by = self.read_s = self.wait_until = None

    def abort(self) -> None:
        self.keep_alive = False
        if self.open:
            self.open = False
            self.transport.abort()  # type: ignore[union-attr]

    def _wake(self) -> None:
        fut = self.waiter
        if fut is not None and not fut.done():
            fut.set_result(None)


class Response:
    """An engine's answer: its status, its body read whole or as it comes. Close it (or
    use `async with`): an answer read to its end puts its connection back on its
    engine's idle list, any other closes it."""

    __slots__ = ("status", "reused", "_conn")

    def __init__(self, conn: Connection) -> None:
        self.status, self.reused = conn.status, conn.requests > 1
        self._conn: Connection | None = conn

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

    @property
    def ended(self) -> bool:
        """The whole answer has been taken: readany would return b"" without waiting."""
        conn = self._conn
        return conn is None or (conn.stage == DONE and not conn.chunks and conn.error is None)

    async def read(self) -> bytes:
        parts = []
        while data := await self.readany():
            parts.append(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.reusable():
            conn.reset(conn.loop.time())
            conn.idle.append(conn)
        else:
            conn.abort()

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
