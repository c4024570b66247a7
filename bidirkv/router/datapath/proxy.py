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
import functools
import logging
import time
import uuid

from aiohttp import web

from bidirkv.router.config import RouterConfig
from bidirkv.router.datapath.admission import Intake
from bidirkv.router.datapath.bodies import PATHS, upstream_headers
from bidirkv.router.datapath.context import Context, quietly, timeouts_of
from bidirkv.router.datapath.conversations import Conversations
from bidirkv.router.datapath.failures import (
    UPSTREAM_FAILURES,
    classify,
    unavailable,
)
from bidirkv.router.datapath.health import PREFILL_ONLY, Health, serving_mode
from bidirkv.router.datapath.legs import Legs
from bidirkv.router.datapath.placing import Placing
from bidirkv.router.datapath.relay import Relay
from bidirkv.router.datapath.replies import json_response
from bidirkv.router.datapath.sessions import Clients
from bidirkv.router.datapath.tracing import Trace, Untraced, replace, traced
from bidirkv.router.datapath.upkeep import Upkeep
from bidirkv.router.metrics import Metrics
from bidirkv.router.pool.backends import DECODE, Backend
from bidirkv.router.pool.residency import SHUTDOWN_FLUSH_S
from bidirkv.router.pool.selection import least_outstanding

MODELS = "/v1/models"
log = logging.getLogger("bidirkv.router")


class Router:
    """One router: a request's flow starts here (`handle_generate` -> `Intake.admit` ->
    `Placing.serve`). What the parts share is the `Context`; each part
    gets it, and the parts it calls, when it is built, and one request's state travels
    as its `Turn`."""

    def __init__(self, cfg: RouterConfig, metrics: Metrics | None = None,
                 handle_key: bytes | None = None, store_password: str | None = None) -> None:
        self.ctx = ctx = Context(cfg, metrics, handle_key, store_password)
        self.clients = Clients(ctx.metrics)
        self.health = Health(ctx, self.clients)
        self.upkeep = Upkeep(ctx, self.clients, self.health)
        self.conversations = Conversations(ctx)
        self.legs = Legs(ctx, self.clients, self.health,
                         Relay(ctx, self.health, self.conversations))
        self.intake = Intake(ctx, self.conversations)
        self.placing = Placing(ctx, self.conversations, self.legs)

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        session = self.clients.open()
        await self.upkeep.start()
        self.ctx.residency.start(session)

    async def close(self) -> None:
        self.ctx.cancel_tasks()
        await self.upkeep.stop()
        # After the loops that queue releases (the store's upkeep), before the session
        # closes: what the last turns left for decode goes out, within its bound.
        await self.ctx.residency.close(flush_s=SHUTDOWN_FLUSH_S)
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
        if isinstance(trace, Untraced):  # no span to end (tracing off, the default)
            resp, _ = await self.intake.admit(request, kind, trace, t0, self.placing.serve)
            return resp
        resp, _ = await traced(trace, functools.partial(self.intake.admit, request, kind,
                                                        trace, t0, self.placing.serve))
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
        pool = ctx.prefill if serving_mode(ctx)[0] == PREFILL_ONLY else ctx.decode
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
