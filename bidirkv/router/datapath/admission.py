"""Admission: a client request becomes a `Turn`, or a refusal before it costs anything.

At most maxInflightRequests requests and maxInflightBodyBytes of bodies (a body of
unknown length counts as maxBodyBytes) at once; past either a 429 with Retry-After,
before anything is read. A body is parsed into objects many times its size, so the
bytes bound is what keeps the pod within memory. A refused body is still drained, at a
pace shared by every refusal of the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from bidirkv.router.datapath.context import Context
from bidirkv.router.datapath.conversations import Conversations
from bidirkv.router.datapath.modes import modes_of
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


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, refused (413) past `limit` bytes whether or not its length was sent."""
    n = request.content_length
    if n is not None and n > limit:
        raise ClientError(413, f"request body of {n} bytes is over the limit of {limit} "
                          "bytes (maxBodyBytes)", type_="request_too_large")
    if n is not None:
        return await request.read()
    parts, size = [], 0
    while chunk := await request.content.read(65536):
        size += len(chunk)
        if size > limit:
            raise ClientError(413, f"request body is over the limit of {limit} bytes "
                              "(maxBodyBytes)", type_="request_too_large")
        parts.append(chunk)
    return b"".join(parts)


# A client's X-Request-Id is kept only in this shape. vLLM builds the decode request id
# from it (`chatcmpl-{id}-{8 hex}`), which then travels in release batches and logs: one
# client's 500-character or odd id must not make decode refuse anybody's batch.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:~-]{1,128}")


def request_id(client_id: str | None) -> str:
    """The client's request id when it is short and plain, else a fresh one."""
    if client_id and _REQUEST_ID.fullmatch(client_id):
        return client_id
    return uuid.uuid4().hex



Served = tuple[web.StreamResponse, str]


class Intake:
    """The router's admission of client requests (the connector's `Admission` is of a
    handle): requests and body bytes in flight, the body read and parsed, the turn built
    with its modes and its conversation named."""

    def __init__(self, ctx: Context, conversations: Conversations) -> None:
        self.ctx = ctx
        self.conversations = conversations
        self.inflight = 0
        self.inflight_bytes = 0
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
        charge = n if n is not None else cfg.max_body_bytes
        if (self.inflight >= cfg.max_inflight_requests
                or self.inflight_bytes + charge > cfg.max_inflight_body_bytes):
            metrics.request(kind, "overloaded")
            return await drained(request, json_error(
                429, f"the router is at its limit of {cfg.max_inflight_requests} requests or "
                f"{cfg.max_inflight_body_bytes} body bytes in flight (maxInflightRequests, "
                "maxInflightBodyBytes); retry", "overloaded", headers={"Retry-After": "1"})
            ), "overloaded"
        self.inflight += 1
        self.inflight_bytes += charge
        try:
            turn = await self._turn(request, kind, trace, t0)
            if not isinstance(turn, Turn):
                metrics.request(kind, "client_error")
                return turn, "client_error"
            return await serve(request, turn)
        finally:
            self.inflight -= 1
            self.inflight_bytes -= charge

    async def _turn(self, request: web.Request, kind: str, trace: Trace, t0: float
                    ) -> Turn | web.Response:
        """The request's turn, its conversation named (its handle taken); else the
        client's error."""
        ctx = self.ctx
        cfg = ctx.cfg
        try:
            raw = await asyncio.wait_for(read_body(request, cfg.max_body_bytes),
                                         cfg.timeouts.body_read_seconds)
        except TimeoutError:
            return json_error(408, "request body not received within "
                              f"{cfg.timeouts.body_read_seconds:g} s "
                              "(timeouts.bodyReadSeconds)", "request_timeout")
        except ClientError as e:
            return await drained(request, json_error(e.status, e.message, e.type, e.param))
        # Parsing, validating and hashing a body is work on the loop in one piece per
        # step: big bodies take those steps one body at a time, yielding in between, so a
        # burst of them delays everyone else by one step, not by all of them.
        big = len(raw) > BIG_BODY_BYTES
        async with self._big_bodies if big else contextlib.nullcontext():
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
            modes = modes_of(cfg)
            turn = Turn(kind, req.stream, req.body, request_id(request.headers.get(
                "X-Request-Id")), request.headers.get("Authorization"),
                ctx.keys.tenant_of(request.headers.get(cfg.tenant_header)), t0, modes,
                Reservation(ctx.store, ctx.evicted), trace,
                prompt_chars(req.body) if modes.places else 0)  # a pass over the body
            if big:
                await asyncio.sleep(0)
            await self.conversations.identify(turn, req.conversation_id)
        return turn
