"""The handle store's interface (`Store`): one async protocol, two implementations.

- `InProcessStore` (memory.py, over handles.py's `HandleStore`): one router replica,
  the default.
- `RedisStore` (shared.py): Valkey/Redis/ElastiCache shared by router
  replicas, so turns of one conversation may reach any replica and survive restarts.

Both keep the same semantics: tenant-scoped keys (the caller hashes them), single use
(`lookup` takes the entry; `release` puts it back when P was never asked; `consume` and
`discard` end it), a TTL, a bound on the number of entries, blocks pinned per decode
replica with a trim to a watermark, both fair between tenants (the one holding the most
loses its oldest first), per-tenant caps (entries; blocks on one replica), and every
entry they drop without P having read it handed to `on_evict`, so its decode blocks are
released (bidirkv/router/pool/residency.py).

`owner` is the identity decode holds retained KV for: None means "this router process"
(a restarted in-process router is a new owner); a shared store has one owner id for all
its routers, so a replica that restarts keeps the conversations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from bidirkv.router.store.entry import Entry

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
                  request_id: str | None = None, blocks: int = 0, chars: int = 0,
                  prompt_key: bytes | None = None, max_pinned: int | None = None,
                  tenant_max_pinned: int | None = None, kept_at: float | None = None,
                  gap: float | None = None) -> None:
        """Store; then keep the entry bounds and, given `max_pinned` (the replica's
        watermark) and `tenant_max_pinned` (the tenant's share of it), the block bounds.
        `kept_at` (Unix seconds; None: now) and `gap` (the conversation's moving-average
        idle time, None: unknown) say when it is expected back (bidirkv/returns.py)."""
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
