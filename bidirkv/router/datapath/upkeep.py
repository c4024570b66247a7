"""The router's background work: health rounds, decode residency renewals, prefill's
drain reports, and the store's upkeep (its start, the watermark, the TTL sweep) in a
task of its own."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from bidirkv.router.datapath.context import Context
from bidirkv.router.datapath.health import Health
from bidirkv.router.datapath.modes import modes_of
from bidirkv.router.engine.clients import Clients
from bidirkv.router.pool.drain import PrefillReports, mark_draining
from bidirkv.router.store.base import StoreUnavailable, quietly

log = logging.getLogger("bidirkv.router")


async def stopped(task: asyncio.Task[None]) -> None:
    """Cancel `task` until it ends. One cancel can be lost: on Python 3.11
    `asyncio.wait_for`, which redis-py wraps every command in, drops a cancel that lands
    as the command completes, and the store loop would then wait for a health round that
    never comes again (its loop is already gone)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    with contextlib.suppress(asyncio.CancelledError):
        task.result()


class Upkeep:
    """Everything the router does besides serving a request, in two loops."""

    def __init__(self, ctx: Context, clients: Clients, health: Health) -> None:
        self.ctx = ctx
        self.clients = clients
        self.health = health
        self.health_task: asyncio.Task[None] | None = None
        self.store_task: asyncio.Task[None] | None = None
        self.wake = asyncio.Event()  # a reload added a backend: probe it now
        self._store_due = asyncio.Event()  # set after each health round
        self.prefill_reports = PrefillReports(ctx.residency.post)

    async def start(self) -> None:
        await self.start_store()
        self.health_task = asyncio.create_task(self._health_loop(), name="router-health")
        self.store_task = asyncio.create_task(self._store_loop(), name="router-store")

    async def stop(self) -> None:
        # Before the store closes: no loop may call it after that.
        for task in (self.health_task, self.store_task):
            if task is not None:
                await stopped(task)

    async def start_store(self) -> None:
        """A shared store names the owner decode keeps KV for (the same for every router
        of the store, so a restarted replica keeps the conversations), read again each
        round: after a failover to an empty replica, new routers may set another one."""
        store = self.ctx.store
        start = getattr(store, "start", None)
        if start is None:
            return
        before = store.owner
        try:
            await start()
        except StoreUnavailable as exc:
            if before is None:
                log.warning("%s; serving without reuse until it answers", exc)
            return
        if before is not None and store.owner != before:
            log.warning("the handle store names another owner (%s, was %s): a failover or "
                        "a flush lost it; decode keeps KV for the new one from now on",
                        store.owner, before)
        self.ctx.residency.owner = store.owner

    async def keep_under_watermark(self, url: str) -> None:
        """Drop the replica's oldest handles while they pin more than the watermark."""
        limit = self.ctx.max_pinned(url)
        if limit is not None:
            await quietly(self.ctx.store.trim_replica(url, limit))

    async def renew_residency(self) -> None:
        """Renew this router's lease on every healthy decode; learn their capacity and
        which are draining. No store call here: a slow store must never make a renewal
        late (decode would free every conversation of this router)."""
        ctx = self.ctx
        if not modes_of(ctx.cfg).bidirectional:
            return
        session = self.clients.pooled
        healthy = ctx.decode.healthy()
        await asyncio.gather(*(ctx.residency.call(session, b.url) for b in healthy))
        for b in mark_draining(healthy, lambda url: ctx.residency.replica(url).last):
            log.info("decode %s %s", b.url, "is draining: no new work, its conversations "
                     "move on their next turn" if b.draining else "no longer drains")

    async def learn_prefill_drain(self) -> None:
        """Ask each healthy prefill whether it drains (a report-only call: prefill holds
        no lease), so a leaving prefill gets no new legs while another can take them, and
        its drain ends once its legs in flight are done. In every mode: each turn has a
        prefill leg."""
        ctx = self.ctx
        reports = self.prefill_reports
        reports.keep_only(b.url for b in ctx.prefill.backends)
        healthy = ctx.prefill.healthy()
        session = self.clients.pooled
        await asyncio.gather(*(reports.ask(session, b.url) for b in healthy))
        for b in mark_draining(healthy, reports.last.get):
            log.info("prefill %s %s", b.url, "is draining: no new legs while another "
                     "prefill is healthy" if b.draining else "no longer drains")

    async def store_upkeep(self) -> None:
        """What the store needs after a health round: its start (a shared store names the
        owner), the TTL sweep, each healthy decode's watermark and pinned count, the count."""
        ctx = self.ctx
        await self.start_store()
        # The sweep first: what expired should not count against the watermark.
        await quietly(ctx.store.sweep())
        if modes_of(ctx.cfg).bidirectional:
            for b in ctx.decode.healthy():
                await self.keep_under_watermark(b.url)
                pinned = await quietly(ctx.store.pinned(b.url))
                ctx.metrics.export_residency(b.url, ctx.residency.replica(b.url), pinned)
        count = await quietly(ctx.store.count())
        if count is not None:
            ctx.metrics.handles.set(count)
        ctx.metrics.store_up.set(1 if ctx.store.available else 0)

    async def _health_loop(self) -> None:
        while True:
            self.wake.clear()
            try:
                await self.health.check_health()
                await self.health.learn_model_len()
                await self.renew_residency()
                await self.learn_prefill_drain()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad round
                log.exception("health check round failed")
            self._store_due.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(),
                                       self.ctx.cfg.health_check_interval_seconds)

    async def _store_loop(self) -> None:
        """Store upkeep in a task of its own, after each health round (its capacities
        are fresh then), so however long a store call takes, renewals stay on time."""
        while True:
            await self._store_due.wait()
            self._store_due.clear()
            try:
                await self.store_upkeep()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad round
                log.exception("handle store upkeep failed")
