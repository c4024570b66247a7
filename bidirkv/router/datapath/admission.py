"""Admission: a client request takes an in-flight slot (`Slot`, held for as long as its turn
runs) and becomes a `Turn`, or is refused before it costs anything.

At most maxInflightRequests requests and maxInflightBodyBytes of bodies at once; past
either a 429 with Retry-After. A request takes its slot only once its body is here: until
then it is one of the requests still reading (reading.py), so connections that send a
head and nothing more hold no slot. A body is charged as its bytes arrive, not by the
length it declares, and one that falls under a minimum average rate is cut off (408): a
slow or silent client holds at most what it sent, for seconds. Small bodies that declare
their length are charged up front and may use a reserve, so small requests keep flowing
while large uploads fill the rest. A refused body is still drained, at a shared pace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from typing import Any

from aiohttp import web

from bidirkv.router.datapath.context import Context
from bidirkv.router.datapath.modes import modes_of
from bidirkv.router.datapath.reading import PER_SOURCE_KNOB, Readers
from bidirkv.router.datapath.reservation import Reservation
from bidirkv.router.datapath.turn import Turn
from bidirkv.router.pool.placement import prompt_chars
from bidirkv.router.request.replies import json_error
from bidirkv.router.request.validation import ClientError, parse_request
from bidirkv.router.tracing.spans import Trace

log = logging.getLogger("bidirkv.router")

# Bodies above this take their parse and hashing steps one at a time (Slot.paced).
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


# A small body's steps take no lock.
UNPACED: contextlib.AbstractAsyncContextManager[None] = contextlib.nullcontext()


class Slot:
    """One request's admission, as an async context manager. On entry its body is read,
    charged as it arrives, and it takes an in-flight slot; or it is refused (`refused`).
    On exit the slot and the body's bytes are free again, and then a refusal is counted
    and sent, the rest of a body refused part-way drained at the shared pace."""

    __slots__ = ("intake", "request", "kind", "body", "bytes", "held", "refused",
                 "conversation_id", "parent_id")

    def __init__(self, intake: Intake, request: web.Request, kind: str) -> None:
        self.intake = intake
        self.request = request
        self.kind = kind
        self.body = b""
        self.bytes = 0  # held against the in-flight bytes
        self.held = False  # an in-flight slot
        self.refused: Served | None = None
        self.conversation_id: str | None = None  # once the body is parsed
        self.parent_id: str | None = None  # a parent header's, once parsed

    def refuse(self, resp: web.Response) -> Served:
        self.refused = resp, "overloaded" if resp.status == 429 else "client_error"
        return self.refused

    async def __aenter__(self) -> Slot:
        if (refusal := await self._enter()) is not None:
            self.refuse(refusal)
        return self

    async def _enter(self) -> web.Response | None:
        """The body read and a slot taken (None), else the refusal."""
        intake, cfg = self.intake, self.intake.ctx.cfg
        n = self.request.content_length
        if n is not None and n > cfg.max_body_bytes:  # refused before it costs a slot
            return json_error(
                413, f"request body of {n} bytes is over the limit of {cfg.max_body_bytes} "
                "bytes (maxBodyBytes)", "request_too_large")
        small = n is not None and n <= SMALL_BODY_BYTES
        room = body_room(cfg.max_inflight_body_bytes, cfg.max_body_bytes, small)
        # Complete requests hold every slot: refused before its body is read, which would
        # most likely find none free either.
        if (intake.inflight >= cfg.max_inflight_requests
                or intake.inflight_bytes + (n or 0) > room):
            return intake.overloaded()
        self.bytes = n if small else 0
        intake.inflight_bytes += self.bytes
        try:
            got = await intake.body(self.request, self, None if small else room)
        except BaseException:
            intake.inflight_bytes -= self.bytes
            raise
        if not isinstance(got, bytes):
            return got
        if intake.inflight >= cfg.max_inflight_requests:  # taken while the body arrived
            return intake.overloaded()
        intake.inflight += 1
        self.held, self.body = True, got
        return None

    def paced(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """Parsing, validating and hashing a body is work on the loop in one piece per
        step: big bodies take those steps one body at a time (this lock), yielding in
        between (Intake.turn), so a burst of them delays everyone else by one step, not
        by all of them."""
        return self.intake.big_bodies if len(self.body) > BIG_BODY_BYTES else UNPACED

    async def __aexit__(self, *exc: object) -> None:
        intake = self.intake
        intake.inflight -= self.held
        intake.inflight_bytes -= self.bytes
        if self.refused is None:
            return
        # Refused: the bytes are free again before the rest of a body refused part-way is
        # drained, which lasts as long as the client keeps sending.
        resp, outcome = self.refused
        intake.ctx.metrics.request(self.kind, outcome)
        if resp.keep_alive is False:  # _closing's: the rest of the body is not waited for
            await shut(self.request, resp)
        else:
            await drained(self.request, resp)


class Intake:
    """The router's admission of client requests (the connector's `Admission` is of a
    handle): requests and body bytes in flight, the body read and parsed, the turn built
    with its modes."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.inflight = 0
        self.inflight_bytes = 0
        self.readers = Readers()
        self.big_bodies = asyncio.Lock()

    def admit(self, request: web.Request, kind: str) -> Slot:
        """The request's admission: `async with` it for as long as the turn runs."""
        return Slot(self, request, kind)

    def overloaded(self) -> web.Response:
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

    async def body(self, request: web.Request, charge: Slot, room: int | None
                   ) -> bytes | web.Response:
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
            return self.overloaded() if e.status == 429 else \
                json_error(e.status, e.message, e.type, e.param)

    async def _read(self, content: web.StreamReader, charge: Slot, room: int | None
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

    def _take(self, chunk: bytes, size: int, limit: int, charge: Slot,
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

    async def turn(self, request: web.Request, slot: Slot, trace: Trace, t0: float
                   ) -> Turn | Served:
        """The turn of the admitted body, its modes read once; else the client's error,
        which the slot sends as it ends. The body's bytes are let go of once parsed: none
        held while the turn runs."""
        ctx = self.ctx
        cfg = ctx.cfg
        raw, slot.body = slot.body, b""
        big = len(raw) > BIG_BODY_BYTES
        if big:
            await asyncio.sleep(0)
        try:
            req = parse_request(raw, slot.kind, request.headers,
                                ctx.max_model_len, cfg.max_json_containers,
                                cfg.parent_headers)
        except ClientError as e:
            return slot.refuse(json_error(e.status, e.message, e.type, e.param))
        del raw
        if cfg.model is not None and "model" not in req.body:
            req.body["model"] = cfg.model
        modes = modes_of(cfg)
        turn = Turn(slot.kind, req.stream, req.body,
                    request_id(request.headers.get("X-Request-Id")),
                    request.headers.get("Authorization"), t0, modes,
                    Reservation(ctx.store, ctx.evicted), trace,
                    prompt_chars(req.body) if modes.places else 0)  # a pass over the body
        slot.conversation_id, slot.parent_id = req.conversation_id, req.parent_id
        if big:
            await asyncio.sleep(0)
        return turn
