"""The handle store the router talks to: one async interface, two implementations.

- `InProcessStore` (router/store.py underneath): one router replica, the default.
- `RedisStore` (router/redisstore.py): Valkey/Redis/ElastiCache shared by router
  replicas, so turns of one conversation may reach any replica and survive restarts.

Both keep the same semantics: tenant-scoped keys (the caller hashes them), single use
(`lookup` takes the entry; `release` puts it back when P was never asked; `consume` and
`discard` end it), a TTL, a bound on the number of entries, blocks pinned per decode
replica with a trim to a watermark, both fair between tenants (the one holding the most
loses its oldest first), per-tenant caps (entries; blocks on one replica), and every
entry they drop without P having read it handed to `on_evict`, so its decode blocks are
released (router/residency.py).

`owner` is the identity decode holds retained KV for: None means "this router process"
(a restarted in-process router is a new owner); a shared store has one owner id for all
its routers, so a replica that restarts keeps the conversations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from .store import Entry, HandleStore

EvictHook = Callable[[str, list[Entry]], None]
PrefixKeys = Callable[[str, list[int]], Iterator[tuple[int, bytes]]]


class StoreUnavailable(Exception):
    """The shared store did not answer; the caller serves without reuse."""


class Store(Protocol):
    owner: str | None

    @property
    def available(self) -> bool: ...

    def configure(self, ttl_seconds: float, max_entries: int,
                  max_per_tenant: int | None = None) -> None: ...
    async def lookup(self, key: bytes) -> tuple[str, Entry | None]: ...
    async def lookup_prefix(self, tenant: bytes, text: str, key_of: PrefixKeys
                            ) -> tuple[str, Entry | None]: ...
    async def put(self, key: bytes, params: bytes, decode_url: str, engine_id: str | None,
                  num_tokens: int, *, tenant: bytes | None = None, prefix_len: int = 0,
                  request_id: str | None = None, blocks: int = 0,
                  max_pinned: int | None = None,
                  tenant_max_pinned: int | None = None) -> None:
        """Store; then keep the entry bounds and, given `max_pinned` (the replica's
        watermark) and `tenant_max_pinned` (the tenant's share of it), the block bounds."""
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


def make_store(cfg: Any, password: str | None, on_evict: EvictHook,
               on_error: Callable[[str], None]) -> Store:
    """The store the config names: a shared one at `handleStore`, else in-process."""
    store: Store
    if cfg.handle_store:
        from .redisstore import RedisStore

        store = RedisStore.from_url(cfg.handle_store, password, cfg.handle_ttl_seconds,
                                    cfg.max_conversations, on_evict, on_error=on_error)
    else:
        store = InProcessStore(cfg.handle_ttl_seconds, cfg.max_conversations, on_evict)
    store.configure(cfg.handle_ttl_seconds, cfg.max_conversations,
                    cfg.max_conversations_per_tenant)
    return store


class InProcessStore:
    """The router process's own store: `HandleStore` behind the async interface."""

    owner: str | None = None
    available = True

    def __init__(self, ttl_seconds: float, max_entries: int, on_evict: EvictHook) -> None:
        self.local = HandleStore(ttl_seconds, max_entries, on_evict=on_evict)

    def configure(self, ttl_seconds: float, max_entries: int,
                  max_per_tenant: int | None = None) -> None:
        self.local.configure(ttl_seconds, max_entries, max_per_tenant)

    def __len__(self) -> int:
        return len(self.local)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.local)

    async def lookup(self, key: bytes) -> tuple[str, Entry | None]:
        return self.local.lookup(key)

    async def lookup_prefix(self, tenant: bytes, text: str, key_of: PrefixKeys
                            ) -> tuple[str, Entry | None]:
        return self.local.lookup_prefix(tenant, text, key_of)

    async def put(self, key: bytes, params: bytes, decode_url: str, engine_id: str | None,
                  num_tokens: int, *, tenant: bytes | None = None, prefix_len: int = 0,
                  request_id: str | None = None, blocks: int = 0,
                  max_pinned: int | None = None,
                  tenant_max_pinned: int | None = None) -> None:
        self.local.put(key, params, decode_url, engine_id, num_tokens, tenant=tenant,
                       prefix_len=prefix_len, request_id=request_id, blocks=blocks)
        if tenant_max_pinned is not None:
            self.local.trim_tenant_replica(decode_url, tenant, tenant_max_pinned)
        if max_pinned is not None:
            self.local.trim_replica(decode_url, max_pinned)

    async def release(self, entry: Entry) -> None:
        self.local.release(entry)

    async def consume(self, entry: Entry) -> None:
        self.local.consume(entry)

    async def discard(self, entry: Entry, reason: str) -> None:
        self.local.discard(entry, reason)

    def forget(self, entry: Entry, reason: str) -> None:
        self.local.discard(entry, reason)

    async def end(self, key: bytes) -> bool:
        return self.local.end(key)

    async def trim_replica(self, decode_url: str, max_blocks: int,
                           reason: str = "watermark") -> int:
        return self.local.trim_replica(decode_url, max_blocks, reason)

    async def drop_replica(self, decode_url: str, reason: str,
                           keep_engine_id: str | None = None) -> int:
        return self.local.drop_replica(decode_url, reason, keep_engine_id)

    async def sweep(self) -> int:
        return self.local.sweep()

    async def pinned(self, decode_url: str) -> int:
        return self.local.pinned.get(decode_url, 0)

    async def count(self) -> int:
        return len(self.local)

    async def close(self) -> None:
        return None
