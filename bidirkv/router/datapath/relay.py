"""A decode leg's answer to the client: relayed as it streams (or whole), with decode's
handle kept for the conversation and stripped from what the client sees."""

from __future__ import annotations

import contextlib
import logging
import time

from aiohttp import web

from bidirkv.router.codec import dumps, loads
from bidirkv.router.datapath.context import Context
from bidirkv.router.datapath.health import Health
from bidirkv.router.datapath.keeping import store_handle
from bidirkv.router.datapath.parents import Parent
from bidirkv.router.datapath.turn import Turn
from bidirkv.router.engine.bodies import PARAMS_MARKER
from bidirkv.router.engine.connection import Response
from bidirkv.router.engine.failures import UPSTREAM_FAILURES, classify
from bidirkv.router.engine.sse import DONE, PARAMS, MessageCollector, SSEFilter, error_event
from bidirkv.router.pool.backends import DECODE, Backend
from bidirkv.router.pool.placement import EXTEND, Decision
from bidirkv.router.request.replies import json_response
from bidirkv.router.request.validation import CHAT

log = logging.getLogger("bidirkv.router")

PLACEMENT_HEADER = "X-Bidirkv-Placement"


def placement_header(d: Decision | None, shown: bool, parent: Parent | None = None
                     ) -> dict[str, str]:
    """`decision; reason=...` for the client (benchmarks read it), when one was made and
    the config shows it (`placementHeader`): it tells whoever sent the request whether
    its exact history is stored and how busy decode is, so it is off unless asked for. A
    child's names whose prefix it was placed by (`parent=<label>; kind=fork`)."""
    if d is None or not shown:
        return {}
    named = f"; parent={parent.label}; kind={parent.kind}" if parent is not None else ""
    return {PLACEMENT_HEADER: f"{d.path}; reason={d.reason}{named}"}


def _collector(turn: Turn, keeps: bool) -> MessageCollector | None:
    """For a leg whose handle is kept, of a conversation named by its history or its
    prompt: the answer, collected as it is relayed, names its next turn too."""
    if keeps and (turn.history is not None or turn.prompt is not None):
        return MessageCollector(turn.kind == CHAT)
    return None


class _Streamed(web.StreamResponse):
    """A streamed answer whose head leaves with its first bytes: one send, not two.
    aiohttp holds the head back this way for its whole answers (web.Response); a
    stream sends it at prepare unless told not to."""

    _send_headers_immediately = False


class Relay:
    """An engine's answer to the client; only a decode (or extend) leg's handle is kept,
    P's own params (a request P serves whole) are stripped, never stored."""

    def __init__(self, ctx: Context, health: Health) -> None:
        self.ctx = ctx
        self.health = health

    async def whole(self, turn: Turn, d: Backend, body: bytes, t: float, leg: str
                    ) -> web.Response:
        keeps = leg in (DECODE, EXTEND)
        collector = _collector(turn, keeps)
        if collector is not None or PARAMS_MARKER in body:
            try:
                obj = loads(body)
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                params = obj.pop(PARAMS, None)
                if collector is not None:
                    collector.feed_response(obj)
                if isinstance(params, dict) and keeps:
                    await store_handle(self.ctx, turn, d, params, collector)
                body = dumps(obj)
        now = time.perf_counter()
        self.ctx.metrics.observe_ttft(turn.kind, False, now - turn.t0)
        self.ctx.metrics.observe_leg(leg, "ok", now - t)
        return json_response(200, body, {"X-Request-Id": turn.rid, **placement_header(
            turn.placed, self.ctx.cfg.placement_header, turn.parent)})

    async def stream(self, request: web.Request, turn: Turn, d: Backend,
                     resp: Response, first: bytes, t: float, leg: str
                     ) -> tuple[web.StreamResponse, str]:
        out = _Streamed(headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Request-Id": turn.rid,
            **placement_header(turn.placed, self.ctx.cfg.placement_header, turn.parent),
        })
        # Only a decode leg's handle is kept; P's own params are stripped, never stored.
        stored = leg not in (DECODE, EXTEND)
        collector = _collector(turn, not stored)
        filt = SSEFilter(collector)
        done = False
        data, at_first = first, True
        try:
            writer = await out.prepare(request)
            assert writer is not None  # a fresh response: prepared here, once
            while True:
                chunk = filt.feed(data) if data else filt.finish()
                # Stored before the client can see [DONE]: its next turn may come at once.
                if not stored and filt.params is not None:
                    await store_handle(self.ctx, turn, d, filt.params, collector)
                    stored = True
                done = done or chunk.endswith(DONE)
                # The answer's last bytes go with the stream's terminator, in one send,
                # when D's answer has ended with them: [DONE] never waits for D's end.
                if done and (not data or (resp.ended and not filt.holding)):
                    break
                if chunk:
                    await out.write(chunk)
                if at_first:
                    if not chunk:  # no whole event yet: the head is not held for one
                        writer.send_headers()
                    self._first_byte(turn)
                    at_first = False
                if not data:
                    break
                try:
                    data = await resp.readany()
                except UPSTREAM_FAILURES as exc:
                    return await self._broken(out, turn, d, leg, t, exc), "stream_error"
        except ConnectionError:
            return self._left(turn, out)
        if not done:
            log.warning("%s stream ended without [DONE] rid=%s conv=%s %s=%s", d.role,
                        turn.rid, turn.conv, d.role, d.url)
            await self._end_with_error(out, f"{d.role} engine stream ended early")
            return out, "stream_error"
        try:
            await out.write_eof(chunk)
        except ConnectionError:
            if chunk:  # events the client did not get
                return self._left(turn, out)
        if at_first:
            self._first_byte(turn)
        self.ctx.metrics.observe_leg(leg, "ok", time.perf_counter() - t)
        return out, "ok"

    def _first_byte(self, turn: Turn) -> None:
        self.ctx.metrics.observe_ttft(turn.kind, True, time.perf_counter() - turn.t0)

    @staticmethod
    def _left(turn: Turn, out: web.StreamResponse) -> tuple[web.StreamResponse, str]:
        # The client left; the finally of the caller closes D's stream.
        log.debug("client disconnected rid=%s conv=%s", turn.rid, turn.conv)
        return out, "cancelled"

    async def _broken(self, out: web.StreamResponse, turn: Turn, d: Backend, leg: str,
                      t: float, exc: BaseException) -> web.StreamResponse:
        """The engine's stream broke after the client got its first bytes: the client
        gets an error event, the leg is counted failed."""
        kind, detail = classify(exc)
        self.ctx.metrics.observe_leg(leg, "error", time.perf_counter() - t)
        log.warning("%s stream broke (%s) rid=%s conv=%s %s=%s", d.role, detail,
                    turn.rid, turn.conv, d.role, d.url)
        if kind == "connect":
            self.health.set_health(d, False, detail)
        await self._end_with_error(out, f"{d.role} engine stream {detail}")
        return out

    async def _end_with_error(self, out: web.StreamResponse, message: str) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            await out.write(error_event(message) + DONE)
            await out.write_eof()
