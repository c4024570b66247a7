"""Prefill-only mode: with no healthy decode replica, P serves whole requests.

A prefill server is a complete vLLM engine; only its role in the P/D split makes it stop
after one token. While every decode replica is out, answering 503 would turn a decode
outage into a full one, so (with `prefillOnlyFallback`, on by default) the client's body
goes to P as it came: no `kv_transfer_params` (P keeps no blocks for anyone and hands
out no handle), streamed or not as the client asked, relayed by the same SSE relay as a
decode leg. Nothing is stored: there is no decode replica to hold the conversation's KV.
The next turn after a decode replica is healthy again (the health loop keeps probing)
goes through the normal two legs, without reuse the first time.

The mode is decided per request from the health the router already tracks
(`serving_mode`, in health.py: every health change updates the
`bidirkv_router_prefill_only_mode` gauge); `/ready` says which mode the router is in and
why.
"""

from __future__ import annotations

import logging

from aiohttp import web

from bidirkv.router.codec import dumps
from bidirkv.router.datapath.context import Context
from bidirkv.router.datapath.failures import (
    UpstreamFailure,
    failure_response,
    outcome_of,
    unavailable,
)
from bidirkv.router.datapath.health import PREFILL_ONLY
from bidirkv.router.datapath.legs import Legs
from bidirkv.router.datapath.turn import Turn
from bidirkv.router.pool.backends import PREFILL, Backend
from bidirkv.router.pool.selection import least_outstanding

log = logging.getLogger("bidirkv.router")

LEG = "prefill_only"  # the leg_duration_seconds label (and span) of a request P serves


async def serve_on_prefill(ctx: Context, legs: Legs, request: web.Request, turn: Turn
                           ) -> tuple[web.StreamResponse, str]:
    """The client's body as it came on P (a second P if the first fails before a byte)."""
    ctx.metrics.prefill_only.labels(turn.kind).inc()
    turn.trace.set("bidirkv.serving_mode", PREFILL_ONLY)
    payload = dumps(turn.body)
    tried: list[Backend] = []
    last: UpstreamFailure | None = None
    for attempt in range(2):
        p = least_outstanding(ctx.prefill.backends, ctx.prefill.next_start(), tried)
        if p is None:
            break
        if attempt:
            ctx.metrics.retries.labels("prefill_only_failed").inc()
        try:
            return await legs.generate(request, turn, p, payload, turn.rid, LEG)
        except UpstreamFailure as f:
            tried.append(p)
            last = f
            log.warning("prefill-only request failed (%s) rid=%s conv=%s prefill=%s",
                        f.detail or f.kind, turn.rid, turn.conv, p.url)
    if last is None:
        return unavailable(PREFILL, ctx.cfg.health_check_interval_seconds), "unavailable"
    return failure_response(last, turn.rid), outcome_of(last)
