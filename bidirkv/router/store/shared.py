"""Decode handles in a Redis-protocol store (Valkey, Redis, ElastiCache non-cluster).

Its keys, under a prefix (default `bidirkv:`), are listed in scripts.py. An entry's own
key has a store-side TTL of the router's TTL + a minute, a safety net behind the
routers' sweep. Every change of one entry is one Lua script, so it is atomic: of two
routers taking the same handle one gets it. Whoever removes an entry hands it to
`on_evict`, which releases its blocks on decode. Run the server with
`maxmemory-policy noeviction`: it must never drop an index entry behind the routers'
backs (the routers bound the entries at `maxConversations`).

`make_store` makes the store a router config names: this one at `handleStore`, else the
in-process one (memory.py).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from bidirkv.returns import expected_at, next_gap, overdue_at
from bidirkv.router.codec import dumps, loads
from bidirkv.router.store.base import (
    EXPIRED,
    HIT,
    MISS,
    Entry,
    EvictHook,
    Kept,
    PrefixKeys,
    Store,
    StoreUnavailable,
    rank_gap,
)
from bidirkv.router.store.memory import InProcessStore
from bidirkv.router.store.scripts import PUT, TAKE, TRIM

SAFETY_TTL_MS = 60_000
POOL = 64
SCAN = 200
# A store call is on a request's path: a healthy server answers in a millisecond, so a
# call that takes this long counts as a failure.
CALL_TIMEOUT_S = 0.5
# The breaker: after this many failures in a row, calls fail at once (the turn is served
# without reuse) for BREAKER_OPEN_S; then one call tries again.
BREAKER_FAILURES = 3
BREAKER_OPEN_S = 5.0

TRIM_LIMIT = 1000


def _entry(raw: bytes | str) -> Entry:
    d = loads(raw)
    e = Entry(bytes.fromhex(d["key"]), d["params"].encode(), d["decode_url"], d["engine_id"],
              d["num_tokens"], d["expires_at"],
              bytes.fromhex(d["tenant"]) if d.get("tenant") else None, d["prefix_len"],
              d.get("request_id"), d.get("blocks", 0), d.get("chars", 0),
              bytes.fromhex(d["prompt_key"]) if d.get("prompt_key") else None,
              # Stored before kept_at existed: its store time is when it was kept.
              d.get("kept_at", d.get("stored_ms", 0) / 1000), d.get("gap"))
    e.reserved = True
    return e


def _value(e: Entry, stored_ms: int) -> bytes:
    d = {
        "key": e.key.hex(), "params": e.params.decode(), "decode_url": e.decode_url,
        "engine_id": e.engine_id, "num_tokens": e.num_tokens, "expires_at": e.expires_at,
        "prefix_len": e.prefix_len, "request_id": e.request_id, "blocks": e.blocks,
        "chars": e.chars, "stored_ms": stored_ms, "kept_at": e.kept_at,
        **({"prompt_key": e.prompt_key.hex()} if e.prompt_key else {}),
    }
    if e.tenant is not None:  # absent, not null: Lua's cjson null is truthy
        d["tenant"] = e.tenant.hex()
    if e.gap is not None:
        d["gap"] = e.gap
    return dumps(d)


# Calls whose success says the store takes new handles again. A read, or a delete, also
# answers on a read-only replica or under OOM (noeviction refuses only writes that grow the
# data), so it leaves the store marked unavailable until a write gets through.
STORING_OPS = frozenset({"put", "owner"})


class Breaker:
    """Every call to the server goes through `call`: a failure raises StoreUnavailable
    (the turn is served without reuse), and after BREAKER_FAILURES in a row calls fail
    at once for BREAKER_OPEN_S, then one tries again."""

    def __init__(self, on_error: Callable[[str], None] | None = None) -> None:
        self._on_error = on_error or (lambda op: None)
        self.answered = True  # the last call
        self._failures = 0  # in a row
        self._open_until = 0.0  # monotonic; calls fail at once before it

    @property
    def available(self) -> bool:
        return self.answered and time.monotonic() >= self._open_until

    async def call(self, op: str, fn: Any, *args: Any, **kw: Any) -> Any:
        import redis

        if time.monotonic() < self._open_until:
            self._on_error(op)
            raise StoreUnavailable(f"handle store {op}: not tried, {self._failures} calls "
                                   "in a row failed")
        try:
            out = await fn(*args, **kw)
        except (redis.RedisError, OSError) as exc:
            # Every error, not only a lost connection: READONLY after a failover, OOM under
            # noeviction, NOPERM, a failing script or a slow answer leave the store as
            # unusable, and a turn served without reuse beats a 500 or a stall.
            self.answered = False
            self._failures += 1
            if self._failures >= BREAKER_FAILURES:
                self._open_until = time.monotonic() + BREAKER_OPEN_S
            self._on_error(op)
            raise StoreUnavailable(f"handle store {op}: {exc}") from None
        if op in STORING_OPS:
            self.answered = True
        self._failures = 0
        return out


class RedisStore:
    """The store shared by router replicas (see base.py for the rules)."""

    def __init__(self, client: Any, ttl_seconds: float, max_entries: int, on_evict: EvictHook,
                 prefix: str = "bidirkv:", clock: Callable[[], float] = time.time,
                 on_error: Callable[[str], None] | None = None) -> None:
        self.r = client
        self.ttl = ttl_seconds
        self.max_entries = max_entries
        self.max_per_tenant: int | None = None
        self.prefix = prefix
        self._on_evict = on_evict
        self.breaker = Breaker(on_error)
        self._clock = clock
        self._take = client.register_script(TAKE)
        self._put = client.register_script(PUT)
        self._trim_script = client.register_script(TRIM)
        self.owner: str | None = None
        # The gap a handle without one is ranked by: this router's moving average of the
        # gaps it stored (base.rank_gap).
        self.prior_gap: float | None = None
        # Taken entries an extend's put replaced (Kept.replaces): a release drops them.
        self._superseded: set[Entry] = set()

    @classmethod
    def from_url(cls, url: str, password: str | None, ttl_seconds: float, max_entries: int,
                 on_evict: EvictHook, **kw: Any) -> RedisStore:
        import redis.asyncio as redis

        # A bounded pool that waits for a free connection: under a burst, requests queue
        # for a moment instead of failing with "too many connections".
        pool = redis.BlockingConnectionPool.from_url(
            url, password=password or None, max_connections=POOL, timeout=CALL_TIMEOUT_S,
            socket_timeout=CALL_TIMEOUT_S, socket_connect_timeout=CALL_TIMEOUT_S,
            health_check_interval=5)
        return cls(redis.Redis(connection_pool=pool), ttl_seconds, max_entries, on_evict, **kw)

    @property
    def available(self) -> bool:
        return self.breaker.available

    def configure(self, ttl_seconds: float, max_entries: int,
                  max_per_tenant: int | None = None) -> None:
        self.ttl, self.max_entries = ttl_seconds, max_entries
        self.max_per_tenant = max_per_tenant

    # -- plumbing ---------------------------------------------------------------------
    def _k(self, name: str) -> str:
        return self.prefix + name

    async def start(self) -> None:
        """The shared owner id, read again on every call (each store upkeep round): a
        failover to an empty replica loses it, and the routers must converge on one
        owner, or decode frees the blocks of the one that leaves while handles still
        name them. Where the store has none, this router's is planted (a fresh one the
        first time), so the conversations decode holds for it survive the failover."""
        await self.breaker.call("owner", self.r.set, self._k("owner"),
                                self.owner or f"store-{secrets.token_hex(8)}", nx=True)
        raw = await self.breaker.call("owner", self.r.get, self._k("owner"))
        self.owner = raw.decode() if isinstance(raw, bytes) else raw

    async def close(self) -> None:
        # A pool handed to the client is not the client's to close unless asked.
        await self.r.aclose(close_connection_pool=True)

    async def _take_key(self, keyhex: str) -> Entry | None:
        raw = await self.breaker.call("take", self._take,
                                      keys=[self._k("h:" + keyhex), self._k("order")],
                                      args=[keyhex, self.prefix])
        return _entry(raw) if raw else None

    def _evicted(self, reason: str, entries: list[Entry]) -> None:
        if entries:
            self._on_evict(reason, entries)

    # -- the reservation protocol -------------------------------------------------------
    async def lookup(self, key: bytes) -> tuple[str, Entry | None]:
        entry = await self._take_key(key.hex())
        if entry is None:
            return MISS, None
        if entry.expires_at <= self._clock():
            self._evicted("ttl", [entry])
            return EXPIRED, None
        return HIT, entry

    async def look(self, key: bytes) -> Entry | None:
        raw = await self.breaker.call("look", self.r.get, self._k("h:" + key.hex()))
        entry = _entry(raw) if raw else None
        return entry if entry is not None and entry.expires_at > self._clock() else None

    async def lookup_prefix(self, tenant: bytes, text: str, key_of: PrefixKeys
                            ) -> tuple[str, Entry | None]:
        found = await self.breaker.call("prefix", self.r.zrangebyscore,
                                        self._k("len:" + tenant.hex()), 0, len(text),
                                        withscores=True)
        by_len: dict[int, set[str]] = {}
        for member, score in found:
            m = member.decode() if isinstance(member, bytes) else member
            by_len.setdefault(int(score), set()).add(m)
        outcome = MISS
        for length, key in key_of(text, sorted(by_len)):
            if key.hex() in by_len.get(length, ()):
                status, entry = await self.lookup(key)
                if status == HIT:
                    return HIT, entry
                if status == EXPIRED:
                    outcome = EXPIRED
        return outcome, None

    async def _store(self, entry: Entry, only_if_absent: bool
                     ) -> tuple[Entry | None, list[int]]:
        """(the entry that was there, [entries stored, blocks pinned on its replica, the
        tenant's entries, the tenant's blocks on the replica])."""
        now_ms = int(self._clock() * 1000)
        left_ms = max(1, int((entry.expires_at - self._clock()) * 1000))
        # Its expiry less the TTL: the store time, but for a handle kept earlier (recalled)
        order_ms = int((entry.expires_at - self.ttl) * 1000)
        keyhex = entry.key.hex()
        gap = rank_gap(entry, self.prior_gap)
        old, *counts = await self.breaker.call(
            "put", self._put, keys=[self._k("h:" + keyhex), self._k("order")],
            args=[keyhex, _value(entry, now_ms), order_ms, left_ms + SAFETY_TTL_MS, self.prefix,
                  "1" if only_if_absent else "0",
                  repr(overdue_at(entry.kept_at, gap, entry.expires_at)),
                  repr(expected_at(entry.kept_at, gap))])
        return (_entry(old) if old else None), [int(c or 0) for c in counts]

    async def put(self, kept: Kept) -> None:
        now = self._clock()
        entry = Entry.of(kept, now + kept.time_left(self.ttl, now), now)
        if entry.expires_at <= now:  # recalled past its TTL: released, never stored
            return self._evicted("ttl", [entry])
        if kept.gap is not None:
            self.prior_gap = next_gap(self.prior_gap, kept.gap)
        if kept.replaces is not None:  # counted nowhere (taken at lookup): only marked
            self._superseded.add(kept.replaces)
        old, (count, pinned, mine, mine_pinned) = await self._store(entry,
                                                                    only_if_absent=False)
        if old is not None:
            self._evicted("replaced", [old])
        t = kept.tenant.hex() if kept.tenant is not None else ""
        spare = entry.key.hex() if kept.replaces is not None else ""
        if self.max_per_tenant is not None and mine > self.max_per_tenant:
            self._evicted("tenant_cap", await self._trim_index(
                "tenant", "", t, self.max_per_tenant, spare))
        if count > self.max_entries:
            self._evicted("lru", await self._trim_index("count", "", "", self.max_entries, spare))
        cap = kept.tenant_max_pinned
        if cap is not None and mine_pinned > cap:
            self._evicted("tenant_cap", await self._trim_index(
                "tenantpin", kept.decode_url, t, cap, spare))
        if kept.max_pinned is not None and pinned > kept.max_pinned:
            self._evicted("watermark", await self._trim_index(
                "pin", kept.decode_url, "", kept.max_pinned, spare))

    async def release(self, entry: Entry) -> None:
        """P was never asked: back in the store, unless a newer handle took its place."""
        if entry in self._superseded:
            self._superseded.remove(entry)
            self._evicted("replaced", [entry])
            return
        if entry.expires_at <= self._clock():
            self._evicted("ttl", [entry])
            return
        newer, _ = await self._store(entry, only_if_absent=True)
        if newer is not None:
            self._evicted("replaced", [entry])

    async def consume(self, entry: Entry) -> None:
        self._superseded.discard(entry)  # taken at lookup: nothing left in the store

    async def discard(self, entry: Entry, reason: str) -> None:
        self.forget(entry, reason)

    def forget(self, entry: Entry, reason: str) -> None:
        self._superseded.discard(entry)
        self._evicted(reason, [entry])  # taken at lookup: only the blocks remain

    async def end(self, key: bytes) -> bool:
        entry = await self._take_key(key.hex())
        if entry is None:
            return False
        self._evicted("ended", [entry])
        return True

    # -- bulk ------------------------------------------------------------------------------
    async def _take_members(self, members: list[Any]) -> list[Entry]:
        taken = [await self._take_key(m.decode() if isinstance(m, bytes) else m)
                 for m in members]
        return [e for e in taken if e is not None]

    async def _trim_index(self, kind: str, url: str, tenant: str, bound: int,
                          spare: str = "") -> list[Entry]:
        """TRIM (scripts.py); `spare`: a key it never takes (hex)."""
        raw = await self.breaker.call("trim", self._trim_script, keys=[],
                                      args=[self.prefix, kind, url, tenant, bound, TRIM_LIMIT,
                                            repr(self._clock()), spare])
        return [_entry(v) for v in raw or ()]

    async def trim_replica(self, decode_url: str, max_blocks: int,
                           reason: str = "watermark") -> int:
        doomed = await self._trim_index("pin", decode_url, "", max_blocks)
        self._evicted(reason, doomed)
        return len(doomed)

    async def drop_replica(self, decode_url: str, reason: str,
                           keep_engine_id: str | None = None) -> int:
        rep = self._k("rep:" + decode_url)
        members = await self.breaker.call("drop", self.r.zrange, rep, 0, -1)
        doomed = []
        for m in members:
            keyhex = m.decode() if isinstance(m, bytes) else m
            raw = await self.breaker.call("drop", self.r.get, self._k("h:" + keyhex))
            if raw is None:  # expired by the server: TAKE still clears its indexes
                await self._take_key(keyhex)
                continue
            if keep_engine_id is not None and loads(raw).get("engine_id") == keep_engine_id:
                continue
            e = await self._take_key(keyhex)
            if e is not None:
                doomed.append(e)
        self._evicted(reason, doomed)
        return len(doomed)

    async def sweep(self) -> int:
        """Entries past the TTL, taken out by whichever router gets to them first."""
        cutoff = int((self._clock() - self.ttl) * 1000)
        doomed: list[Entry] = []
        while True:
            members = await self.breaker.call("sweep", self.r.zrangebyscore,
                                              self._k("order"), "-inf", cutoff, start=0,
                                              num=SCAN)
            if not members:
                break
            taken = await self._take_members(members)
            doomed += [e for e in taken if e.expires_at <= self._clock()]
            for e in taken:  # stored with a longer TTL by another router's config
                if e.expires_at > self._clock():
                    await self._store(e, only_if_absent=True)
            if len(members) < SCAN:
                break
        self._evicted("ttl", doomed)
        return len(doomed)

    async def pinned(self, decode_url: str) -> int:
        raw = await self.breaker.call("pinned", self.r.hget, self._k("pin"), decode_url)
        return max(0, int(raw)) if raw is not None else 0

    async def count(self) -> int:
        return int(await self.breaker.call("count", self.r.zcard, self._k("order")))


def store_mode(cfg: Any) -> str:
    """`redis` or `memory`: the store `make_store` makes for `cfg`."""
    return "redis" if cfg.handle_store else "memory"


def make_store(cfg: Any, password: str | None, on_evict: EvictHook,
               on_error: Callable[[str], None]) -> Store:
    store: Store
    if store_mode(cfg) == "redis":
        store = RedisStore.from_url(cfg.handle_store, password, cfg.handle_ttl_seconds,
                                    cfg.max_conversations, on_evict, on_error=on_error)
    else:
        store = InProcessStore(cfg.handle_ttl_seconds, cfg.max_conversations, on_evict)
    store.configure(cfg.handle_ttl_seconds, cfg.max_conversations,
                    cfg.max_conversations_per_tenant)
    return store
