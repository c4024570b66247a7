"""One turn, top to bottom (`Flow.serve`): admitted, its conversation named, placed, run,
ended. Running it (`Runner`): each leg tried on the replicas its plan names, in order,
and what a failure leads to. docs/protocol.md (sections 1, 2 and 4) has the failure
modes; the why of those the protocol leaves open:
- A handle P failed with is discarded, not put back: P may have read (so freed) D's
  blocks, and a handle that made P fail would fail the next turn too.
- D failing before a byte: P's first blocks are not reused (the failed D may have freed
  them); the retry's legs use `<request id>-retry1`, never colliding inside an engine.
  A whole turn on decode that fails takes the two legs elsewhere, without the handle.
- Connection errors and 5xx take a backend out until its next good health check, except
  a 5xx from P on a reuse turn (the handle, not P, is the likely cause).
- Upstream `Authorization` is the client's own, so engines with --api-key check it.
- Prefill-only (`prefillOnlyFallback`): a 503 would turn a decode outage into a full one.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from bidirkv.router.codec import dumps
from bidirkv.router.datapath.admission import Intake, Served
from bidirkv.router.datapath.context import Context
from bidirkv.router.datapath.conversations import Conversations
from bidirkv.router.datapath.health import PREFILL_ONLY, Health, serving_mode
from bidirkv.router.datapath.legs import Legs
from bidirkv.router.datapath.modes import Plan
from bidirkv.router.datapath.parents import reuse_kind
from bidirkv.router.datapath.placing import Placing
from bidirkv.router.datapath.reservation import CONSUMED
from bidirkv.router.datapath.turn import Turn, trace_attributes
from bidirkv.router.engine.bodies import upstream_headers
from bidirkv.router.engine.clients import Clients
from bidirkv.router.engine.failures import (
    UPSTREAM_FAILURES,
    UpstreamFailure,
    classify,
    failure_response,
    outcome_of,
    rejected,
    unavailable,
)
from bidirkv.router.pool.backends import DECODE, PREFILL, Backend
from bidirkv.router.pool.selection import Tries
from bidirkv.router.request.replies import json_response
from bidirkv.router.tracing.spans import Trace

log = logging.getLogger("bidirkv.router")

MODELS = "/v1/models"
LEG = "prefill_only"  # the leg_duration_seconds label (and span) of a request P serves


class Flow:
    """A client request's turn, from its admission to its end."""

    def __init__(self, ctx: Context, intake: Intake, conversations: Conversations,
                 placing: Placing, runner: Runner) -> None:
        self.ctx = ctx
        self.intake = intake
        self.conversations = conversations
        self.placing = placing
        self.runner = runner

    async def serve(self, request: web.Request, kind: str, trace: Trace, t0: float
                    ) -> Served:
        """The answer to one client request, and its outcome."""
        async with self.intake.admit(request, kind) as slot:  # its slot held to the end
            if slot.refused is not None:
                return slot.refused
            async with slot.paced():
                turn = await self.intake.turn(request, slot, trace, t0)
                if not isinstance(turn, Turn):  # the client's error
                    return turn
                await self.conversations.identify(turn, request, slot.conversation_id,
                                                  slot.parent_id)
            plan = self.placing.plan(turn)
            outcome = None  # raised: the middleware's 500
            try:
                resp, outcome = await self.runner.run(request, turn, plan)
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            finally:
                await self.end(turn, outcome)
            return resp, outcome

    async def end(self, turn: Turn, outcome: str | None) -> None:
        """However the turn ended: its handle ends (an unused one goes back to the store),
        its reuse outcome is counted once, its span's attributes are written, and the
        request is counted by its outcome (an answered one also by whose KV it reused)."""
        metrics = self.ctx.metrics
        await turn.handle.release()
        turn.handle.count_once(metrics, turn.asked_prefill, turn.placed)
        if turn.trace.recording:
            turn.trace.update(trace_attributes(turn))
        if outcome == "ok" and (kind := reuse_kind(
                turn.handle.reuse, turn.handle.ended == CONSUMED, turn.placed, turn.parent,
                turn.read_parent)):
            metrics.reused_from(kind)
        if outcome is not None:
            metrics.request(turn.kind, outcome)
            log.debug("request rid=%s conv=%s kind=%s stream=%s reuse=%s outcome=%s ms=%.2f",
                      turn.rid, turn.conv, turn.kind, turn.stream, turn.handle.reuse, outcome,
                      (time.perf_counter() - turn.t0) * 1000)


