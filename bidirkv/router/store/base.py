"""The handle store as one idea: what it keeps (`Entry`, stored from a `Kept`), what it
promises (`Store`), and the orders its bounds take entries in. `InProcessStore`
(memory.py) and `RedisStore` (shared.py) keep the same rules, held equal by one table of
cases run against both (tests/test_router_store.py).

The rules: tenant-scoped keys, single use (`lookup` takes the entry, `look` only reads
where it is; `release` puts it back when P was never asked; `consume` and `discard` end
it), a TTL, bounds on entries and on blocks pinned per decode replica, fair between
tenants (the one holding the most loses first), per-tenant caps, and every entry dropped
unread handed to `on_evict` so its decode blocks are released. The entry bounds (the
router's memory) take the oldest entry; the block bounds (decode's memory) take the
conversation expected back last, as decode itself does (bidirkv/returns.py).

`owner` is the identity decode holds retained KV for: None is "this router", one id
derived from the handle key, so a restarted router recalls its handles (pool/recall.py);
a shared store has one owner id for all its routers.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from bidirkv.returns import expected_at, overdue_at

HIT = "hit"
MISS = "miss"
EXPIRED = "expired"


# Not frozen: a frozen dataclass sets each of its 16 fields through object.__setattr__,
# ~4x the cost of plain slots, and one is built per kept turn. Nothing changes a Kept
# once made: it is a value handed to the store and to residency (notes).
@dataclass(slots=True)
class Kept:
    """A handle decode kept, as `Store.put` takes it, and the block bounds of its replica
    at this moment (None: unbounded): `max_pinned` (the watermark) and `tenant_max_pinned`
    (the tenant's share of it), kept once it is stored.

    `replaces`: the entry this handle supersedes when its holder extended it (the turn
    holds it reserved). The new handle shares its history on decode, so the put takes
    the old one out of every count and bound in the same step, and never picks the new
    one as a victim of its own bounds; ending the old one (its blocks that only it held)
    is left to the turn (`discard`)."""

    key: bytes
    params: bytes
    decode_url: str
    engine_id: str | None = None
    num_tokens: int = 0
    tenant: bytes | None = None
    prefix_len: int = 0
    request_id: str | None = None
    blocks: int = 0
    chars: int = 0
    prompt_key: bytes | None = None
    # None: when stored. Set (a recalled note's own time), the handle expires the TTL
    # after it, not after the put (`time_left`).
    kept_at: float | None = None
    gap: float | None = None
    max_pinned: int | None = None
    tenant_max_pinned: int | None = None
    replaces: Entry | None = None

    def time_left(self, ttl: float, now: float) -> float:
        """How long a put keeps this handle (`now`: Unix seconds): the TTL from when
        decode kept it. One the router kept just now (no `kept_at`) gets the whole TTL; a
        recalled one only what its note has left, so a restart never lengthens a handle's
        life (it would outlive decode's blocks and pin them in the watermark's count); a
        `kept_at` ahead of `now` counts as `now`. At most 0: expired, not to be stored."""
        if self.kept_at is None:
            return ttl
        return ttl - max(0.0, now - self.kept_at)


# eq=False: an entry is one stored handle; the stores tell a replaced one from its
# successor by identity.
@dataclass(slots=True, eq=False)
class Entry:
    """One stored handle. Params are compact JSON bytes, not dicts: block id lists of big
    ints cost ~36 bytes per id as Python objects, ~5 as text, and 100k handles must fit
    in a small pod."""

    key: bytes
    params: bytes
    decode_url: str
    engine_id: str | None
    num_tokens: int
    expires_at: float  # on the store's clock
    # Set only for prompt-prefix entries (/v1/completions without an id).
    tenant: bytes | None
    prefix_len: int
    # D's own id of the retained request (what it frees on release) and how many blocks
    # it pins there.
    request_id: str | None = None
    blocks: int = 0
    # Characters of the text whose KV D holds (prompt and answer; 0: unknown): the
    # placement estimates a next turn's new tokens from what it adds.
    chars: int = 0
    # An explicit-id chat turn's prompt: its message count and their keyed hash
    # (LookupKeys.messages_key, as bytes: 4-byte count + digest). The next turn's prompt
    # extends it when its first messages hash the same.
    prompt_key: bytes | None = None
    # When D kept it (Unix seconds; 0: unknown) and the moving average of the
    # conversation's idle times between turns (bidirkv/returns.py; None: no turn came
    # back yet): the next turn's estimate of when it returns, sent to D.
    kept_at: float = 0.0
    gap: float | None = None
    reserved: bool = False

    def __lt__(self, other: Entry) -> bool:
        # Ties in the return orders go by key (no rule of the store): a heap item is
        # (time, entry), without a counter of its own (~44 bytes a handle, two heaps).
        return self.key < other.key

    @classmethod
    def of(cls, kept: Kept, expires_at: float, now: float) -> Entry:
        """The entry a put stores; `now` (Unix seconds) stands for an unknown `kept_at`,
        and for one after it (another host's clock ahead of this one's)."""
        return cls(kept.key, kept.params, kept.decode_url, kept.engine_id, kept.num_tokens,
                   expires_at, kept.tenant, kept.prefix_len, kept.request_id, kept.blocks,
                   kept.chars, kept.prompt_key,
                   now if kept.kept_at is None else min(kept.kept_at, now), kept.gap)


EvictHook = Callable[[str, list[Entry]], None]
PrefixKeys = Callable[[str, list[int]], Iterator[tuple[int, bytes]]]


class StoreUnavailable(Exception):
    """The shared store did not answer; the caller serves without reuse."""


async def quietly(coro: Any) -> Any:
    """A store call whose failure costs only reuse (the store counts the error)."""
    try:
        return await coro
    except StoreUnavailable:
        return None


class Store(Protocol):
    owner: str | None

    @property
    def available(self) -> bool: ...

    def configure(self, ttl_seconds: float, max_entries: int,
                  max_per_tenant: int | None = None) -> None: ...
    async def lookup(self, key: bytes) -> tuple[str, Entry | None]: ...
    async def lookup_prefix(self, tenant: bytes, text: str, key_of: PrefixKeys
                            ) -> tuple[str, Entry | None]: ...
    async def look(self, key: bytes) -> Entry | None:
        """The live entry under `key`, left where it is and still single use: where a
        sub-agent or fork finds the decode replica that holds its parent's prefix. One
        that a turn took is found in-process; in a shared store, once it is put back."""
        ...
    async def put(self, kept: Kept) -> None:
        """Store; then keep the entry bounds and the block bounds `kept` names."""
        ...
    async def release(self, entry: Entry) -> None: ...
    async def consume(self, entry: Entry) -> None: ...
    async def discard(self, entry: Entry, reason: str) -> None: ...
    def forget(self, entry: Entry, reason: str) -> None:
        """`discard` without waiting (a cancelled request cannot wait for I/O)."""
        ...
    async def end(self, key: bytes) -> bool: ...
    async def trim_replica(self, decode_url: str, max_blocks: int,
                           reason: str = "watermark") -> int: ...
    async def drop_replica(self, decode_url: str, reason: str,
                           keep_engine_id: str | None = None) -> int: ...
    async def sweep(self) -> int: ...
    async def pinned(self, decode_url: str) -> int: ...
    async def count(self) -> int: ...
    async def close(self) -> None: ...


# -- the orders the bounds take entries in ---------------------------------------------
# The shared store keeps each as sorted sets (scripts.py); the in-process one as below.

def rank_gap(entry: Entry, prior: float | None) -> float:
    """The gap a handle is ranked by: its conversation's own, else the typical one."""
    if entry.gap is not None:
        return entry.gap
    return prior or 0.0


# Below this many items a heap is never rebuilt: rebuilding would cost more than it saves.
_COMPACT_MIN = 64


class ReturnOrder:
    """The order the block bounds take one tenant's handles on one replica in: overdue
    ones first (the earliest overdue first), then the one expected back last. Both are
    fixed when a handle is stored, so two heaps serve them; removed handles stay until
    they reach the top (lazy deletion), and a heap is rebuilt once it holds more dead
    items than live ones. `size`: the handles in it still stored (its holder counts them
    out with `left`)."""

    __slots__ = ("_due", "_back", "size")

    def __init__(self) -> None:
        self._due: list[tuple[float, Entry]] = []
        self._back: list[tuple[float, Entry]] = []
        self.size = 0

    def add(self, entry: Entry, gap: float, expires: float = math.inf) -> None:
        """`expires`: when the handle expires, on the clock of `kept_at` (an expired one
        is overdue whatever its gap)."""
        heapq.heappush(self._due, (overdue_at(entry.kept_at, gap, expires), entry))
        heapq.heappush(self._back, (-expected_at(entry.kept_at, gap), entry))
        self.size += 1

    def left(self) -> int:
        """One of its handles is no longer stored; how many still are."""
        self.size -= 1
        return self.size

    def victim(self, now: float, live: Callable[[Entry], bool],
               skip: Callable[[Entry], bool]) -> Entry | None:
        """The handle to drop first among those `live` and not `skip`ped (reserved, or
        pinning nothing); dead ones met on the way are discarded."""
        due = self._top(self._due, live, skip)
        if due is not None and due[0] < now:
            return due[1]
        back = self._top(self._back, live, skip)
        return back[1] if back is not None else None

    def compact(self, live: Callable[[Entry], bool]) -> None:
        """Rebuild the heaps without dead items once they outnumber the live ones."""
        bound = max(_COMPACT_MIN, 2 * self.size)
        if len(self._due) <= bound and len(self._back) <= bound:
            return  # most puts
        for heap in (self._due, self._back):
            if len(heap) > bound:
                heap[:] = [item for item in heap if live(item[1])]
                heapq.heapify(heap)

    @staticmethod
    def _top(heap: list[tuple[float, Entry]], live: Callable[[Entry], bool],
             skip: Callable[[Entry], bool]) -> tuple[float, Entry] | None:
        aside = []  # skipped, not dead: back on the heap after the look
        found = None
        while heap:
            item = heap[0]
            if not live(item[1]):
                heapq.heappop(heap)
            elif skip(item[1]):
                aside.append(heapq.heappop(heap))
            else:
                found = item
                break
        for item in aside:
            heapq.heappush(heap, item)
        return found


class Weights:
    """Weights per tenant, their total, and the heaviest at hand: fair bounds take from
    whoever holds the most, so a tenant that opens conversations by the thousand spends
    its own handles. A change only marks its tenant (the heaviest is asked only over a
    bound); `heaviest()` pushes the marked weights onto a max-heap whose stale items are
    dropped at the top, rebuilt once it outgrows twice the tenants (a tenant swinging
    between two weights leaves copies no drop at the top takes): amortised O(log n)."""

    __slots__ = ("_w", "_heap", "_seq", "_changed", "total")

    def __init__(self) -> None:
        self._w: dict[Hashable, int] = {}
        self._heap: list[tuple[int, int, Any]] = []
        self._seq = 0  # ties: the first pushed wins; tenants need not be comparable
        self._changed: dict[Hashable, None] = {}  # since the last push, in change order
        self.total = 0

    def __len__(self) -> int:
        return len(self._w)

    def get(self, who: Hashable) -> int:
        return self._w.get(who, 0)

    def add(self, who: Hashable, delta: int) -> None:
        if not delta:  # a handle that pins nothing: no weight changes
            return
        w = self._w.get(who, 0) + delta
        self.total += delta
        changed = self._changed
        if who in changed:
            del changed[who]  # its place in the order is its last change's
        if w > 0:
            self._w[who] = w
            changed[who] = None
        else:
            self._w.pop(who, None)

    def heaviest(self) -> Hashable | None:
        w, heap = self._w, self._heap
        if len(w) == 1 and not heap:
            return next(iter(w))  # one tenant: nothing to weigh (its change stays marked)
        changed = self._changed
        if len(heap) + len(changed) > 2 * len(w) + 64:
            order = [who for who in w if who not in changed] + list(changed)
            heap[:] = [(-w[who], i, who) for i, who in enumerate(order)]
            heapq.heapify(heap)
            self._seq = len(order)
        else:
            for who in changed:
                self._seq += 1
                heapq.heappush(heap, (-w[who], self._seq, who))
        changed.clear()
        while heap:
            neg, _, who = heap[0]
            if w.get(who) == -neg:
                return who
            heapq.heappop(heap)
        return None


class Lengths:
    """Sorted distinct prompt lengths of one tenant's completion entries, with counts:
    a prefix lookup hashes only lengths some entry was stored at."""

    __slots__ = ("sorted", "counts")

    def __init__(self) -> None:
        self.sorted: list[int] = []
        self.counts: dict[int, int] = {}

    def add(self, n: int) -> None:
        c = self.counts.get(n, 0)
        if c == 0:
            bisect.insort(self.sorted, n)
        self.counts[n] = c + 1

    def remove(self, n: int) -> bool:
        """One fewer entry stored at `n`; whether any length is left."""
        c = self.counts.get(n, 0)
        if c <= 1:
            self.counts.pop(n, None)
            i = bisect.bisect_left(self.sorted, n)
            if i < len(self.sorted) and self.sorted[i] == n:
                del self.sorted[i]
        else:
            self.counts[n] = c - 1
        return bool(self.counts)

    def up_to(self, n: int) -> list[int]:
        return self.sorted[: bisect.bisect_right(self.sorted, n)]
