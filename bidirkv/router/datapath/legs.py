"""One attempt of a leg on the replica it is given: the prefill leg, the decode leg, the
whole turn on decode (extend) or on P; the answer relayed to the client (relay.py). Which
replica, and what follows a failure, is flow.py's.

P's report of a reuse turn (connector/core/reuse.py) is read here, as the prefill leg
ends: `"bidirkv": {"reused_tokens", "offered_tokens", "verified"}` in P's
`kv_transfer_params` (or at the top level of its body); fewer reused than offered is
"verified-partial". Without one, only usage's cached_tokens is known, which also counts
P's own prefix-cache hits, so it is exported under its own label.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from aiohttp import web

from bidirkv.router.codec import loads
from bidirkv.router.datapath.context import Context
from bidirkv.router.datapath.health import Health
from bidirkv.router.datapath.relay import Relay
from bidirkv.router.datapath.turn import Turn
from bidirkv.router.engine.bodies import (
    LOCAL_PARAMS,
    PATHS,
    decode_payload,
    prefill_payload,
)
from bidirkv.router.engine.clients import Clients
from bidirkv.router.engine.connection import Response
from bidirkv.router.engine.failures import (
    UPSTREAM_FAILURES,
    UpstreamFailure,
    classify,
    rejected,
)
from bidirkv.router.engine.sse import PARAMS
from bidirkv.router.pool.backends import DECODE, PREFILL, Backend
from bidirkv.router.pool.placement import EXTEND
from bidirkv.router.tracing.spans import Leg
from bidirkv.wire import SHARED_KEY


class ReuseReport(NamedTuple):
    reused_tokens: int | None
    source: str
    partial: bool


def _count(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _bidirkv_report(prefill_body: dict[str, Any]) -> dict[str, Any] | None:
    """P's bidirkv report: in its kv_transfer_params, or beside them."""
    kv = prefill_body.get("kv_transfer_params")
    info = kv.get("bidirkv") if isinstance(kv, dict) else None
    if not isinstance(info, dict):
        info = prefill_body.get("bidirkv")
    return info if isinstance(info, dict) else None


class PrefillWork(NamedTuple):
    prompt_tokens: int
    computed: int  # tokens P prefilled
    read: int  # tokens P read from decode instead


def prefill_answer(prefill_body: dict[str, Any]
                   ) -> tuple[ReuseReport | None, PrefillWork | None]:
    """What P's answer says, read once: the reuse it reports (its bidirkv report, else
    usage's cached tokens) and what its leg did, for the placement's cost model (None:
    P did not give the prompt's tokens)."""
    info = _bidirkv_report(prefill_body)
    usage = prefill_body.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    prompt = _count(usage.get("prompt_tokens"))
    if info is not None:
        reused = _count(info.get("reused_tokens"))
        offered = _count(info.get("offered_tokens"))
        report: ReuseReport | None = ReuseReport(
            reused, "bidirkv", reused is not None and offered is not None and reused < offered)
        read = reused or 0
        computed = _count(info.get("recomputed_tokens"))
        work = PrefillWork(prompt, computed if computed is not None else prompt - read,
                           read) if prompt else None
        return report, work
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    report = ReuseReport(cached, "usage_cached", False) if cached is not None else None
    return report, PrefillWork(prompt, prompt - (cached or 0), 0) if prompt else None


def shared_handle(turn: Turn) -> dict[str, Any] | None:
    """A child's prefill leg reads its parent's handle shared: P reads the blocks and
    decode keeps them retained for the parent (connector/core/residency.py, `share`)."""
    if not turn.reads_parent or turn.parent is None:
        return None
    return {**loads(turn.parent.params), SHARED_KEY: True}


