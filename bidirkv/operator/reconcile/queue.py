"""When each resource is reconciled: its triggers coalesced into at most one pass waiting,
one pass running at a time, a failed pass retried with exponential backoff, and while its
pods drain a pass at their next deadline (a drain that runs out changes no StatefulSet)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

log = logging.getLogger("bidirkv.operator")


class PassQueue:
    def __init__(self, owners: Mapping[str, dict[str, Any]],
                 run: Callable[[dict[str, Any]], Awaitable[None]], max_backoff: float):
        """`owners`: the resources by uid, kept by the controller (a uid gone from it gets
        no more passes); `run`: one pass over a resource's body."""
        self._owners = owners
        self._pass = run
        self.max_backoff = max_backoff
        self._pending: dict[str, asyncio.TimerHandle | asyncio.Task] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._failures: dict[str, int] = {}
        # The next look at draining pods, outside `_pending` so that `idle` does not wait
        # for drains.
        self._drain_looks: dict[str, asyncio.TimerHandle] = {}

    def schedule(self, uid: str, delay: float) -> None:
        """Coalesce triggers: at most one reconcile of a resource is waiting."""
        if uid in self._pending:
            return
        loop = asyncio.get_running_loop()
        self._pending[uid] = loop.call_later(delay, self._start, uid)

    def look_again(self, uid: str, delay: float | None) -> None:
        """A pass in `delay` s (drainwatch.next_look), in place of the one set before;
        None: none."""
        look = self._drain_looks.pop(uid, None)
        if look is not None:
            look.cancel()
        if delay is not None:
            self._drain_looks[uid] = asyncio.get_running_loop().call_later(
                delay, self._drain_look, uid)

    def forget(self, uid: str) -> None:
        """No pass waits for the resource any more (it is deleted)."""
        self._cancel(uid)
        self.look_again(uid, None)

    def _drain_look(self, uid: str) -> None:
        self._drain_looks.pop(uid, None)
        if uid in self._owners:
            self.schedule(uid, 0)

    def _start(self, uid: str) -> None:
        self._pending[uid] = asyncio.get_running_loop().create_task(self._run(uid))

    def _cancel(self, uid: str) -> None:
        pending = self._pending.pop(uid, None)
        if pending is not None:
            pending.cancel()

    async def _run(self, uid: str) -> None:
        lock = self._locks.setdefault(uid, asyncio.Lock())
        async with lock:
            # Triggers arriving from here on schedule a new pass.
            self._pending.pop(uid, None)
            body = self._owners.get(uid)
            if body is None:
                return
            try:
                await self._pass(body)
                self._failures.pop(uid, None)
            except Exception as exc:  # noqa: BLE001 - any failure is retried with backoff
                n = self._failures[uid] = self._failures.get(uid, 0) + 1
                delay = min(self.max_backoff, 0.5 * 2 ** (n - 1))
                log.warning("reconcile of %s failed (%s); retrying in %.1fs",
                            body["metadata"]["name"], exc, delay)
                if uid in self._owners and uid not in self._pending:
                    self.schedule(uid, delay)

    async def idle(self, timeout: float = 30.0) -> None:
        """Wait until no reconcile is pending or running (tests, benchmarks)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._pending or any(lock.locked() for lock in self._locks.values()):
            if loop.time() > deadline:
                raise TimeoutError("reconciles still pending")
            await asyncio.sleep(0.02)

    def close(self) -> None:
        for uid in list(self._pending):
            self._cancel(uid)
        for look in self._drain_looks.values():
            look.cancel()
        self._drain_looks.clear()
