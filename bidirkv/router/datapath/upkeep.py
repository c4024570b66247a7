"""Backend health, the model's context length, decode residency renewals, and the store's
upkeep (its start, the watermark, the TTL sweep) in a task of its own.

Part of `Router` (bidirkv/router/datapath/proxy.py), which holds the state these methods use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from bidirkv.router.codec import loads
from bidirkv.router.datapath.upstream import UPSTREAM_FAILURES, classify, model_len
from bidirkv.router.pool.backends import DECODE, Backend
from bidirkv.router.store.handles import Entry

log = logging.getLogger("bidirkv.router")


class Upkeep:
    """Backend health, the model's context length, decode residency renewals and the
    watermark: everything the router does besides serving a request."""

    def _on_evict(self, reason: str, entries: list[Entry]) -> None:
        self.metrics.evictions.labels(reason).inc(len(entries))
        self.residency.release(reason, entries)

    def _on_store_error(self, op: str) -> None:
        self.metrics.store_errors.labels(op).inc()

    def _on_residency_call(self, url: str, result: str, released: int) -> None:
        self.metrics.residency_calls.labels(result).inc()
        if released:
            self.metrics.releases_sent.labels(result).inc(released)

    def max_pinned(self, url: str) -> int | None:
        """Blocks this router's handles may pin on a replica (None: capacity unknown)."""
        total = self.residency.capacity(url)
        return None if total is None else int(self.cfg.retention_watermark * total)

    async def keep_under_watermark(self, url: str) -> None:
        """Drop the replica's oldest handles while they pin more than the watermark."""
        limit = self.max_pinned(url)
        if limit is not None:
            await self._quietly(self.store.trim_replica(url, limit))

    def _export_health(self, b: Backend) -> None:
        self.metrics.backend_healthy.labels(b.role, b.url).set(1 if b.healthy else 0)

    def set_health(self, b: Backend, ok: bool, why: str) -> None:
        if b.healthy == ok or not b.in_pool:
            return
        b.healthy = ok
        self._export_health(b)
        if ok:
            log.info("backend healthy role=%s url=%s", b.role, b.url)
            return
        if b.role == DECODE:
            # Its blocks may be gone (restart) or unreachable: handing them to P would
            # only buy a failed read and a retry.
            self._background(self._quietly(
                self.store.drop_replica(b.url, "replica_unhealthy")))
        log.warning("backend unhealthy role=%s url=%s why=%s", b.role, b.url, why)

    async def _probe(self, b: Backend) -> None:
        assert self.session is not None
        try:
            async with self.session.get(b.url + "/health", timeout=self._t_probe) as r:
                await r.read()
                ok, why = r.status == 200, f"health status {r.status}"
        except UPSTREAM_FAILURES as exc:
            ok, why = False, f"health check {classify(exc)[1]}"
        self.set_health(b, ok, why)

    async def check_health(self) -> None:
        await asyncio.gather(*(self._probe(b) for b in self.backends()))
        for b in self.backends():
            self.metrics.backend_outstanding.labels(b.role, b.url).set(b.outstanding)

    async def learn_model_len(self) -> None:
        """Once per router (and after a reload): the model's max_model_len from P."""
        if self.max_model_len is not None:
            return
        assert self.session is not None
        for b in self.prefill.healthy():
            try:
                async with self.session.get(b.url + "/v1/models", timeout=self._t_probe) as r:
                    data = loads(await r.read()) if r.status == 200 else None
            except (*UPSTREAM_FAILURES, ValueError):
                continue
            self.max_model_len = model_len(data, self.cfg.model)
            if self.max_model_len is not None:
                return

    async def renew_residency(self) -> None:
        """Renew this router's lease on every healthy decode; learn their capacity. No
        store call here: a slow store must never make a renewal late (decode would free
        every conversation of this router)."""
        if not self.cfg.bidirectional:
            return
        assert self.session is not None
        healthy = self.decode.healthy()
        await asyncio.gather(*(self.residency.call(self.session, b.url) for b in healthy))

    async def store_upkeep(self) -> None:
        """What the store needs after a health round: its start (a shared store names the
        owner), each healthy decode's watermark and pinned count, the TTL sweep, the count."""
        await self._start_store()
        if self.cfg.bidirectional:
            for b in self.decode.healthy():
                await self.keep_under_watermark(b.url)
                pinned = await self._quietly(self.store.pinned(b.url))
                self.metrics.export_residency(b.url, self.residency.replica(b.url), pinned)
        await self._quietly(self.store.sweep())
        count = await self._quietly(self.store.count())
        if count is not None:
            self.metrics.handles.set(count)
        self.metrics.store_up.set(1 if self.store.available else 0)

    async def _health_loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.check_health()
                await self.learn_model_len()
                await self.renew_residency()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad round
                log.exception("health check round failed")
            self._store_due.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(),
                                       self.cfg.health_check_interval_seconds)

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