class Runner:
    """A turn run as placed: on P alone, whole on one decode replica (the two legs
    elsewhere if that fails before a byte), or the two legs; and GET /v1/models."""

    def __init__(self, ctx: Context, clients: Clients, health: Health, placing: Placing,
                 legs: Legs) -> None:
        self.ctx = ctx
        self.clients = clients
        self.health = health
        self.placing = placing
        self.legs = legs

    async def run(self, request: web.Request, turn: Turn, plan: Plan) -> Served:
        interval = self.ctx.cfg.health_check_interval_seconds
        if plan.unavailable is not None:
            return unavailable(plan.unavailable, interval), "unavailable"
        if plan.on_prefill:
            return await self.on_prefill(request, turn)
        assert plan.decodes is not None
        last: UpstreamFailure | None = None
        if plan.whole_on is not None:
            try:
                return await self.whole(request, turn, plan.whole_on)
            except UpstreamFailure as f:
                # Nothing reached the client: the two legs, on another replica.
                plan.decodes.tried.append(plan.whole_on)
                last = f
        return await self.two_legs(request, turn, plan.decodes, last)

    async def whole(self, request: web.Request, turn: Turn, d: Backend) -> Served:
        """The whole turn on `d`: the holder extending what it keeps, or a replica that
        holds none of it prefilling all of it (a handle whose holder cannot serve is of
        no use there: dropped). UpstreamFailure when nothing reached the client."""
        handle = turn.handle
        entry = handle.held  # not P's to read: never handed out again
        if entry is not None and entry.decode_url != d.url:
            await handle.discard("reuse_failed")
            entry = None
        if entry is not None:
            handle.extending()  # counted at the first byte
        try:
            resp = await self.legs.decode_leg(request, turn, d, turn.rid, None,
                                              entry.num_tokens if entry is not None else None)
        except BaseException as exc:
            if entry is not None:
                await handle.discard("extend_failed")
            if isinstance(exc, UpstreamFailure):
                self.placing.extend_failed(turn)
                self.ctx.metrics.retries.labels("extend_failed").inc()
                log.warning("the whole turn on decode failed (%s); taking the prefill leg "
                            "rid=%s conv=%s decode=%s", exc.detail or exc.kind, turn.rid,
                            turn.conv, d.url)
            raise
        if entry is not None:
            # Refused by D (the client's request): dropped. Else superseded by the handle
            # of this turn, which shares its blocks on D (its prefix cache): D frees what
            # only the old request held.
            await handle.discard("extend_failed" if resp[1] == "upstream_client_error"
                                 else "extended")
        return resp

    async def two_legs(self, request: web.Request, turn: Turn, decodes: Tries,
                       last: UpstreamFailure | None) -> Served:
        """The prefill leg, then the decode leg; a decode that fails before the client got
        a byte is retried once on the next decode replica, with a fresh prefill leg."""
        interval = self.ctx.cfg.health_check_interval_seconds
        for attempt in range(2):
            rid = turn.rid if attempt == 0 else f"{turn.rid}-retry{attempt}"
            # D is chosen first: no prefill is spent on a turn that has nowhere to decode.
            d = decodes.next()
            if d is None:
                if last is not None:
                    return failure_response(last, turn.rid), outcome_of(last)
                return unavailable(DECODE, interval), "unavailable"
            if attempt:
                self.ctx.metrics.retries.labels("decode_before_first_byte").inc()
                log.warning("decode failed before first byte (%s); retrying on %s rid=%s "
                            "conv=%s", last.detail if last else "", d.url, turn.rid, turn.conv)
            try:
                p_body = await self.prefill(turn, rid)
            except UpstreamFailure as f:
                if f.client_error:
                    return rejected(f), "upstream_client_error"
                return failure_response(f, rid), outcome_of(f)
            if p_body is None:
                return unavailable(PREFILL, interval), "unavailable"
            try:
                return await self.legs.decode_leg(request, turn, d, rid, p_body)
            except UpstreamFailure as f:
                decodes.tried.append(d)
                last = f
        assert last is not None
        log.warning("decode failed (%s) rid=%s conv=%s decode=%s", last.detail or last.kind,
                    turn.rid, turn.conv, last.backend.url)
        return failure_response(last, turn.rid), outcome_of(last)

    async def prefill(self, turn: Turn, rid: str) -> dict[str, Any] | None:
        """P's answer to the prefill leg, tried twice: without the handle after P failed
        with it, else on another replica. None: no prefill replica to try."""
        tries = Tries(self.ctx.prefill)
        last: UpstreamFailure | None = None
        for attempt in range(2):
            p = tries.next()
            if p is None:
                if last is not None:
                    raise last
                return None
            with_handle = turn.handle.held is not None or turn.reads_parent
            try:
                return await self.legs.prefill_leg(turn, p, rid)
            except UpstreamFailure as f:
                last = f
                await self._prefill_failed(turn, p, f, rid, attempt == 0, tries, with_handle)
        assert last is not None
        raise last

    async def _prefill_failed(self, turn: Turn, p: Backend, f: UpstreamFailure, rid: str,
                              first: bool, tries: Tries, with_handle: bool) -> None:
        """What a failed prefill leg means for the next attempt; raises `f` when there is
        none (the engine refused the client's request)."""
        ctx = self.ctx
        if with_handle:
            # Spent or poisoned: see the module docstring. Retry as a miss. A parent's
            # handle read shared is the parent's: only this turn stops reading it.
            if turn.handle.held is not None:
                await turn.handle.discard("reuse_failed")
            self.placing.parent_read_failed(turn)
            if f.kind == "connect":
                self.health.set_health(p, False, f.detail)
                tries.tried.append(p)
            ctx.metrics.retries.labels("prefill_reuse_failed").inc()
            log.warning("prefill with handle failed (%s); retrying without rid=%s "
                        "conv=%s prefill=%s", f.detail or f.kind, rid, turn.conv, p.url)
            return
        if f.client_error:
            raise f
        if f.backend_down:
            self.health.set_health(p, False, f.detail or f"HTTP {f.status}")
        tries.tried.append(p)
        log.warning("prefill failed (%s) rid=%s conv=%s prefill=%s",
                    f.detail or f"HTTP {f.status}", rid, turn.conv, p.url)
        if first:
            ctx.metrics.retries.labels("prefill_failed").inc()

    async def on_prefill(self, request: web.Request, turn: Turn) -> Served:
        """The client's body as it came on P (a second P if the first fails before a
        byte): prefill-only, in the module docstring."""
        ctx = self.ctx
        ctx.metrics.prefill_only.labels(turn.kind).inc()
        turn.trace.set("bidirkv.serving_mode", PREFILL_ONLY)
        payload = dumps(turn.body)
        tries = Tries(ctx.prefill)
        last: UpstreamFailure | None = None
        for attempt in range(2):
            p = tries.next()
            if p is None:
                break
            if attempt:
                ctx.metrics.retries.labels("prefill_only_failed").inc()
            try:
                return await self.legs.generate(request, turn, p, payload, turn.rid, LEG)
            except UpstreamFailure as f:
                tries.tried.append(p)
                last = f
                log.warning("prefill-only request failed (%s) rid=%s conv=%s prefill=%s",
                            f.detail or f.kind, turn.rid, turn.conv, p.url)
        if last is None:
            return unavailable(PREFILL, ctx.cfg.health_check_interval_seconds), "unavailable"
        return failure_response(last, turn.rid), outcome_of(last)

    async def models(self, request: web.Request, trace: Trace) -> Served:
        """GET /v1/models, from decode (P while it serves whole requests), on each
        replica in turn until one answers."""
        ctx = self.ctx
        tries = Tries(ctx.prefill if serving_mode(ctx)[0] == PREFILL_ONLY else ctx.decode)
        while (d := tries.next()) is not None:
            span = trace.leg("models", d.url, MODELS, "GET")
            try:
                async with self.clients.pooled.get(
                        d.url + MODELS, timeout=ctx.client_timeouts.prefill,
                        headers=upstream_headers(uuid.uuid4().hex,
                                                 request.headers.get("Authorization"),
                                                 span.headers)) as r:
                    body, status = await r.read(), r.status
            except UPSTREAM_FAILURES as exc:
                kind, detail = classify(exc)
                span.end(kind)
                self.health.set_health(d, False, detail)
                tries.tried.append(d)
                continue
            except asyncio.CancelledError:
                span.end("cancelled")
                raise
            if status >= 500:
                span.end("status", status)
                self.health.set_health(d, False, f"HTTP {status}")
                tries.tried.append(d)
                continue
            span.end("ok" if status == 200 else "upstream_client_error", status)
            return json_response(status, body), \
                "ok" if status == 200 else "upstream_client_error"
        return unavailable(tries.pool.role, ctx.cfg.health_check_interval_seconds), \
            "unavailable"
