"""Where a turn runs (placement.py decides, from what this router sees of its replicas),
and running it there: on P alone, whole on one decode replica, or the two legs with the
decode leg's retry (proxy.py's docstring says why each retry is made as it is); and the
turn's end, however it comes: its handle ended, its reuse outcome counted, its span's
attributes written.

The turn's modes are read here once, into its plan (modes.py's `Plan`): on P alone, whole
on one decode replica, or the two legs; its handle kept or not. The plan, the decision and
the turn's placement are written here only: `turn.plan`, `turn.placed` and
`turn.new_tokens` have no other writer.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from bidirkv.router.config import Placement
from bidirkv.router.datapath.context import Context
from bidirkv.router.datapath.conversations import Conversations
from bidirkv.router.datapath.failures import (
    Unavailable,
    UpstreamFailure,
    failure_response,
    outcome_of,
    rejected,
    unavailable,
)
from bidirkv.router.datapath.legs import Legs
from bidirkv.router.datapath.modes import Plan
from bidirkv.router.datapath.prefillonly import serve_on_prefill
from bidirkv.router.datapath.turn import Turn, trace_attributes
from bidirkv.router.pool.backends import DECODE, Backend
from bidirkv.router.pool.backends import PREFILL as PREFILL_ROLE
from bidirkv.router.pool.placement import (
    EXTEND,
    MOVE,
    ON_DECODE,
    PREFILL,
    Decision,
    Inputs,
    new_tokens,
    place,
)
from bidirkv.router.pool.selection import holder_of, least_outstanding, pick_decode

log = logging.getLogger("bidirkv.router")


class Placing:
    """A turn's placement, the turn run where it is placed, and its end."""

    def __init__(self, ctx: Context, conversations: Conversations, legs: Legs) -> None:
        self.ctx = ctx
        self.conversations = conversations
        self.legs = legs

    async def serve(self, request: web.Request, turn: Turn) -> tuple[web.StreamResponse, str]:
        """The admitted turn, run; whatever way it ends, its handle ends (an unused one
        goes back to the store) and its reuse outcome and span attributes are written."""
        metrics = self.ctx.metrics
        try:
            resp, outcome = await self.run(request, turn)
        except asyncio.CancelledError:
            metrics.request(turn.kind, "cancelled")
            log.debug("request cancelled rid=%s conv=%s", turn.rid, turn.conv)
            raise
        finally:
            await turn.handle.release()
            turn.handle.count_once(metrics, turn.asked_prefill, turn.placed)
            if turn.trace.recording:
                turn.trace.update(trace_attributes(turn))
        metrics.request(turn.kind, outcome)
        log.debug("request rid=%s conv=%s kind=%s stream=%s reuse=%s outcome=%s ms=%.2f",
                  turn.rid, turn.conv, turn.kind, turn.stream, turn.handle.reuse, outcome,
                  (time.perf_counter() - turn.t0) * 1000)
        return resp, outcome

    async def run(self, request: web.Request, turn: Turn) -> tuple[web.StreamResponse, str]:
        """The admitted turn, as its plan says: on P alone, whole on one decode replica
        (the two legs elsewhere if that fails before a byte), or the two legs."""
        ctx = self.ctx
        if not ctx.prefill.healthy():
            return unavailable(PREFILL_ROLE, ctx.cfg.health_check_interval_seconds), "unavailable"
        plan = self.plan(turn)
        if plan.on_prefill:
            return await serve_on_prefill(ctx, self.legs, request, turn)
        tried_decode: list[Backend] = []
        last: UpstreamFailure | None = None
        if plan.whole_on is not None:
            try:
                return await self.whole(request, turn, plan.whole_on)
            except UpstreamFailure as f:
                # Nothing reached the client: the two legs, on another replica.
                tried_decode.append(plan.whole_on)
                last = f
        return await self._two_legs(request, turn, tried_decode, last)

    def plan(self, turn: Turn) -> Plan:
        """What the turn does, from its modes (read here only): with no healthy decode
        replica and prefillOnlyFallback, P serves it; else where it runs is decided.
        Under alwaysDisaggregate, or with bidirectional transfer off (plain P/D), nothing
        is decided: every turn takes the prefill leg."""
        modes = turn.modes
        on_prefill = modes.prefill_only_fallback and not self.ctx.decode.healthy()
        whole_on = self._where(turn, modes.placement) \
            if modes.places and not on_prefill else None
        turn.plan = plan = Plan(on_prefill, whole_on, keeps=modes.bidirectional,
                                keyed=modes.places)
        return plan

    def _where(self, turn: Turn, policy: Placement) -> Backend | None:
        """Decide where the turn runs; the decode replica that takes it whole, if one
        does."""
        ctx = self.ctx
        holder = None
        held: int | None = None
        entry = turn.handle.held
        if entry is not None:
            found = holder_of(ctx.decode.backends, entry.decode_url, None)
            if found is not None and found.healthy and found.in_pool:
                holder, held = found, entry.num_tokens
        held_chars = entry.chars if holder is not None and entry is not None else 0
        turn.new_tokens = new_tokens(turn.prompt_chars, held or 0, ctx.costs.chars_per_token,
                                     held_chars)
        # Read, not picked: the leg's own pick keeps its replicas' rotation.
        p_load = min((b.outstanding for b in ctx.prefill.healthy()), default=0)
        others = [b.outstanding for b in ctx.decode.backends
                  if b.healthy and b.in_pool and not b.draining and b is not holder]
        decision = place(Inputs(held, turn.new_tokens, p_load,
                                holder.outstanding if holder else 0,
                                extends_held=entry is not None
                                and self.conversations.extends(turn, entry),
                                other_inflight=min(others, default=None),
                                sized=ctx.costs.sized,
                                holder_draining=holder is not None and holder.draining),
                         policy, ctx.costs.costs)
        turn.placed = decision
        ctx.metrics.placed(decision.path, decision.reason)
        if decision.path == EXTEND:
            return holder
        if decision.path == ON_DECODE:
            return least_outstanding([b for b in ctx.decode.backends if b.in_pool],
                                     ctx.decode.next_start())
        return None

    async def whole(self, request: web.Request, turn: Turn, d: Backend
                    ) -> tuple[web.StreamResponse, str]:
        """The whole turn on `d`: the holder extending what it keeps, or a replica that
        holds none of it prefilling all of it (a handle whose holder cannot serve is of
        no use there: dropped). UpstreamFailure when nothing reached the client: the
        turn then takes the two legs, without the handle (its holder just failed)."""
        handle = turn.handle
        entry = handle.held  # not P's to read: never handed out again
        if entry is not None and entry.decode_url != d.url:
            await handle.discard("reuse_failed")
            entry = None
        if entry is not None:
            handle.extending()  # counted at the first byte
        try:
            resp = await self.legs.extend_leg(request, turn, d, turn.rid,
                                              entry.num_tokens if entry is not None else None)
        except BaseException as exc:
            if entry is not None:
                await handle.discard("extend_failed")
            if isinstance(exc, UpstreamFailure):
                turn.placed = Decision(PREFILL, "extend_failed")
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

    async def _two_legs(self, request: web.Request, turn: Turn, tried_decode: list[Backend],
                        last: UpstreamFailure | None) -> tuple[web.StreamResponse, str]:
        """The prefill leg, then the decode leg; a decode that fails before the client got
        a byte is retried once elsewhere, with a fresh prefill leg."""
        ctx = self.ctx
        interval = ctx.cfg.health_check_interval_seconds
        # A busy holder: another replica decodes the turn (a retry may still go back).
        busy = holder_of(ctx.decode.backends, turn.holder_url, None) \
            if turn.placed is not None and turn.placed.path == MOVE else None
        for attempt in range(2):
            rid = turn.rid if attempt == 0 else f"{turn.rid}-retry{attempt}"
            # D is chosen first: no prefill is spent on a turn that has nowhere to decode.
            d = None
            if busy is not None and attempt == 0:
                d = least_outstanding(ctx.decode.backends, ctx.decode.next_start(),
                                      [*tried_decode, busy])
            if d is None:
                d = pick_decode(ctx.decode.backends, ctx.decode.next_start(), tried_decode,
                                turn.holder_url)
            if d is None:
                if last is not None:
                    return failure_response(last, turn.rid), outcome_of(last)
                return unavailable(DECODE, interval), "unavailable"
            if attempt:
                ctx.metrics.retries.labels("decode_before_first_byte").inc()
                log.warning("decode failed before first byte (%s); retrying on %s rid=%s "
                            "conv=%s", last.detail if last else "", d.url, turn.rid, turn.conv)
            try:
                p, p_body = await self.legs.prefill_leg(turn, rid)
            except Unavailable as u:
                return unavailable(u.role, interval), "unavailable"
            except UpstreamFailure as f:
                if f.client_error:
                    return rejected(f), "upstream_client_error"
                return failure_response(f, rid), outcome_of(f)
            try:
                return await self.legs.decode_leg(request, turn, p, p_body, d, rid)
            except UpstreamFailure as f:
                tried_decode.append(d)
                last = f
        assert last is not None
        log.warning("decode failed (%s) rid=%s conv=%s decode=%s", last.detail or last.kind,
                    turn.rid, turn.conv, last.backend.url)
        return failure_response(last, turn.rid), outcome_of(last)
