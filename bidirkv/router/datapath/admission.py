"""Admission: a client request becomes a `Turn`, or a refusal before it costs anything.

At most maxInflightRequests requests and maxInflightBodyBytes of bodies at once; past
either a 429 with Retry-After. A request takes its in-flight slot once its body is here,
not when its head arrives: until then it is one of the requests still reading
(reading.py), bounded in all and per client address, so connections that send a head and
nothing more hold none of the slots that complete requests need. A body is parsed into
objects many times its size, so the bytes bound is what keeps the pod within memory. A
refused body is still drained, at a pace shared by every refusal of the process.

A body is charged as its bytes arrive, not by the length it declares: a connection that
declares 4 MiB and sends nothing holds no bytes, and one that sends slowly is cut off
(408) once it falls under a minimum average rate, so a slow or silent client holds at most
what it really sent and only for seconds. Small bodies that declare their length are
charged it up front and may use a reserve that bodies in progress cannot, so small
requests keep flowing while large uploads fill the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import Awaitable, Callable

from aiohttp import web

from bidirkv.router.datapath.context import Context
from bidirkv.router.datapath.conversations import Conversations
from bidirkv.router.datapath.modes import modes_of
from bidirkv.router.datapath.reading import PER_SOURCE_KNOB, Readers
from bidirkv.router.datapath.replies import json_error
from bidirkv.router.datapath.reservation import Reservation
from bidirkv.router.datapath.tracing import Trace
from bidirkv.router.datapath.turn import Turn
from bidirkv.router.pool.placement import prompt_chars
from bidirkv.router.request.validation import ClientError, parse_request

log = logging.getLogger("bidirkv.router")

# Bodies above this take their parse and hashing steps one at a time (Intake._turn).
BIG_BODY_BYTES = 256 * 1024
# A body refused before it was read is still on its way, and the client may read the
# answer only once it has sent it all (httpx does): it is read and dropped, but every
# refused body together at most DRAIN_BYTES_PER_S, the transport paused in between.
# Reading costs ~0.8 ms of loop per MiB, so 20 clients pushing 8 MiB at a refusal take
# ~5% of the loop for a few seconds instead of all of it for 150 ms. Past DRAIN_MAX_S
# the connection is closed.
DRAIN_BYTES_PER_S = 64 * 1024 * 1024
DRAIN_MAX_S = 30.0


class _DrainPace:
    """One schedule for every refused body of this process."""

    next_at = 0.0


async def drained(request: web.Request, resp: web.Response) -> web.Response:
    """Send a refusal now, then read what is left of the body at the shared pace."""
    if request.content.at_eof():
        return resp
    await resp.prepare(request)
    await resp.write_eof()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DRAIN_MAX_S
    transport = request.transport
    while not request.content.at_eof() and loop.time() < deadline:
        chunk = await request.content.readany()
        if not chunk:
            break
        _DrainPace.next_at = max(_DrainPace.next_at, loop.time()) + len(
            chunk) / DRAIN_BYTES_PER_S
        if transport is not None and not transport.is_closing():
            transport.pause_reading()
        await asyncio.sleep(_DrainPace.next_at - loop.time())
        if transport is not None and not transport.is_closing():
            transport.resume_reading()
    if not request.content.at_eof():
        resp.force_close()
    return resp


async def shut(request: web.Request, resp: web.Response) -> web.Response:
    """Send `resp`, then close the connection at once. Left to aiohttp, the rest of the
    body would be read and dropped for up to 10 s after the answer (its lingering close):
    a silent client's connection held that much longer for nothing."""
    with contextlib.suppress(ConnectionError):  # the client went first: nothing to send
        await resp.prepare(request)
        await resp.write_eof()
    request.protocol.force_close()  # what is written still goes out before the close
    return resp


