"""Decode handles: D's `kv_transfer_params` kept per conversation until the next turn.

A handle points at blocks D pins for `decoder_kv_blocks_ttl`; it is worth something only
until then, and only once (P's read frees them on D). So the store is a TTL + LRU map
with a reservation step: `lookup` reserves an entry for one request, which then either
`consume`s it (P read it), `discard`s it (the read failed; the blocks are in an unknown
state) or `release`s it (P was never asked). A reserved entry is invisible to other
lookups, so two concurrent turns of one conversation never send the same handle twice.

Params are stored as compact JSON bytes, not dicts: block id lists of big ints cost ~36
bytes per id as Python objects, ~5 as text, and 100k handles must fit in a small pod.
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

HIT = "hit"
MISS = "miss"
EXPIRED = "expired"


class Entry:
    __slots__ = (
        "key",
        "params",
        "decode_url",
        "engine_id",
        "num_tokens",
        "expires_at",
        "reserved",
        "tenant",
        "prefix_len",
    )

    def __init__(
        self,
        key: bytes,
        params: bytes,
        decode_url: str,
        engine_id: str | None,
        num_tokens: int,
        expires_at: float,
        tenant: bytes | None,
        prefix_len: int,
    ) -> None:
        self.key = key
        self.params = params
        self.decode_url = decode_url
        self.engine_id = engine_id
        self.num_tokens = num_tokens
        self.expires_at = expires_at
        self.reserved = False
        # Set only for prompt-prefix entries (/v1/completions without an id).
        self.tenant = tenant
        self.prefix_len = prefix_len


class _Lengths:
    """Sorted distinct prefix lengths of one tenant's completion entries, with counts."""

    __slots__ = ("sorted", "counts")

    def __init__(self) -> None:
        self.sorted: list[int] = []
        self.counts: dict[int, int] = {}

    def add(self, n: int) -> None:
        c = self.counts.get(n, 0)
        if c == 0:
            bisect.insort(self.sorted, n)
        self.counts[n] = c + 1

    def remove(self, n: int) -> None:
        c = self.counts.get(n, 0)
        if c <= 1:
            self.counts.pop(n, None)
            i = bisect.bisect_left(self.sorted, n)
            if i < len(self.sorted) and self.sorted[i] == n:
                del self.sorted[i]
        else:
            self.counts[n] = c - 1

    def up_to(self, n: int) -> list[int]:
        return self.sorted[: bisect.bisect_right(self.sorted, n)]


EvictHook = Callable[[str, int], None]
PrefixKeys = Callable[[str, list[int]], Iterator[tuple[int, bytes]]]


class HandleStore:
    def __init__(
        self,
        ttl_seconds: float,
        max_entries: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_evict: EvictHook | None = None,
    ) -> None:
        self._d: OrderedDict[bytes, Entry] = OrderedDict()
        self._lengths: dict[bytes, _Lengths] = {}
        self.ttl = ttl_seconds
        self.max_entries = max_entries
        self._clock = clock
        self._on_evict = on_evict

    def __len__(self) -> int:
        return len(self._d)

    def __iter__(self) -> Iterator[Entry]:
        return iter(list(self._d.values()))

    def configure(self, ttl_seconds: float, max_entries: int) -> None:
        # A shorter TTL applies to new entries; existing ones keep the deadline they were
        # given (they were valid against D's TTL when stored).
        self.ttl = ttl_seconds
        self.max_entries = max_entries
        self._trim()

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
    ) -> Entry:
        old = self._d.pop(key, None)
        if old is not None:
            self._unindex(old)
            self._evicted("replaced", 1)
        entry = Entry(
            key,
            params,
            decode_url,
            engine_id,
            num_tokens,
            self._clock() + self.ttl,
            tenant,
            prefix_len,
        )
        self._d[key] = entry
        if tenant is not None:
            self._lengths.setdefault(tenant, _Lengths()).add(prefix_len)
        self._trim()
        return entry

    def _trim(self) -> None:
        n = 0
        while len(self._d) > self.max_entries:
            _, old = self._d.popitem(last=False)
            self._unindex(old)
            n += 1
        if n:
            self._evicted("lru", n)

    def _unindex(self, entry: Entry) -> None:
        if entry.tenant is not None:
            lengths = self._lengths.get(entry.tenant)
            if lengths is not None:
                lengths.remove(entry.prefix_len)
                if not lengths.counts:
                    del self._lengths[entry.tenant]

    def _remove(self, entry: Entry) -> bool:
        if self._d.get(entry.key) is entry:
            del self._d[entry.key]
            self._unindex(entry)
            return True
        return False

    def _evicted(self, reason: str, n: int) -> None:
        if self._on_evict is not None and n:
            self._on_evict(reason, n)

    # -- the reservation protocol ----------------------------------------------------
    def lookup(self, key: bytes) -> tuple[str, Entry | None]:
        """(HIT, reserved entry) or (MISS | EXPIRED, None)."""
        entry = self._d.get(key)
        if entry is None or entry.reserved:
            return MISS, None
        if entry.expires_at <= self._clock():
            self._remove(entry)
            self._evicted("ttl", 1)
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
            self._evicted(reason, 1)

    # -- bulk drops --------------------------------------------------------------------
    def drop_replica(self, decode_url: str, reason: str, keep_engine_id: str | None = None) -> int:
        """Drop every handle of one decode replica (except those of `keep_engine_id`).

        A scan, not an index: replicas leave rarely and a scan of 100k entries takes
        milliseconds, where a per-replica index would cost memory on every entry.
        """
        doomed = [
            e
            for e in self._d.values()
            if e.decode_url == decode_url
            and (keep_engine_id is None or e.engine_id != keep_engine_id)
        ]
        for e in doomed:
            self._remove(e)
        self._evicted(reason, len(doomed))
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
        self._evicted("ttl", len(doomed))
        return len(doomed)
