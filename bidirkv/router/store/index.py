"""What the in-process store (memory.py) looks its entries up by: `Index`, every entry in
store order with the tallies and orders its bounds take entries by, and `Expiries`, the
entries that expire out of store order (pure data structures, no I/O)."""

from __future__ import annotations

import heapq
import sys
from collections import OrderedDict
from collections.abc import Callable

from bidirkv.returns import release_key
from bidirkv.router.store.base import Entry, Lengths, ReturnOrder, Weights, rank_gap


class Index:
    """The entries in store order and, in step with them, what the bounds take entries
    by: per tenant its entries and their number, per replica per tenant the blocks they
    pin and their return order, per tenant the prompt lengths stored. Only the tenants'
    entries are OrderedDicts (~105 bytes an entry against a dict's ~52); a replica's own
    handles are found by a pass over all entries (a replica leaving is rare)."""

    def __init__(self) -> None:
        self.entries: dict[bytes, Entry] = {}
        self.by_tenant: dict[bytes | None, OrderedDict[bytes, Entry]] = {}
        # One bytes object per tenant, shared by its entries (each turn's is a new one).
        self.tenant_names: dict[bytes, bytes] = {}
        self.tenant_entries = Weights()
        self.rep_blocks: dict[str, Weights] = {}
        self.orders: dict[str, dict[bytes | None, ReturnOrder]] = {}
        self.lengths: dict[bytes, Lengths] = {}

    def live(self, entry: Entry) -> bool:
        return self.entries.get(entry.key) is entry

    def pinned(self, url: str) -> int:
        tally = self.rep_blocks.get(url)
        return tally.total if tally is not None else 0

    def add(self, entry: Entry, gap: float, expires_wall: float) -> None:
        """Index `entry`, ranked by `gap`; `expires_wall`: its expiry on the clock of
        `kept_at`."""
        tenant = entry.tenant
        if tenant is not None:
            tenant = entry.tenant = self.tenant_names.setdefault(tenant, tenant)
        if entry.engine_id is not None:  # one per decode engine, parsed anew each turn
            entry.engine_id = sys.intern(entry.engine_id)
        key, url = entry.key, entry.decode_url
        self.entries[key] = entry
        # get, then build what is missing (setdefault would build one per index per put)
        mine = self.by_tenant.get(tenant)
        if mine is None:
            mine = self.by_tenant[tenant] = OrderedDict()
        mine[key] = entry
        self.tenant_entries.add(tenant, 1)
        tally = self.rep_blocks.get(url)
        if tally is None:
            tally = self.rep_blocks[url] = Weights()
        tally.add(tenant, entry.blocks)
        orders = self.orders.get(url)
        if orders is None:
            orders = self.orders[url] = {}
        order = orders.get(tenant)
        if order is None:
            order = orders[tenant] = ReturnOrder()
        order.add(entry, gap, expires_wall)
        order.compact(self.live)
        if tenant is not None and entry.prefix_len > 0:
            lengths = self.lengths.get(tenant)
            if lengths is None:
                lengths = self.lengths[tenant] = Lengths()
            lengths.add(entry.prefix_len)

    def remove(self, entry: Entry) -> bool:
        """Take `entry` out of every index; False if it was no longer stored."""
        key, url, tenant = entry.key, entry.decode_url, entry.tenant
        if self.entries.get(key) is not entry:
            return False
        del self.entries[key]
        if tenant is not None and entry.prefix_len > 0:
            lengths = self.lengths.get(tenant)
            if lengths is not None and not lengths.remove(entry.prefix_len):
                del self.lengths[tenant]
        mine = self.by_tenant.get(tenant)
        if mine is not None:
            mine.pop(key, None)
            if not mine:
                del self.by_tenant[tenant]
                if tenant is not None:
                    self.tenant_names.pop(tenant, None)
        self.tenant_entries.add(tenant, -1)
        tally = self.rep_blocks.get(url)
        if tally is not None:
            tally.add(tenant, -entry.blocks)
            if not len(tally):
                del self.rep_blocks[url]
        orders = self.orders.get(url)
        order = orders.get(tenant) if orders is not None else None
        if order is not None and not order.left():
            # Its last handle there: the heaps hold only dead ones.
            del orders[tenant]
            if not orders:
                del self.orders[url]
        return True

    def oldest(self, spare: Entry | None) -> Entry | None:
        """What the entry bound takes: the oldest entry of the tenant holding the most
        (else of any), never `spare`."""
        mine = self.by_tenant.get(self.tenant_entries.heaviest())
        for entries in (mine or {}, self.entries):
            for entry in entries.values():
                if entry is not spare:
                    return entry
        return None

    def victim(self, url: str, tenant: bytes | None, now: float,
               skip: Callable[[Entry], bool] = lambda e: e.reserved) -> Entry | None:
        """The tenant's handle on the replica its block bounds take first."""
        order = self.orders.get(url, {}).get(tenant)
        return order.victim(now, self.live, skip) if order is not None else None

    def block_victim(self, url: str, now: float, skip: Callable[[Entry], bool],
                     prior_gap: float | None) -> Entry | None:
        """What the replica's block bound takes: of the tenant pinning the most there,
        the one expected back last (else, all of theirs skipped, the first to go of any
        tenant's there)."""
        tally = self.rep_blocks.get(url)
        victim = self.victim(url, tally.heaviest() if tally is not None else None, now, skip)
        if victim is not None:
            return victim
        free = [e for t in list(self.orders.get(url, {}))
                if (e := self.victim(url, t, now, skip)) is not None]
        return max(free, key=lambda e: release_key(now, e.kept_at, rank_gap(e, prior_gap)),
                   default=None)


class Expiries:
    """Entries stored with less than the TTL left (recalled handles), by expiry. Store
    order is expiry order for every other entry, so the sweep walks it only until the
    first live one, and would pass these by behind it. Removed ones stay until they
    expire (lazy deletion): at most one item per such put within one TTL."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[float, Entry]] = []

    def add(self, entry: Entry) -> None:
        heapq.heappush(self._heap, (entry.expires_at, entry))

    def due(self, now: float, live: Callable[[Entry], bool]) -> list[Entry]:
        """The `live` ones expired by `now`, but those a turn holds (reserved: its end
        decides; still here for the next round)."""
        heap, out, aside = self._heap, [], []
        while heap and heap[0][0] <= now:
            item = heapq.heappop(heap)
            if live(item[1]):
                (aside if item[1].reserved else out).append(item)
        for item in aside:
            heapq.heappush(heap, item)
        return [e for _, e in out]
