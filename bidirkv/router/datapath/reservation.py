"""A turn's single-use handle, from the store's lookup to its one end, and the reuse
outcome that follows from it.

The store hands an entry out once (`lookup` reserves it); it must then end exactly once,
and every end is written here:
- consumed: P answered with it (P read, and so freed, D's blocks or refused them);
- discarded: a leg with it failed, or the whole turn ran on decode (the handle is not
  P's to read and never handed out again: see flow.py's docstring);
- forgotten: the client left while P had it (P may have read: not safe to hand out);
- released: the turn ended without using it, so it goes back to the store (or, with the
  store gone, D frees its blocks now).
An entry that ends twice is a bug that would hand one handle to two turns: it raises.
"""

from __future__ import annotations

from collections.abc import Callable

from bidirkv.router.metrics import Metrics, ReuseOutcome
from bidirkv.router.pool.placement import ON_DECODE, Decision
from bidirkv.router.store.base import EXPIRED, HIT, MISS, Entry, Store, StoreUnavailable, quietly

CONSUMED = "consumed"
DISCARDED = "discarded"
FORGOTTEN = "forgotten"
RELEASED = "released"
# A lookup's status (store/base.py) as the turn's first reuse outcome.
LOOKED_UP = {HIT: ReuseOutcome.HIT, MISS: ReuseOutcome.MISS, EXPIRED: ReuseOutcome.EXPIRED}


class Reservation:
    """The handle one turn took (or none), and the turn's reuse outcome (written here
    only): hit, miss, expired, off; then dropped, verified-partial or extended as the
    handle ends."""

    __slots__ = ("entry", "reuse", "ended", "counted", "_store", "_evicted")

    def __init__(self, store: Store, evicted: Callable[[str, list[Entry]], None]) -> None:
        self.entry: Entry | None = None
        # "off" until a lookup: a turn not looked up (bidirectional off) stays off.
        self.reuse = ReuseOutcome.OFF
        # How the entry ended (one of the four above), None while it is held.
        self.ended: str | None = None
        # The reuse outcome is counted once per turn (count_once).
        self.counted = False
        self._store = store
        self._evicted = evicted

    def took(self, entry: Entry | None, status: str) -> None:
        """The store's lookup: the entry it reserved for this turn (or none), and so the
        turn's first reuse outcome (the lookup's status: hit, miss, expired)."""
        if self.entry is not None:
            raise RuntimeError("a turn takes one handle")
        self.entry, self.reuse = entry, LOOKED_UP[status]

    @property
    def held(self) -> Entry | None:
        """The entry while it is still this turn's to use, else None."""
        return self.entry if self.ended is None else None

    def _end(self, how: str) -> Entry:
        entry = self.held
        if entry is None:
            raise RuntimeError(f"handle reservation ended as {how!r} after "
                               f"{self.ended!r}, or without a handle")
        self.ended = how
        return entry

    async def consume(self, partial: bool) -> None:
        """P answered with the handle; `partial`: P reused only part of what it offered."""
        entry = self._end(CONSUMED)
        if partial:
            self.reuse = ReuseOutcome.VERIFIED_PARTIAL
        await quietly(self._store.consume(entry))

    async def discard(self, reason: str) -> None:
        """Never to be handed out again; D frees what only it held."""
        entry = self._end(DISCARDED)
        if reason != "extended":
            self.reuse = ReuseOutcome.DROPPED
        await quietly(self._store.discard(entry, reason))

    def forget(self, reason: str) -> None:
        """The client left while P had the handle: dropped without a store round trip."""
        self._store.forget(self._end(FORGOTTEN), reason)

    async def release(self) -> None:
        """Unused: back to the store; a store that cannot take it has D free it now."""
        if self.held is None:
            return
        entry = self._end(RELEASED)
        try:
            await self._store.release(entry)
        except StoreUnavailable:
            self._evicted("store_unavailable", [entry])

    def extending(self) -> None:
        """The holder itself takes the whole turn on top of what it keeps."""
        self.reuse = ReuseOutcome.EXTENDED

    @property
    def superseded(self) -> Entry | None:
        """The entry the turn's next handle replaces in the store (`Kept.replaces`): the
        one its holder is extending, while the turn still holds it."""
        return self.held if self.reuse is ReuseOutcome.EXTENDED else None

    def count_once(self, metrics: Metrics, asked_prefill: bool, placed: Decision | None
                   ) -> None:
        """The turn's reuse outcome, once: at its decode leg's first byte (a client that
        reads the counter after its answer finds it there), else when the request ends.
        Counted only for a turn that reached P (`asked_prefill`), extended, or ran whole
        on decode."""
        if self.counted or not (asked_prefill or self.reuse is ReuseOutcome.EXTENDED or (
                placed is not None and placed.path == ON_DECODE)):
            return
        metrics.reuse_outcome(self.reuse)
        self.counted = True
