"""The in-process handle store (`InProcessStore`): one router replica, the default.

A handle points at blocks D pins for `decoder_kv_blocks_ttl`: it is worth something only
until then, and only once (P's read frees them on D). So the store is a TTL map bounded
by evicting the oldest stored entry first (every turn replaces its conversation's entry:
"oldest stored" is "least recently active"; a lookup does not refresh it, a hit is spent
at once), with a reservation step: a reserved entry is invisible to other lookups, so
two concurrent turns of one conversation never send the same handle twice. The rules
are the store's (base.py); `Index` (index.py) holds what they look entries up by."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from bidirkv.returns import next_gap
from bidirkv.router.store.base import (
    EXPIRED,
    HIT,
    MISS,
    Entry,
    EvictHook,
    Kept,
    PrefixKeys,
    rank_gap,
)
from bidirkv.router.store.index import Expiries, Index


class InProcessStore:
    """The router process's own store (see base.py for the rules)."""

    owner: str | None = None
    available = True

    def __init__(self, ttl_seconds: float, max_entries: int,
                 on_evict: EvictHook | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.ix = Index()
        self.ttl = ttl_seconds
        self.max_entries = max_entries
        self.max_per_tenant: int | None = None
        self._clock = clock
        self._wall = wall  # what Entry.kept_at is on
        self._on_evict = on_evict
        # The gap a handle without one is ranked by (a moving average of the gaps stored).
        self.prior_gap: float | None = None
        # Reserved entries an extend's put took out of the indexes (Kept.replaces): no
        # longer counted, but still a turn's to end, and so to hand to `on_evict`.
        self._superseded: set[Entry] = set()
        self._early = Expiries()  # handles stored with less than the TTL left

    def __len__(self) -> int:
        return len(self.ix.entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(list(self.ix.entries.values()))

    def peek(self, key: bytes) -> Entry | None:
        """The entry under `key`, left where it is, live or not (pool/recall.py)."""
        return self.ix.entries.get(key)

    def configure(self, ttl_seconds: float, max_entries: int,
                  max_per_tenant: int | None = None) -> None:
        # A shorter TTL is for new entries: stored ones keep theirs (valid when given).
        self.ttl = ttl_seconds
        self.max_entries = max_entries
        self.max_per_tenant = max_per_tenant
        self._trim()
        for tenant in list(self.ix.by_tenant):
            self._trim_tenant(tenant)

    def _evicted(self, reason: str, entries: list[Entry]) -> None:
        if self._on_evict is not None and entries:
            self._on_evict(reason, entries)

    def _drop(self, reason: str, doomed: list[Entry]) -> int:
        gone = [e for e in doomed if self.ix.remove(e)]  # each once, if still stored
        self._evicted(reason, gone)
        return len(gone)

    # -- writes and the bounds ------------------------------------------------------------
    async def put(self, kept: Kept) -> None:
        """An extend's put (`kept.replaces`) takes the old handle out of the counts
        first and spares the new one from its own bounds (see Kept)."""
        now, wall = self._clock(), self._wall()
        left = kept.time_left(self.ttl, wall)
        entry = Entry.of(kept, now + left, wall)
        if left <= 0:  # a recalled handle already past its TTL: released, never counted
            return self._evicted("ttl", [entry])
        if left < self.ttl:  # kept earlier: it expires before handles stored before it
            self._early.add(entry)
        ix, replaces = self.ix, kept.replaces
        if replaces is not None and ix.remove(replaces):
            self._superseded.add(replaces)
        old = ix.entries.get(kept.key)
        if old is not None:
            self._drop("replaced", [old])
        if kept.gap is not None:
            self.prior_gap = next_gap(self.prior_gap, kept.gap)
        ix.add(entry, rank_gap(entry, self.prior_gap), wall + entry.expires_at - now)
        spare = entry if replaces is not None else None
        # Each bound's total is at hand: a bound costs a put only when it is over it.
        if len(ix.entries) > self.max_entries:
            self._trim(spare)
        cap = self.max_per_tenant
        if cap is not None and ix.tenant_entries.get(kept.tenant) > cap:
            self._trim_tenant(kept.tenant, spare)
        url = kept.decode_url
        if kept.tenant_max_pinned is not None:
            self._trim_tenant_replica(url, kept.tenant, kept.tenant_max_pinned, spare)
        if kept.max_pinned is not None and ix.pinned(url) > kept.max_pinned:
            self._trim_replica(url, kept.max_pinned, "watermark", spare)

    def _trim(self, spare: Entry | None = None) -> None:
        """The entry bound (never `spare`)."""
        doomed = []
        while len(self.ix.entries) > self.max_entries:
            old = self.ix.oldest(spare)
            if old is None:
                break
            self.ix.remove(old)
            doomed.append(old)
        self._evicted("lru", doomed)

    def _trim_tenant(self, tenant: bytes | None, spare: Entry | None = None) -> None:
        """The tenant's own entry cap: its oldest unreserved entries go first, chosen
        before any is removed, so a put costs what it drops, not the tenant's size."""
        if self.max_per_tenant is None:
            return
        excess = self.ix.tenant_entries.get(tenant) - self.max_per_tenant
        doomed: list[Entry] = []
        for entry in self.ix.by_tenant.get(tenant, {}).values():
            if excess <= 0:
                break
            if not entry.reserved and entry is not spare:
                doomed.append(entry)
                excess -= 1
        self._drop("tenant_cap", doomed)

    def _trim_tenant_replica(self, url: str, tenant: bytes | None, max_blocks: int,
                             spare: Entry | None = None) -> None:
        """The tenant's unreserved handles on the replica, expected back last first,
        until it pins at most `max_blocks` there."""
        tally = self.ix.rep_blocks.get(url)
        excess = (tally.get(tenant) if tally is not None else 0) - max_blocks
        doomed, now = [], self._wall()
        while excess > 0:  # one that pins nothing would free nothing: passed over
            victim = self.ix.victim(url, tenant, now,
                                    lambda e: e.reserved or not e.blocks or e is spare)
            if victim is None:
                break
            self.ix.remove(victim)
            doomed.append(victim)
            excess -= victim.blocks
        self._evicted("tenant_cap", doomed)

    async def trim_replica(self, decode_url: str, max_blocks: int,
                           reason: str = "watermark") -> int:
        return self._trim_replica(decode_url, max_blocks, reason)

    def _trim_replica(self, decode_url: str, max_blocks: int, reason: str,
                      spare: Entry | None = None) -> int:
        """Drop unreserved handles of the replica (never `spare`) until it pins at most
        `max_blocks`."""
        ix, doomed, now = self.ix, [], self._wall()

        def skip(e: Entry) -> bool:
            return e.reserved or e is spare
        while ix.pinned(decode_url) > max_blocks:
            victim = ix.block_victim(decode_url, now, skip, self.prior_gap)
            if victim is None:
                break
            ix.remove(victim)
            doomed.append(victim)
        self._evicted(reason, doomed)
        return len(doomed)

    # -- the reservation protocol ----------------------------------------------------------
    async def lookup(self, key: bytes) -> tuple[str, Entry | None]:
        """(HIT, reserved entry) or (MISS | EXPIRED, None)."""
        entry = self.ix.entries.get(key)
        if entry is None or entry.reserved:
            return MISS, None
        if entry.expires_at <= self._clock():
            self._drop("ttl", [entry])
            return EXPIRED, None
        entry.reserved = True
        return HIT, entry

    async def look(self, key: bytes) -> Entry | None:
        entry = self.ix.entries.get(key)
        return entry if entry is not None and entry.expires_at > self._clock() else None

    async def lookup_prefix(self, tenant: bytes, text: str, key_of: PrefixKeys
                            ) -> tuple[str, Entry | None]:
        """Longest stored prompt prefix of `text` for `tenant`.

        `key_of(text, lengths)` yields (length, key) for the candidate lengths, longest
        first; only lengths some entry was stored at are hashed, so the cost is bounded by
        the prompt's length, not by the number of stored conversations.
        """
        lengths = self.ix.lengths.get(tenant)
        candidates = lengths.up_to(len(text)) if lengths is not None else []
        if not candidates:
            return MISS, None
        outcome = MISS
        for _, key in key_of(text, candidates):
            status, entry = await self.lookup(key)
            if status == HIT:
                return HIT, entry
            if status == EXPIRED:
                outcome = EXPIRED
        return outcome, None

    async def release(self, entry: Entry) -> None:
        """P was never asked: the handle is still good for the next attempt, unless an
        extend's handle took its place."""
        if self._ended_superseded(entry):
            self._evicted("replaced", [entry])
        entry.reserved = False

    async def consume(self, entry: Entry) -> None:
        """P read the blocks; D has freed them, the handle is spent."""
        self.ix.remove(entry)
        self._ended_superseded(entry)

    async def discard(self, entry: Entry, reason: str) -> None:
        self.forget(entry, reason)

    def forget(self, entry: Entry, reason: str) -> None:
        if self.ix.remove(entry) or self._ended_superseded(entry):
            self._evicted(reason, [entry])

    def _ended_superseded(self, entry: Entry) -> bool:
        """Whether `entry` was superseded by an extend and not yet ended (now it is)."""
        ended = entry in self._superseded
        self._superseded.discard(entry)
        return ended

    async def end(self, key: bytes) -> bool:
        """The client ended the conversation: drop its handle (reserved or not)."""
        entry = self.ix.entries.get(key)
        if entry is not None:
            self._drop("ended", [entry])
        return entry is not None

    # -- bulk drops --------------------------------------------------------------------------
    async def drop_replica(self, decode_url: str, reason: str,
                           keep_engine_id: str | None = None) -> int:
        """Drop every handle of one decode replica (except those of `keep_engine_id`)."""
        if decode_url not in self.ix.orders:
            return 0
        return self._drop(reason, [
            e for e in self.ix.entries.values() if e.decode_url == decode_url
            and (keep_engine_id is None or e.engine_id != keep_engine_id)])

    async def sweep(self) -> int:
        """Drop expired entries: in store order, which is (nearly) expiry order, until the
        first live one; then those stored with less than the TTL left (`Expiries`)."""
        now = self._clock()
        doomed = []
        for entry in self.ix.entries.values():
            if entry.expires_at > now:
                break
            if not entry.reserved:
                doomed.append(entry)
        doomed += self._early.due(now, self.ix.live)  # _drop takes one in both once
        return self._drop("ttl", doomed)

    async def pinned(self, decode_url: str) -> int:
        return self.ix.pinned(decode_url)

    async def count(self) -> int:
        return len(self.ix.entries)

    async def close(self) -> None:
        return None