class Legs:
    """One attempt of a leg: the prefill leg, the decode leg, or a whole turn on one
    engine."""

    def __init__(self, ctx: Context, clients: Clients, health: Health, relay: Relay) -> None:
        self.ctx = ctx
        self.clients = clients
        self.health = health
        self.relay = relay

    async def prefill_leg(self, turn: Turn, p: Backend, rid: str) -> dict[str, Any]:
        """P's answer to the prefill leg on `p` (with the turn's handle, if it holds one);
        UpstreamFailure when it failed (flow.py decides what follows)."""
        ctx = self.ctx
        entry = turn.handle.held
        handle = loads(entry.params) if entry is not None else shared_handle(turn)
        payload = functools.partial(prefill_payload, ctx.handle_key, turn.body, handle)
        span = turn.trace.leg(PREFILL, p.url, PATHS[turn.kind])
        if entry is not None:
            span.set("bidirkv.kv.offered_tokens", entry.num_tokens)
        t = time.perf_counter()
        alone = p.outstanding == 0
        p.outstanding += 1
        turn.asked_prefill = True
        try:
            data = await self.clients.post_prefill(p, PATHS[turn.kind], payload, rid,
                                                   turn.auth, ctx.client_timeouts.prefill, span)
        except asyncio.CancelledError:
            span.end("cancelled")
            if entry is not None:
                # P was asked and may have read D's blocks: not safe to hand out again.
                turn.handle.forget("cancelled")
            raise
        except UpstreamFailure as f:
            span.end(f.result, f.status)
            ctx.metrics.observe_leg("prefill", "error", time.perf_counter() - t)
            raise
        except Exception as exc:  # a bug's exception still closes the leg's span
            span.end(type(exc).__name__)
            raise
        finally:
            p.outstanding -= 1
        await self._prefill_answered(turn, span, data, time.perf_counter() - t, alone)
        return data

    def _learn_prefill(self, turn: Turn, work: PrefillWork | None, seconds: float,
                       alone: bool) -> None:
        """`alone`: the leg started with no other in flight on its replica. One that
        queued behind others measured the queue too, which the estimate adds itself."""
        if work is not None:
            turn.prompt_tokens = work.prompt_tokens
            costs = self.ctx.costs
            costs.observe_prompt(turn.prompt_chars, work.prompt_tokens)
            if alone:
                costs.observe_prefill(seconds * 1000, work.computed, work.read)

    async def _prefill_answered(self, turn: Turn, span: Leg, data: dict[str, Any],
                                took: float, alone: bool) -> None:
        """P's answer, read once: what it says of the prompt learnt and traced, the leg's
        span ended, then the handle it was offered consumed and the reuse counted."""
        ctx = self.ctx
        ctx.metrics.observe_leg("prefill", "ok", took)
        report, work = prefill_answer(data)
        try:
            self._learn_prefill(turn, work, took, alone)
            if span.recording and report is not None:
                span.set("bidirkv.kv.reused_tokens", report.reused_tokens)
                span.set("bidirkv.kv.reuse_source", report.source)
            span.set("gen_ai.usage.input_tokens", turn.prompt_tokens)
        finally:
            span.end("ok", 200)
        entry = turn.handle.held
        if entry is not None:
            await turn.handle.consume(report is not None and report.partial)
            if entry.num_tokens >= ctx.cfg.kv_recompute_threshold:
                ctx.metrics.tokens_offered.inc(entry.num_tokens)
        elif turn.reads_parent:  # the parent's handle: read, never spent
            turn.read_parent = bool(report is not None and report.reused_tokens)
        if (entry is not None or turn.reads_parent) and report is not None \
                and report.reused_tokens:
            ctx.metrics.reused(report.source, report.reused_tokens)

    async def decode_leg(self, request: web.Request, turn: Turn, d: Backend, rid: str,
                         p_body: dict[str, Any] | None = None, held_tokens: int | None = None
                         ) -> tuple[web.StreamResponse, str]:
        """The decode leg after P's answer (`p_body`); without one, the whole turn on one
        decode replica (extend): the one holding the conversation prefills the new tokens
        on top of the KV it kept (its prefix cache, `held_tokens`), another the whole
        prompt. Either keeps the blocks and hands out the next handle (when the plan keeps
        it). UpstreamFailure before the client got a byte."""
        ctx = self.ctx
        keeps = turn.plan.keeps
        p_params = LOCAL_PARAMS if p_body is None else p_body.get(PARAMS)
        # Built as the request goes out (engine/clients.py), as the prefill leg's body is.
        payload = functools.partial(
            decode_payload, ctx.handle_key if keeps else None, turn.body, p_params,
            ctx.residency.owner if keeps else None, turn.tenant if keeps else None, turn.gap)
        if p_body is None:
            return await self.generate(request, turn, d, payload, rid, EXTEND, held_tokens)
        # The KV D reads from P: P's prompt, as its params say.
        offered = p_params.get("remote_num_tokens") if isinstance(p_params, dict) else None
        return await self.generate(request, turn, d, payload, rid, DECODE,
                                   offered if isinstance(offered, int) else None)

    async def generate(self, request: web.Request, turn: Turn, d: Backend,
                       payload: bytes | Callable[[], bytes], rid: str, leg: str,
                       offered_tokens: int | None = None) -> tuple[web.StreamResponse, str]:
        """The response and its outcome; UpstreamFailure when `d` failed before the client
        got a byte (the caller may retry elsewhere). `leg`: decode, extend, or
        prefill_only (P serves the whole request: nothing to store). `offered_tokens`:
        the KV the engine is given to start from (its span says so)."""
        t = time.perf_counter()
        first_byte_s = self._first_byte_s(turn)
        span = turn.trace.leg(leg, d.url, PATHS[turn.kind])
        span.set("bidirkv.kv.offered_tokens", offered_tokens)
        result, status = "cancelled", None
        alone = d.outstanding == 0
        d.outstanding += 1
        resp: Response | None = None
        try:
            try:
                # The first-byte bound is the client's (a TimeoutError, as any timeout).
                resp = await self.clients.post(d, PATHS[turn.kind], payload, rid, turn.auth,
                                               self.ctx.client_timeouts.decode,
                                               retry_stale=leg not in (DECODE, EXTEND),
                                               span=span, first_byte_s=first_byte_s)
                status = resp.status
                if resp.status != 200:
                    body = await resp.read()
                    raise UpstreamFailure(d.role, d, "status", resp.status, body,
                                          f"HTTP {resp.status}")
                if not turn.stream:
                    body = await resp.read()
                    out = await self.relay.whole(turn, d, body, t, leg)
                    result = "ok"
                    return out, result
                first = await resp.readany()
                if alone:
                    self._learn_first_byte(turn, leg, time.perf_counter() - t)
                if not first:
                    raise UpstreamFailure(d.role, d, "protocol",
                                          detail="stream ended before any data")
                if leg in (DECODE, EXTEND):
                    turn.handle.count_once(self.ctx.metrics, turn.asked_prefill, turn.placed)
            except UPSTREAM_FAILURES as exc:
                kind, detail = classify(exc)
                f = UpstreamFailure(d.role, d, kind, detail=detail)
                result = f.result
                return self._leg_failed(f, t, leg)
            except UpstreamFailure as f:
                result = f.result
                return self._leg_failed(f, t, leg)
            out, result = await self.relay.stream(request, turn, d, resp, first, t, leg)
            return out, result
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError | UpstreamFailure):
                result = type(exc).__name__
            raise
        finally:
            span.end(result, status)
            d.outstanding -= 1
            if resp is not None:
                resp.close()

    def _first_byte_s(self, turn: Turn) -> float | None:
        """Streamed, a replica that takes the connection and never answers would hold the
        turn for decodeSeconds; before the first byte the turn can still go to another
        replica. Not streamed, the whole answer is the first byte: decodeSeconds alone
        bounds it."""
        return self.ctx.cfg.timeouts.decode_first_byte_seconds if turn.stream else None

    def _learn_first_byte(self, turn: Turn, leg: str, seconds: float) -> None:
        """A streamed leg's first token, from a leg that started alone on its replica:
        after P's answer, the second hop's cost for the prompt D pulls; on decode alone,
        what prefilling there cost per new token."""
        if leg == DECODE:
            if turn.prompt_tokens is not None:
                self.ctx.costs.observe_hop(seconds * 1000, turn.prompt_tokens)
        elif leg == EXTEND:
            self.ctx.costs.observe_extend(seconds * 1000, turn.new_tokens)

    def _leg_failed(self, f: UpstreamFailure, t: float, leg: str
                    ) -> tuple[web.StreamResponse, str]:
        self.ctx.metrics.observe_leg(leg, "error", time.perf_counter() - t)
        if f.client_error:
            return rejected(f), "upstream_client_error"
        if f.backend_down:
            self.health.set_health(f.backend, False, f.detail or f"HTTP {f.status}")
        raise f