# A body must arrive at MIN_UPLOAD_BYTES_PER_S on average once UPLOAD_GRACE_S have passed
# since admission (408 past it): a client that sends nothing is gone after the grace, and
# one at the minimum rate holds at most ~1 MiB by timeouts.bodyReadSeconds' default 30 s.
# 32 KiB/s is a 4 MiB body in 2 minutes, slower than any link that must send it in 30 s.
MIN_UPLOAD_BYTES_PER_S = 32 * 1024
UPLOAD_GRACE_S = 2.0
# Bodies up to SMALL_BODY_BYTES with a declared length may use the whole bytes budget;
# every other body only the budget less the reserve (1/RESERVE_SHARE of it, never so much
# that a maxBodyBytes body no longer fits), which bodies still arriving cannot take.
SMALL_BODY_BYTES = 64 * 1024
RESERVE_SHARE = 8


def upload_deadline(start: float, received: int) -> float:
    """When the next bytes of a body must have arrived, `received` of them at `start` +
    whatever time since: the grace plus the time the minimum rate allows for them."""
    return start + UPLOAD_GRACE_S + received / MIN_UPLOAD_BYTES_PER_S


def body_room(budget: int, max_body: int, small: bool) -> int:
    """The in-flight bytes a body may bring the total to: all of `budget` for a small one,
    else the budget less the small bodies' reserve."""
    return budget if small else budget - min(budget // RESERVE_SHARE, budget - max_body)


class Charge:
    """The body bytes one request holds against the in-flight budget."""

    __slots__ = ("bytes",)

    def __init__(self, n: int) -> None:
        self.bytes = n


class _Undrained:
    """A refusal whose body is still arriving: drained once the request's slot is free."""

    __slots__ = ("resp",)

    def __init__(self, resp: web.Response) -> None:
        self.resp = resp


class _TooSlow(Exception):
    def __init__(self, received: int, after: float) -> None:
        self.received = received
        self.after = after


# A client's X-Request-Id is kept only in this shape. vLLM builds the decode request id
# from it (`chatcmpl-{id}-{8 hex}`), which then travels in release batches and logs: one
# client's 500-character or odd id must not make decode refuse anybody's batch.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:~-]{1,128}")


def request_id(client_id: str | None) -> str:
    """The client's request id when it is short and plain, else a fresh one."""
    if client_id and _REQUEST_ID.fullmatch(client_id):
        return client_id
    # 32 hex characters like uuid4().hex, at a quarter of its cost: nothing reads a
    # version from it.
    return os.urandom(16).hex()


# What of a client's string a log line shows: LOGGED_CHARS characters, escaped, so no
# client writes kilobytes or line breaks into the router's log.
LOGGED_CHARS = 128


def logged(client_value: str | None) -> str:
    """A client-sent value (a request id, a path) as a log line may show it: a request
    id in the kept shape as it is, anything else escaped and cut, with its length."""
    if client_value is None:
        return "-"
    if _REQUEST_ID.fullmatch(client_value):
        return client_value
    shown = ascii(client_value[:LOGGED_CHARS])
    if len(client_value) > LOGGED_CHARS:
        shown += f"... ({len(client_value)} characters)"
    return shown



Served = tuple[web.StreamResponse, str]


def _closing(resp: web.Response) -> web.Response:
    """`resp`, the connection closed after it: the rest of a slow body is not waited for."""
    resp.force_close()
    return resp


class Intake:
    """The router's admission of client requests (the connector's `Admission` is of a
    handle): requests and body bytes in flight, the body read and parsed, the turn built
    with its modes and its conversation named."""

    def __init__(self, ctx: Context, conversations: Conversations) -> None:
        self.ctx = ctx
        self.conversations = conversations
        self.inflight = 0
        self.inflight_bytes = 0
        self.readers = Readers()
        self._big_bodies = asyncio.Lock()

    async def admit(self, request: web.Request, kind: str, trace: Trace, t0: float,
                    serve: Callable[[web.Request, Turn], Awaitable[Served]]) -> Served:
        """`serve`'s answer for the admitted turn (its slot held until it returns), or
        the refusal."""
        cfg = self.ctx.cfg
        metrics = self.ctx.metrics
        n = request.content_length
        if n is not None and n > cfg.max_body_bytes:  # refused before it costs a slot
            metrics.request(kind, "client_error")
            return await drained(request, json_error(
                413, f"request body of {n} bytes is over the limit of {cfg.max_body_bytes} "
                "bytes (maxBodyBytes)", "request_too_large")), "client_error"
        small = n is not None and n <= SMALL_BODY_BYTES
        room = body_room(cfg.max_inflight_body_bytes, cfg.max_body_bytes, small)
        # Complete requests hold every slot: refused before its body is read, which would
        # most likely find none free either.
        if (self.inflight >= cfg.max_inflight_requests
                or self.inflight_bytes + (n or 0) > room):
            metrics.request(kind, "overloaded")
            return await drained(request, self._overloaded()), "overloaded"
        charge = Charge(n if small else 0)
        self.inflight_bytes += charge.bytes
        try:
            got = await self._in_slot(request, charge, None if small else room, kind,
                                      trace, t0, serve)
            if isinstance(got, tuple):
                return got
        finally:
            self.inflight_bytes -= charge.bytes
        # Refused: the bytes are free again before the rest of a body refused part-way is
        # drained, which lasts as long as the client keeps sending.
        resp = got.resp if isinstance(got, _Undrained) else got
        outcome = "overloaded" if resp.status == 429 else "client_error"
        metrics.request(kind, outcome)
        if isinstance(got, _Undrained):
            resp = await drained(request, resp)
        elif resp.keep_alive is False:  # _closing's: the rest of the body is not waited for
            resp = await shut(request, resp)
        return resp, outcome

    async def _in_slot(self, request: web.Request, charge: Charge, room: int | None,
                       kind: str, trace: Trace, t0: float,
                       serve: Callable[[web.Request, Turn], Awaitable[Served]]
                       ) -> Served | web.Response | _Undrained:
        """The body read, then `serve`'s answer for its turn in an in-flight slot held
        until it returns; else the refusal (of the body, or every slot taken while it
        arrived)."""
        raw = await self._body(request, charge, room)
        if not isinstance(raw, bytes):
            return raw
        if self.inflight >= self.ctx.cfg.max_inflight_requests:
            return self._overloaded()
        self.inflight += 1
        try:
            parsing = self._turn(request, raw, kind, trace, t0)
            del raw  # _turn lets go of the bytes once parsed: none held while it is served
            turn = await parsing
            return await serve(request, turn) if isinstance(turn, Turn) else turn
        finally:
            self.inflight -= 1

    def _overloaded(self) -> web.Response:
        cfg = self.ctx.cfg
        return json_error(
            429, f"the router is at its limit of {cfg.max_inflight_requests} requests or "
            f"{cfg.max_inflight_body_bytes} body bytes in flight (maxInflightRequests, "
            "maxInflightBodyBytes); retry", "overloaded", headers={"Retry-After": "1"})

    def _too_many_reading(self, knob: str) -> web.Response:
        """The refusal of a request whose body is still arriving, past `knob`'s cap; its
        connection is closed, nothing more of it read."""
        cfg = self.ctx.cfg
        if knob == PER_SOURCE_KNOB:
            said = (f"this client address has {cfg.max_reading_requests_per_source} "
                    "requests whose body is still arriving, the most one address may have")
        else:
            said = (f"the router is at its limit of {cfg.max_reading_requests} requests "
                    "whose body is still arriving")
        return _closing(json_error(429, f"{said} ({knob}); retry", "overloaded",
                                   headers={"Retry-After": "1"}))

    async def _body(self, request: web.Request, charge: Charge, room: int | None
                    ) -> bytes | web.Response | _Undrained:
        """The whole body, or the client's error. A body not here whole is read only
        if its source and the router have room for one more request still reading."""
        cfg = self.ctx.cfg
        content = request.content
        try:
            if content.is_eof():
                # All of it came with the headers (most bodies do): no read waits, so there
                # is no pace or deadline to keep, and it is one chunk, as readany gives it.
                body = content.read_nowait()
                self._take(body, len(body), cfg.max_body_bytes, charge, room)
                return body
            source = request.remote or ""
            knob = self.readers.full(source, cfg.max_reading_requests,
                                     cfg.max_reading_requests_per_source)
            if knob is not None:
                return self._too_many_reading(knob)
            with self.readers.reading(source):
                return await self._read(content, charge, room)
        except _TooSlow as e:
            return _closing(json_error(
                408, f"request body arriving too slowly: {e.received} bytes after "
                f"{e.after:.1f} s; at least {MIN_UPLOAD_BYTES_PER_S} bytes/s on average "
                f"after the first {UPLOAD_GRACE_S:g} s is required", "request_timeout"))
        except TimeoutError:
            return _closing(json_error(
                408, "request body not received within "
                f"{cfg.timeouts.body_read_seconds:g} s (timeouts.bodyReadSeconds)",
                "request_timeout"))
        except ClientError as e:
            return _Undrained(self._overloaded() if e.status == 429 else
                              json_error(e.status, e.message, e.type, e.param))

    async def _read(self, content: web.StreamReader, charge: Charge, room: int | None
                    ) -> bytes:
        """The rest of a body not here whole, each chunk charged as it arrives (`room`:
        the total it may bring the in-flight bytes to; None: charged up front). 413 past
        maxBodyBytes, 429 past `room`, _TooSlow under the minimum rate, TimeoutError past
        timeouts.bodyReadSeconds."""
        cfg = self.ctx.cfg
        limit = cfg.max_body_bytes
        loop = asyncio.get_running_loop()
        start = loop.time()
        end = start + cfg.timeouts.body_read_seconds
        parts: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout_at(min(end, upload_deadline(start, 0))) as timer:
                while chunk := await content.readany():
                    size += len(chunk)
                    self._take(chunk, size, limit, charge, room)
                    parts.append(chunk)
                    timer.reschedule(min(end, upload_deadline(start, size)))
        except TimeoutError:
            if loop.time() < end:
                raise _TooSlow(size, loop.time() - start) from None
            raise
        return b"".join(parts)

    def _take(self, chunk: bytes, size: int, limit: int, charge: Charge,
              room: int | None) -> None:
        """Charge `chunk`, which brings the body to `size` bytes: 413 past `limit`, 429
        past `room`."""
        if size > limit:
            raise ClientError(413, f"request body is over the limit of {limit} "
                              "bytes (maxBodyBytes)", type_="request_too_large")
        if room is not None:
            if self.inflight_bytes + len(chunk) > room:
                raise ClientError(429, "", type_="overloaded")
            charge.bytes += len(chunk)
            self.inflight_bytes += len(chunk)

    async def _turn(self, request: web.Request, raw: bytes, kind: str, trace: Trace,
                    t0: float) -> Turn | web.Response:
        """The turn of the body `raw`, its conversation named (its handle taken); else
        the client's error."""
        ctx = self.ctx
        cfg = ctx.cfg
        # Parsing, validating and hashing a body is work on the loop in one piece per
        # step: big bodies take those steps one body at a time, yielding in between, so a
        # burst of them delays everyone else by one step, not by all of them.
        big = len(raw) > BIG_BODY_BYTES
        if big:  # taken by big bodies only: a small one passes no context manager
            await self._big_bodies.acquire()
        try:
            if big:
                await asyncio.sleep(0)
            try:
                req = parse_request(raw, kind, request.headers.get("X-Conversation-Id"),
                                    ctx.max_model_len, cfg.max_json_containers)
            except ClientError as e:
                return json_error(e.status, e.message, e.type, e.param)
            del raw
            if cfg.model is not None and "model" not in req.body:
                req.body["model"] = cfg.model
            rid = request_id(request.headers.get("X-Request-Id"))
            modes = modes_of(cfg)
            turn = Turn(kind, req.stream, req.body, rid, request.headers.get("Authorization"),
                        self.conversations.tenant(request), t0, modes,
                        Reservation(ctx.store, ctx.evicted), trace,
                        prompt_chars(req.body) if modes.places else 0)  # a pass over the body
            if big:
                await asyncio.sleep(0)
            await self.conversations.identify(turn, req.conversation_id, modes.bidirectional)
        finally:
            if big:
                self._big_bodies.release()
        return turn
