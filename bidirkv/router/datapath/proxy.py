"""The router: the parts of the data path built once, around one `Context`; its start, its
close and a reload. A client request's turn runs in flow.py (`Flow.serve`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

from aiohttp import web

from bidirkv.router.config import RouterConfig
from bidirkv.router.datapath.admission import Intake
from bidirkv.router.datapath.context import Context
from bidirkv.router.datapath.conversations import Conversations
from bidirkv.router.datapath.flow import MODELS, Flow, Runner
from bidirkv.router.datapath.health import Health
from bidirkv.router.datapath.legs import Legs
from bidirkv.router.datapath.placing import Placing
from bidirkv.router.datapath.relay import Relay
from bidirkv.router.datapath.upkeep import Upkeep
from bidirkv.router.engine.bodies import PATHS
from bidirkv.router.engine.clients import Clients, client_timeouts
from bidirkv.router.metrics import Metrics
from bidirkv.router.pool.backends import DECODE
from bidirkv.router.pool.residency import SHUTDOWN_FLUSH_S
from bidirkv.router.store.base import quietly
from bidirkv.router.tracing.spans import Untraced, replace, traced

log = logging.getLogger("bidirkv.router")


class Router:
    """One router: its parts, built once. What the parts share is the `Context`; each part
    gets it, and the parts it calls, when it is built, and one request's state travels
    as its `Turn`."""

    def __init__(self, cfg: RouterConfig, metrics: Metrics | None = None,
                 handle_key: bytes | None = None, store_password: str | None = None) -> None:
        self.ctx = ctx = Context(cfg, metrics, handle_key, store_password)
        self.clients = Clients(ctx.metrics)
        self.health = Health(ctx, self.clients)
        self.upkeep = Upkeep(ctx, self.clients, self.health)
        self.conversations = Conversations(ctx)
        self.intake = Intake(ctx)
        placing = Placing(ctx)
        legs = Legs(ctx, self.clients, self.health, Relay(ctx, self.health))
        self.runner = Runner(ctx, self.clients, self.health, placing, legs)
        self.flow = Flow(ctx, self.intake, self.conversations, placing, self.runner)

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
        ctx.client_timeouts = client_timeouts(cfg)
        ctx.residency.lease_seconds = cfg.owner_lease_seconds
        ctx.residency.timeout = ctx.client_timeouts.probe
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
            resp, _ = await self.flow.serve(request, kind, trace, t0)
            return resp
        resp, _ = await traced(trace, functools.partial(self.flow.serve, request, kind,
                                                        trace, t0))
        return resp

    async def handle_models(self, request: web.Request) -> web.StreamResponse:
        trace = self.ctx.traces.request(request.method, MODELS, request.headers)
        resp, outcome = await traced(trace, lambda: self.runner.models(request, trace))
        self.ctx.metrics.request("models", outcome)
        return resp
