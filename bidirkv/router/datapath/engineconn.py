"""One connection to an engine, as the legs' HTTP/1.1 client (enginehttp.py) uses it:
the request head written, the response head and body parsed from bytes as they arrive.

- a header name or value with CR or LF is refused (ValueError), never written;
- the response head is bounded (HEAD_LIMIT: beyond it the answer is a protocol error);
  the body ends by Content-Length, with the last chunk (chunked), or when the engine
  closes;
- reading pauses while more than HIGH_WATER bytes wait unread, so a slow client does not
  make the router hold a whole answer, and resumes as they are read;
- a connection lost before its answer ended says whether that was before the answer's
  head and whether it had carried a request before (`Disconnected`).
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any
from urllib.parse import urlsplit

HEAD_LIMIT = 64 * 1024
LINE_LIMIT = 4 * 1024  # a chunk-size line or one trailer line
HIGH_WATER = 64 * 1024
KEEPALIVE_S = 4.0  # idle connections are closed after it (enginehttp.py)

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


def _cut(buf: bytearray, end: bytes, limit: int, what: str) -> bytes | None:
    """The bytes before `end`, taken off `buf` with `end`; None while `end` has not
    arrived; ProtocolError once more than `limit` bytes came without it."""
    at = buf.find(end, 0, limit + len(end))
    if at < 0:
        if len(buf) > limit:
            raise ProtocolError(f"{what} over {limit} bytes")
        return None
    part = bytes(buf[:at])
    del buf[:at + len(end)]
    return part


class Connection(asyncio.Protocol):
    """One connection to an engine and the answer it is reading."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[str, str, int],
                 on_lost: Any) -> None:
        self.loop, self.key, self._on_lost = loop, key, on_lost
        self.transport: asyncio.Transport | None = None
        self.open = False
        self.requests = 0  # requests sent on it, this one included
        self.idle_since = 0.0
        self.stage = IDLE
        self.buf = bytearray()  # bytes of a head or of chunk framing, not yet parsed
        self.chunks: list[bytes] = []  # body bytes not yet read
        self.buffered = 0
        self.status = 0
        self.keep_alive = False
        self.remaining = 0
        self.error: BaseException | None = None
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.deadline: float | None = None
        self.read_s: float | None = None

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
        self.buf += data
        try:
            self._parse()
        except ProtocolError as exc:
            self.error = exc
            self.abort()
        if self.buffered > HIGH_WATER and not self.paused and self.open:
            self.paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        self._wake()

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost says what that meant

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
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

    # -- parsing -----------------------------------------------------------------
    def _parse(self) -> None:
        buf = self.buf
        while buf:
            stage = self.stage
            if stage in (LENGTH, CHUNK_DATA, UNTIL_CLOSE):
                take = len(buf) if stage == UNTIL_CLOSE else min(self.remaining, len(buf))
                self.chunks.append(bytes(buf[:take]))
                self.buffered += take
                del buf[:take]
                self.remaining -= take
                if self.remaining == 0 and stage != UNTIL_CLOSE:
                    self.stage = DONE if stage == LENGTH else CHUNK_END
            elif stage == HEAD:
                head = _cut(buf, b"\r\n\r\n", HEAD_LIMIT, "response head")
                if head is None:
                    return
                self._start_body(head)
            elif stage == CHUNK_END:
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    raise ProtocolError("chunk not followed by CRLF")
                del buf[:2]
                self.stage = CHUNK_SIZE
            elif stage in (CHUNK_SIZE, TRAILER):
                line = _cut(buf, b"\r\n", LINE_LIMIT, "chunk line")
                if line is None:
                    return
                if stage == TRAILER:
                    self.stage = TRAILER if line else DONE
                else:
                    self._start_chunk(line)
            else:  # DONE with bytes after the answer: not ours to read
                self.keep_alive = False
                buf.clear()

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

    def _start_chunk(self, line: bytes) -> None:
        size = line.partition(b";")[0].strip()
        # Hex digits only: int(..., 16) alone would also take a sign, "0x" and underscores.
        if not size or size.strip(b"0123456789abcdefABCDEF"):
            raise ProtocolError(f"bad chunk size {line[:40]!r}")
        n = int(size, 16)
        self.stage, self.remaining = (TRAILER, 0) if n == 0 else (CHUNK_DATA, n)

    # -- for the request and its response ---------------------------------------
    def send(self, data: bytes, deadline: float | None, read_s: float | None) -> bool:
        """Write a request; True when this connection had carried one before."""
        self.requests += 1
        self.stage, self.status, self.error = HEAD, 0, None
        self.deadline, self.read_s = deadline, read_s
        self.transport.write(data)  # type: ignore[union-attr]
        return self.requests > 1

    def take(self) -> bytes:
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
        when = self.deadline
        if self.read_s is not None:
            at = self.loop.time() + self.read_s
            when = at if when is None else min(when, at)
        timer = self.loop.call_at(when, self._timed_out, fut) if when is not None else None
        try:
            await fut
        except BaseException:
            self.abort()
            raise
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    def reusable(self) -> bool:
        return (self.open and self.stage == DONE and self.keep_alive and self.error is None
                and not self.buf and not self.chunks)

    def reset(self, now: float) -> None:
        self.stage, self.idle_since = IDLE, now
        self.deadline = self.read_s = None

    def abort(self) -> None:
        self.keep_alive = False
        if self.open:
            self.open = False
            self.transport.abort()  # type: ignore[union-attr]

    def _wake(self) -> None:
        fut = self.waiter
        if fut is not None and not fut.done():
            fut.set_result(None)

    @staticmethod
    def _timed_out(fut: asyncio.Future[None]) -> None:
        if not fut.done():
            fut.set_exception(TimeoutError())

