"""Backend health (probes, and what a failed leg says about its engine), the serving mode
it makes (disaggregated, prefill-only, unavailable), and the model's context length,
learned from prefill."""

from __future__ import annotations

import asyncio
import logging

from bidirkv.router.codec import loads
from bidirkv.router.datapath.context import Context
from bidirkv.router.datapath.modes import modes_of
from bidirkv.router.engine.bodies import model_len
from bidirkv.router.engine.clients import Clients
from bidirkv.router.engine.failures import UPSTREAM_FAILURES, classify
from bidirkv.router.pool.backends import DECODE, Backend
from bidirkv.router.store.base import quietly

log = logging.getLogger("bidirkv.router")

DISAGGREGATED = "disaggregated"
PREFILL_ONLY = "prefill-only"
UNAVAILABLE = "unavailable"


def serving_mode(ctx: Context) -> tuple[str, str | None]:
    """(mode, why it is not disaggregated); prefill-only: flow.py."""
    if not ctx.prefill.healthy():
        return UNAVAILABLE, "no healthy prefill engine"
    if ctx.decode.healthy():
        return DISAGGREGATED, None
    if modes_of(ctx.cfg).prefill_only_fallback:
        return PREFILL_ONLY, ("no healthy decode engine: prefill serves whole requests, "
                              "without KV reuse")
    return UNAVAILABLE, "no healthy decode engine (prefillOnlyFallback is off)"


def recalling(ctx: Context) -> list[str]:
    """The healthy decode replicas a starting router still recalls its handles from
    (pool/recall.py): `/ready` waits for them, within the recall's bound."""
    if ctx.recall is None or not modes_of(ctx.cfg).bidirectional:
        return []  # no recall: a shared store keeps the handles, or no reuse at all
    return ctx.recall.waiting(b.url for b in ctx.decode.healthy())


class Health:
    """Which backends are in service; every part that sees an engine fail reports it here."""

    def __init__(self, ctx: Context, clients: Clients) -> None:
        self.ctx = ctx
        self.clients = clients
        for b in ctx.backends():
            self.export(b)
        self.export_mode()

    def export(self, b: Backend) -> None:
        self.ctx.metrics.backend_healthy.labels(b.role, b.url).set(1 if b.healthy else 0)

    def export_mode(self) -> None:
        """The prefill-only gauge, after anything that can change the mode: a health
        change here, replicas or prefillOnlyFallback changed by a reload (proxy.py)."""
        mode = serving_mode(self.ctx)[0]
        self.ctx.metrics.prefill_only_mode.set(1 if mode == PREFILL_ONLY else 0)

    def set_health(self, b: Backend, ok: bool, why: str) -> None:
        if b.healthy == ok or not b.in_pool:
            return
        b.healthy = ok
        self.export(b)
        self.export_mode()
        if ok:
            log.info("backend healthy role=%s url=%s", b.role, b.url)
            return
        if b.role == DECODE:
            # Its blocks may be gone (restart) or unreachable: handing them to P would
            # only buy a failed read and a retry.
            self.ctx.spawn(quietly(self.ctx.store.drop_replica(b.url, "replica_unhealthy")))
        log.warning("backend unhealthy role=%s url=%s why=%s", b.role, b.url, why)

    async def _probe(self, b: Backend) -> None:
        try:
            async with self.clients.pooled.get(b.url + "/health",
                                               timeout=self.ctx.client_timeouts.probe) as r:
                await r.read()
                ok, why = r.status == 200, f"health status {r.status}"
        except UPSTREAM_FAILURES as exc:
            ok, why = False, f"health check {classify(exc)[1]}"
        self.set_health(b, ok, why)

    async def check_health(self) -> None:
        backends = self.ctx.backends()
        await asyncio.gather(*(self._probe(b) for b in backends))
        for b in backends:
            self.ctx.metrics.backend_outstanding.labels(b.role, b.url).set(b.outstanding)

    async def learn_model_len(self) -> None:
        """Once per router (and after a reload): the model's max_model_len from P."""
        ctx = self.ctx
        if ctx.max_model_len is not None:
            return
        for b in ctx.prefill.healthy():
            try:
                async with self.clients.pooled.get(b.url + "/v1/models",
                                                   timeout=ctx.client_timeouts.probe) as r:
                    data = loads(await r.read()) if r.status == 200 else None
            except (*UPSTREAM_FAILURES, ValueError):
                continue
            ctx.max_model_len = model_len(data, ctx.cfg.model)
            if ctx.max_model_len is not None:
                return
