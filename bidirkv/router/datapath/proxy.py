"""The data path: one client request = a prefill leg on P, then a decode leg on D.

See docs/protocol.md (sections 1, 2 and 4). Decisions where the protocol is silent:
- A handle is reserved at lookup and spent only when P answered (single use). If P fails
  with a handle, the handle is discarded, not put back: P may have read (and so freed)
  D's blocks before failing, and a handle that made P fail would make the next turn fail
  too. The turn is retried once without it; its own decode leg stores a fresh handle.
- D failing before the client got a byte is retried once on another decode replica with
  a fresh prefill leg (no handle: the first one is spent). P's blocks from the first
  prefill are not reused: the failed D may have read (so freed) them or not, and the
  router cannot tell. A retry uses `<request id>-retry1` on both its legs, so it never
  collides with the first attempt's request id inside an engine.
- A 4xx from an engine is the client's problem and is returned as is. Connection errors
  and 5xx take the backend out until its next good health check, except a 5xx from P on
  a reuse turn (the handle, not P, is the likely cause).
- Upstream `Authorization` is the client's own header, so engines started with --api-key
  check the same credential.
- A stale kept-alive connection to P is retried on P itself (bidirkv/router/datapath/sessions.py);
  with no healthy decode, P serves whole requests (bidirkv/router/datapath/prefillonly.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid

from aiohttp import web

from bidirkv.router.config import RouterConfig
from bidirkv.router.datapath.bodies import PATHS, upstream_headers
from bidirkv.router.datapath.context import Context, quietly, timeouts_of
from bidirkv.router.datapath.conversations import Conversations
from bidirkv.router.datapath.failures import (
    UPSTREAM_FAILURES,
    Unavailable,
    UpstreamFailure,
    classify,
    failure_response,
    outcome_of,
    rejected,
    unavailable,
)
from bidirkv.router.datapath.health import PREFILL_ONLY, UNAVAILABLE, Health, serving_mode
from bidirkv.router.datapath.legs import Legs
from bidirkv.router.datapath.prefillonly import serve_on_prefill
from bidirkv.router.datapath.replies import json_error, json_response
from bidirkv.router.datapath.sessions import Clients
from bidirkv.router.datapath.tracing import Trace, replace, traced
from bidirkv.router.datapath.turn import Turn, count_reuse, trace_attributes
from bidirkv.router.datapath.upkeep import Upkeep
from bidirkv.router.metrics import Metrics
from bidirkv.router.pool.backends import DECODE, PREFILL, Backend, Pool
from bidirkv.router.pool.placement import (
    ALWAYS_DISAGGREGATE,
    EXTEND,
    MOVE,
    ON_DECODE,
    Decision,
    Inputs,
    new_tokens,
    place,
    prompt_chars,
)
from bidirkv.router.pool.placement import PREFILL as PREFILL_PATH
from bidirkv.router.pool.residency import ResidencyClient
from bidirkv.router.pool.selection import holder_of, least_outstanding, pick_decode
from bidirkv.router.request.identity import LookupKeys, short_hash
from bidirkv.router.request.validation import ClientError, parse_request
from bidirkv.router.store.base import Store, StoreUnavailable

# Bodies above this take their parse and hashing steps one at a time (_admitted).
BIG_BODY_BYTES = 256 * 1024
MODELS = "/v1/models"
log = logging.getLogger("bidirkv.router")
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


class Router:
    """One router: the request flow reads top to bottom here (`handle_generate` ->
    `_run`). What the parts share is the `Context`; each part gets it, and the parts it
    calls, when it is built, and one request's state travels as its `Turn`."""

    def __init__(self, cfg: RouterConfig, metrics: Metrics | None = None,
                 handle_key: bytes | None = None, store_password: str | None = None) -> None:
        self.ctx = ctx = Context(cfg, metrics, handle_key, store_password)
        self.clients = Clients(ctx.metrics)
        self.health = Health(ctx, self.clients)
        self.upkeep = Upkeep(ctx, self.clients, self.health)
        self.conversations = Conversations(ctx)
        self.legs = Legs(ctx, self.clients, self.health, self.conversations)
        # Admission (handle_generate): requests and body bytes in flight.
        self.inflight = 0
        self.inflight_bytes = 0
        self._big_bodies = asyncio.Lock()

    # What the server's routes and the tests read of the shared state.
    @property
    def cfg(self) -> RouterConfig:
        return self.ctx.cfg

    @property
    def store(self) -> Store:
        return self.ctx.store

    @property
    def prefill(self) -> Pool:
        return self.ctx.prefill

    @property
    def decode(self) -> Pool:
        return self.ctx.decode

    @property
    def residency(self) -> ResidencyClient:
        return self.ctx.residency

    @property
    def metrics(self) -> Metrics:
        return self.ctx.metrics

    @property
    def keys(self) -> LookupKeys:
        return self.ctx.keys

    def backends(self) -> list[Backend]:
        return self.ctx.backends()

    def serving_mode(self) -> tuple[str, str | None]:
        return serving_mode(self.ctx)

    def ready(self) -> bool:
        return self.serving_mode()[0] != UNAVAILABLE

    async def end_conversation(self, tenant: bytes, conversation_id: str) -> bool:
        return await self.conversations.end_conversation(tenant, conversation_id)

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        session = self.clients.open()
        await self.upkeep.start()
        self.ctx.residency.start(session)

    async def close(self) -> None:
        await self.ctx.residency.close()
        self.ctx.cancel_tasks()
        await self.upkeep.stop()
        await self.ctx.store.close()
        await self.clients.close()
        await self.ctx.traces.close()

    def apply_config(self, cfg: RouterConfig) -> None:
        """Swap in a validated config. Requests in flight keep the Backend objects and
        timeouts they started with, so a reload never fails them."""
        ctx = self.ctx
        if cfg.model != ctx.cfg.model:
            ctx.max_model_len = None  # learned again for the new model
        ctx.cfg = cfg
        ctx.traces = replace(ctx.traces, cfg.tracing)
        ctx.store.configure(cfg.handle_ttl_seconds, cfg.max_conversations,
                            cfg.max_conversations_per_tenant)
        ctx.timeouts = timeouts_of(cfg)
        ctx.residency.lease_seconds = cfg.owner_lease_seconds
        ctx.residency.timeout = ctx.timeouts.probe
        changed = False
        for pool, urls in ((ctx.prefill, cfg.prefill), (ctx.decode, cfg.decode)):
            added, removed = pool.reconcile(urls)
            for b in removed:
                with contextlib.suppress(KeyError):
                    ctx.metrics.backend_healthy.remove(b.role, b.url)
                    ctx.metrics.backend_outstanding.remove(b.role, b.url)
                if b.role == DECODE:
                    ctx.spawn(quietly(ctx.store.drop_replica(b.url, "replica_removed")))
                    ctx.residency.forget(b.url)
                log.info("backend removed role=%s url=%s", b.role, b.url)
            for b in added:
                self.health.export(b)
                log.info("backend added role=%s url=%s", b.role, b.url)
            changed = changed or bool(added)
        self.health.export_mode()  # replicas gone, or prefillOnlyFallback changed
        if changed:
            self.upkeep.wake.set()

    # -- client requests -------------------------------------------------------------
    async def handle_generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        """One client request, traced: its span ends once the response, streamed or not,
        is written (a refused body once it is drained)."""
        t0 = time.perf_counter()
        trace = self.ctx.traces.request(request.method, PATHS[kind], request.headers)
        resp, _ = await traced(trace, lambda: self._admission(request, kind, trace, t0))
        return resp

    async def _admission(self, request: web.Request, kind: str, trace: Trace, t0: float
                         ) -> tuple[web.StreamResponse, str]:
        """Admission first: at most maxInflightRequests requests and maxInflightBodyBytes
        of bodies (a body of unknown length counts as maxBodyBytes) at once; past either
        a 429 with Retry-After, before anything is read. A body is parsed into objects
        many times its size, so the bytes bound is what keeps the pod within memory."""
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
            return await self._admitted(request, kind, trace, t0)
        finally:
            self.inflight -= 1
            self.inflight_bytes -= charge

    async def _admitted(self, request: web.Request, kind: str, trace: Trace, t0: float
                        ) -> tuple[web.StreamResponse, str]:
        ctx = self.ctx
        cfg, metrics = ctx.cfg, ctx.metrics
        try:
            raw = await asyncio.wait_for(read_body(request, cfg.max_body_bytes),
                                         cfg.timeouts.body_read_seconds)
        except TimeoutError:
            metrics.request(kind, "client_error")
            return json_error(408, "request body not received within "
                              f"{cfg.timeouts.body_read_seconds:g} s "
                              "(timeouts.bodyReadSeconds)", "request_timeout"), "client_error"
        except ClientError as e:
            metrics.request(kind, "client_error")
            return await drained(request, json_error(e.status, e.message, e.type, e.param)
                                 ), "client_error"
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
                metrics.request(kind, "client_error")
                return json_error(e.status, e.message, e.type, e.param), "client_error"
            del raw
            if cfg.model is not None and "model" not in req.body:
                req.body["model"] = cfg.model
            rid = request_id(request.headers.get("X-Request-Id"))
            turn = Turn(kind, req.stream, req.body, rid, request.headers.get("Authorization"),
                        ctx.keys.tenant_of(request.headers.get(cfg.tenant_header)), t0, trace)
            if big:
                await asyncio.sleep(0)
            if cfg.bidirectional:
                if cfg.placement.policy != ALWAYS_DISAGGREGATE:  # a pass over the body
                    turn.prompt_chars = prompt_chars(req.body)
                await self.conversations.identify(turn, req.conversation_id)
            elif req.conversation_id is not None:
                turn.conv = short_hash(req.conversation_id)
        try:
            resp, outcome = await self._run(request, turn)
        except asyncio.CancelledError:
            metrics.request(kind, "cancelled")
            log.debug("request cancelled rid=%s conv=%s", rid, turn.conv)
            raise
        finally:
            if turn.entry is not None:
                entry, turn.entry = turn.entry, None
                try:
                    await ctx.store.release(entry)
                except StoreUnavailable:  # it cannot go back: D frees its blocks now
                    ctx.evicted("store_unavailable", [entry])
            count_reuse(metrics, turn)
            if trace.recording:
                trace.update(trace_attributes(turn))
        metrics.request(kind, outcome)
        log.debug("request rid=%s conv=%s kind=%s stream=%s reuse=%s outcome=%s ms=%.2f",
                  rid, turn.conv, kind, turn.stream, turn.reuse, outcome,
                  (time.perf_counter() - t0) * 1000)
        return resp, outcome

    async def _run(self, request: web.Request, turn: Turn) -> tuple[web.StreamResponse, str]:
        ctx = self.ctx
        interval = ctx.cfg.health_check_interval_seconds
        if not ctx.prefill.healthy():
            return unavailable(PREFILL, interval), "unavailable"
        if not ctx.decode.healthy() and ctx.cfg.prefill_only_fallback:
            return await serve_on_prefill(ctx, self.legs, request, turn)
        tried_decode: list[Backend] = []
        last: UpstreamFailure | None = None
        target = self._placement(turn)
        if target is not None:
            try:
                return await self._extend(request, turn, target)
            except UpstreamFailure as f:
                # Nothing reached the client: the turn takes the two legs, without the
                # handle (its holder just failed) and on another replica.
                tried_decode.append(target)
                last = f
                turn.placed = Decision(PREFILL_PATH, "extend_failed")
                self.ctx.metrics.retries.labels("extend_failed").inc()
                log.warning("the whole turn on decode failed (%s); taking the prefill leg "
                            "rid=%s conv=%s decode=%s", f.detail or f.kind, turn.rid,
                            turn.conv, target.url)
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

    def _placement(self, turn: Turn) -> Backend | None:
        """Decide where the turn runs; the decode replica that takes it whole, if one
        does. Under alwaysDisaggregate, or with bidirectional transfer off (plain P/D),
        nothing is decided: every turn takes the prefill leg."""
        ctx = self.ctx
        policy = ctx.cfg.placement
        if policy.policy == ALWAYS_DISAGGREGATE or not ctx.cfg.bidirectional:
            return None
        holder = None
        held: int | None = None
        entry = turn.entry
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
        ctx.metrics.placements.labels(decision.path, decision.reason).inc()
        if decision.path == EXTEND:
            return holder
        if decision.path == ON_DECODE:
            return least_outstanding([b for b in ctx.decode.backends if b.in_pool],
                                     ctx.decode.next_start())
        return None

    async def _extend(self, request: web.Request, turn: Turn, d: Backend
                      ) -> tuple[web.StreamResponse, str]:
        """The whole turn on `d`: the holder extending what it keeps, or a replica that
        holds none of it prefilling all of it (a handle whose holder cannot serve is of
        no use there: dropped)."""
        ctx = self.ctx
        entry, turn.entry = turn.entry, None  # not P's to read: never handed out again
        if entry is not None and entry.decode_url != d.url:
            await quietly(ctx.store.discard(entry, "reuse_failed"))
            entry, turn.reuse = None, "dropped"
        if entry is not None:
            turn.reuse = "extended"  # counted at the first byte
        try:
            resp = await self.legs.extend_leg(request, turn, d, turn.rid,
                                              entry.num_tokens if entry is not None else None)
        except BaseException:
            if entry is not None:
                turn.reuse = "dropped"
                await quietly(ctx.store.discard(entry, "extend_failed"))
            raise
        if resp[1] == "upstream_client_error":  # the client's request, refused by D
            if entry is not None:
                turn.reuse = "dropped"
                await quietly(ctx.store.discard(entry, "extend_failed"))
            return resp
        if entry is not None:
            # Superseded by the handle of this turn, which shares its blocks on D (its
            # prefix cache): D frees what only the old request held.
            await quietly(ctx.store.discard(entry, "extended"))
        return resp

    # -- other routes ------------------------------------------------------------------
    async def handle_models(self, request: web.Request) -> web.StreamResponse:
        trace = self.ctx.traces.request(request.method, MODELS, request.headers)
        resp, outcome = await traced(trace, lambda: self._models(request, trace))
        self.ctx.metrics.request("models", outcome)
        return resp

    async def _models(self, request: web.Request, trace: Trace
                      ) -> tuple[web.StreamResponse, str]:
        ctx = self.ctx
        tried: list[Backend] = []
        pool = ctx.prefill if self.serving_mode()[0] == PREFILL_ONLY else ctx.decode
        while True:
            d = least_outstanding(pool.backends, pool.next_start(), tried)
            if d is None:
                return unavailable(pool.role, ctx.cfg.health_check_interval_seconds), \
                    "unavailable"
            span = trace.leg("models", d.url, MODELS, "GET")
            try:
                async with self.clients.pooled.get(
                        d.url + MODELS, timeout=ctx.timeouts.prefill,
                        headers=upstream_headers(uuid.uuid4().hex,
                                                 request.headers.get("Authorization"),
                                                 span.headers)) as r:
                    body, status = await r.read(), r.status
            except UPSTREAM_FAILURES as exc:
                kind, detail = classify(exc)
                span.end(kind)
                self.health.set_health(d, False, detail)
                tried.append(d)
                continue
            except asyncio.CancelledError:
                span.end("cancelled")
                raise
            if status >= 500:
                span.end("status", status)
                self.health.set_health(d, False, f"HTTP {status}")
                tried.append(d)
                continue
            span.end("ok" if status == 200 else "upstream_client_error", status)
            return json_response(status, body), \
                "ok" if status == 200 else "upstream_client_error"
