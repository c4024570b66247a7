"""Decode handles: D's `kv_transfer_params` kept per conversation until the next turn.

A handle points at blocks D pins for `decoder_kv_blocks_ttl`; it is worth something only
until then, and only once (P's read frees them on D). So the store is a TTL map bounded
by evicting the oldest stored entry first (a conversation's entry is replaced by every
turn, so "oldest stored" is "least recently active"; a lookup does not refresh it, as a
hit is spent at once), with a reservation step: `lookup` reserves an entry for one
request, which then either `consume`s it (P read it), `discard`s it (the read failed;
the blocks are in an unknown state) or `release`s it (P was never asked). A reserved
entry is invisible to other lookups, so two concurrent turns of one conversation never
send the same handle twice.

Params are stored as compact JSON bytes, not dicts: block id lists of big ints cost ~36
bytes per id as Python objects, ~5 as text, and 100k handles must fit in a small pod.

Every handle also pins blocks on its decode replica until it is used or released, so the
store counts them per replica (`pinned`) and hands every entry it drops to `on_evict`:
the router tells that replica to free the blocks (bidirkv/router/pool/residency.py).

Bounds are fair between tenants (bidirkv/router/store/tally.py): the entry bound and a replica's
watermark take from the tenant holding the most (entries, or blocks on that replica),
and a tenant over one of its own caps (`max_per_tenant` entries, or the blocks it may pin
on one replica, `trim_tenant_replica`) loses its own. One tenant opening conversations
by the thousand therefore spends its own handles, not everyone's. The entry bounds (the
router's memory) take the oldest entry; the block bounds on a replica (decode's memory)
take the conversation expected back last, overdue ones first (returnorder.py), as
decode itself does under pressure.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

from bidirkv.returns import next_gap, release_key
from bidirkv.router.store.base import EvictHook, PrefixKeys
from bidirkv.router.store.entry import EXPIRED, HIT, MISS, Entry, Lengths
from bidirkv.router.store.returnorder import ReturnOrder, rank_gap
from bidirkv.router.store.tally import Tally

__all__ = ["EXPIRED", "HIT", "MISS", "Entry", "HandleStore"]


class HandleStore:
    def __init__(
        self,
        ttl_seconds: float,
        max_entries: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        on_evict: EvictHook | None = None,
    ) -> None:
        self._d: OrderedDict[bytes, Entry] = OrderedDict()
        self._lengths: dict[bytes, Lengths] = {}
        # Blocks pinned per decode replica; per tenant its entries in store order (oldest
        # first), and per replica, per tenant likewise (an OrderedDict entry costs ~110
        # bytes: 100k handles are held in three of them).
        self.pinned: dict[str, int] = {}
        self._by_tenant: dict[bytes | None, OrderedDict[bytes, Entry]] = {}
        self._by_rep: dict[str, dict[bytes | None, OrderedDict[bytes, Entry]]] = {}
        self.tenant_entries = Tally()
        self._rep_blocks: dict[str, Tally] = {}
        self.ttl = ttl_seconds
        self.max_entries = max_entries
        self.max_per_tenant: int | None = None
        self._clock = clock
        self._wall = wall  # what Entry.kept_at is on
        self._on_evict = on_evict
        # Per replica, per tenant: the order its block bounds take handles in, and the gap
        # a handle without one is ranked by (a moving average of the gaps stored).
        self._orders: dict[str, dict[bytes | None, ReturnOrder]] = {}
        self.prior_gap: float | None = None

    def __len__(self) -> int:
        return len(self._d)

    def __iter__(self) -> Iterator[Entry]:
        return iter(list(self._d.values()))

    def configure(self, ttl_seconds: float, max_entries: int,
                  max_per_tenant: int | None = None) -> None:
        # A shorter TTL applies to new entries; existing ones keep the deadline they were
        # given (they were valid against D's TTL when stored).
        self.ttl = ttl_seconds
        self.max_entries = max_entries
        self.max_per_tenant = max_per_tenant
        self._trim()
        for tenant in list(self._by_tenant):
            self._trim_tenant(tenant)

    # -- writes ---------------------------------------------------------------------
    def put(
        self,
        key: bytes,
        params: bytes,
        decode_url: str,
        engine_id: str | None = None,
        num_tokens: int = 0,
        *,
        tenant: bytes | None = None,
        prefix_len: int = 0,
        request_id: str | None = None,
        blocks: int = 0,
        chars: int = 0,
        prompt_key: bytes | None = None,
        kept_at: float | None = None,
        gap: float | None = None,
    ) -> Entry:
        old = self._d.get(key)
        if old is not None:
            self._remove(old)
            self._evicted("replaced", [old])
        entry = Entry(
            key,
            params,
            decode_url,
            engine_id,
            num_tokens,
            self._clock() + self.ttl,
            tenant,
            prefix_len,
            request_id,
            blocks,
            chars,
            prompt_key,
            self._wall() if kept_at is None else kept_at,
            gap,
        )
        if gap is not None:
            self.prior_gap = next_gap(self.prior_gap, gap)
        self._index(entry)
        self._trim()
        self._trim_tenant(tenant)
        return entry

    def _index(self, entry: Entry) -> None:
        key, url, tenant, blocks = entry.key, entry.decode_url, entry.tenant, entry.blocks
        self._d[key] = entry
        self.pinned[url] = self.pinned.get(url, 0) + blocks
        self._by_tenant.setdefault(tenant, OrderedDict())[key] = entry
        self._by_rep.setdefault(url, {}).setdefault(tenant, OrderedDict())[key] = entry
        self.tenant_entries.add(tenant, 1)
        self._rep_blocks.setdefault(url, Tally()).add(tenant, blocks)
        order = self._orders.setdefault(url, {}).setdefault(tenant, ReturnOrder())
        # Its expiry on the wall clock, which kept_at is on.
        order.add(entry, rank_gap(entry, self.prior_gap),
                  self._wall() + entry.expires_at - self._clock())
        order.compact(self._live, len(self._by_rep[url][tenant]))
        if tenant is not None and entry.prefix_len > 0:
            self._lengths.setdefault(tenant, Lengths()).add(entry.prefix_len)

    def _trim(self) -> None:
        doomed = []
        while len(self._d) > self.max_entries:
            mine = self._by_tenant.get(self.tenant_entries.heaviest())
            old = next(iter((mine or self._d).values()))
            self._remove(old)
            doomed.append(old)
        self._evicted("lru", doomed)

    def _trim_tenant(self, tenant: bytes | None) -> None:
        """The tenant's own entry cap: its oldest unreserved entries go first."""
        cap = self.max_per_tenant
        if cap is None:
            return
        excess = self.tenant_entries.get(tenant) - cap
        self._drop_oldest(self._by_tenant.get(tenant), excess, "tenant_cap")

    def trim_tenant_replica(self, decode_url: str, tenant: bytes | None, max_blocks: int) -> int:
        """The tenant's unreserved handles on the replica, expected back last first,
        until it pins at most `max_blocks` there."""
        tally = self._rep_blocks.get(decode_url)
        excess = (tally.get(tenant) if tally is not None else 0) - max_blocks
        doomed = []
        now = self._wall()
        while excess > 0:
            # One that pins nothing would free nothing.
            victim = self._victim(decode_url, tenant, now, lambda e: e.reserved or not e.blocks)
            if victim is None:
                break
            self._remove(victim)
            doomed.append(victim)
            excess -= victim.blocks
        self._evicted("tenant_cap", doomed)
        return len(doomed)

    def _live(self, entry: Entry) -> bool:
        return self._d.get(entry.key) is entry

    def _victim(self, url: str, tenant: bytes | None, now: float,
                skip: Callable[[Entry], bool] = lambda e: e.reserved) -> Entry | None:
        order = self._orders.get(url, {}).get(tenant)
        return order.victim(now, self._live, skip) if order is not None else None

    def _drop_oldest(self, entries: OrderedDict[bytes, Entry] | None, excess: int,
                     reason: str) -> int:
        """The `excess` oldest unreserved entries of `entries`: chosen first, then
        removed, so a put costs what it drops, not the tenant's size."""
        doomed: list[Entry] = []
        for entry in (entries or {}).values():
            if excess <= 0:
                break
            if not entry.reserved:
                doomed.append(entry)
                excess -= 1
        for entry in doomed:
            self._remove(entry)
        self._evicted(reason, doomed)
        return len(doomed)

    def trim_replica(self, decode_url: str, max_blocks: int, reason: str = "watermark") -> int:
        """Drop unreserved handles of the replica until it pins at most `max_blocks`: of
        the tenant pinning the most there, the one expected back last (else, all of
        theirs reserved, the first to go of any tenant's there)."""
        doomed = []
        now = self._wall()
        while self.pinned.get(decode_url, 0) > max_blocks:
            tally = self._rep_blocks.get(decode_url)
            tenant = tally.heaviest() if tally is not None else None
            victim = self._victim(decode_url, tenant, now)
            if victim is None:
                free = [e for t in list(self._orders.get(decode_url, {}))
                        if (e := self._victim(decode_url, t, now)) is not None]
                victim = max(free, key=lambda e: release_key(
                    now, e.kept_at, rank_gap(e, self.prior_gap)), default=None)
            if victim is None:
                break
            self._remove(victim)
            doomed.append(victim)
        self._evicted(reason, doomed)
        return len(doomed)

    def _unindex(self, entry: Entry) -> None:
        key, url, tenant, blocks = entry.key, entry.decode_url, entry.tenant, entry.blocks
        if tenant is not None and entry.prefix_len > 0:
            lengths = self._lengths.get(tenant)
            if lengths is not None:
                lengths.remove(entry.prefix_len)
                if not lengths.counts:
                    del self._lengths[tenant]
        tenants = self._by_rep.get(url, {})
        for index in (self._by_tenant, tenants):
            entries = index.get(tenant)
            if entries is not None:
                entries.pop(key, None)
                if not entries:
                    del index[tenant]
        orders = self._orders.get(url, {})
        if tenant not in tenants:  # its last handle there: the heaps hold only dead ones
            orders.pop(tenant, None)
        if not orders:
            self._orders.pop(url, None)
        if not tenants:
            self._by_rep.pop(url, None)
        self.tenant_entries.add(tenant, -1)
        tally = self._rep_blocks.get(url)
        if tally is not None:
            tally.add(tenant, -blocks)
            if not len(tally):
                del self._rep_blocks[url]

    def _remove(self, entry: Entry) -> bool:
        if self._d.get(entry.key) is entry:
            del self._d[entry.key]
            self._unindex(entry)
            url = entry.decode_url
            left = self.pinned.get(url, 0) - entry.blocks
            if left > 0 or url in self._by_rep:
                self.pinned[url] = left
            else:
                self.pinned.pop(url, None)
            return True
        return False

    def _evicted(self, reason: str, entries: list[Entry]) -> None:
        if self._on_evict is not None and entries:
            self._on_evict(reason, entries)

    # -- the reservation protocol ----------------------------------------------------
    def lookup(self, key: bytes) -> tuple[str, Entry | None]:
        """(HIT, reserved entry) or (MISS | EXPIRED, None)."""
        entry = self._d.get(key)
        if entry is None or entry.reserved:
            return MISS, None
        if entry.expires_at <= self._clock():
            self._remove(entry)
            self._evicted("ttl", [entry])
            return EXPIRED, None
        entry.reserved = True
        return HIT, entry

    def lookup_prefix(
        self, tenant: bytes, text: str, key_of: PrefixKeys
    ) -> tuple[str, Entry | None]:
        """Longest stored prompt prefix of `text` for `tenant`.

        `key_of(text, lengths)` yields (length, key) for the candidate lengths, longest
        first; only lengths some entry was stored at are hashed, so the cost is bounded by
        the prompt's length, not by the number of stored conversations.
        """
        lengths = self._lengths.get(tenant)
        if lengths is None:
            return MISS, None
        candidates = lengths.up_to(len(text))
        if not candidates:
            return MISS, None
        outcome = MISS
        for _, key in key_of(text, candidates):
            status, entry = self.lookup(key)
            if status == HIT:
                return HIT, entry
            if status == EXPIRED:
                outcome = EXPIRED
        return outcome, None

    def release(self, entry: Entry) -> None:
        """P was never asked: the handle is still good for the next attempt."""
        entry.reserved = False

    def consume(self, entry: Entry) -> None:
        """P read the blocks; D has freed them, the handle is spent."""
        self._remove(entry)

    def discard(self, entry: Entry, reason: str) -> None:
        if self._remove(entry):
            self._evicted(reason, [entry])

    def end(self, key: bytes) -> bool:
        """The client ended the conversation: drop its handle (reserved or not)."""
        entry = self._d.get(key)
        if entry is None:
            return False
        self._remove(entry)
        self._evicted("ended", [entry])
        return True

    # -- bulk drops --------------------------------------------------------------------
    def drop_replica(self, decode_url: str, reason: str, keep_engine_id: str | None = None) -> int:
        """Drop every handle of one decode replica (except those of `keep_engine_id`)."""
        doomed = [
            e
            for entries in self._by_rep.get(decode_url, {}).values()
            for e in entries.values()
            if keep_engine_id is None or e.engine_id != keep_engine_id
        ]
        for e in doomed:
            self._remove(e)
        self._evicted(reason, doomed)
        return len(doomed)

    def sweep(self) -> int:
        """Drop expired entries. Insertion order is (nearly) expiry order, so stop early."""
        now = self._clock()
        doomed = []
        for entry in self._d.values():
            if entry.expires_at > now:
                break
            if not entry.reserved:
                doomed.append(entry)
        for entry in doomed:
            self._remove(entry)
        self._evicted("ttl", doomed)
        return len(doomed)
