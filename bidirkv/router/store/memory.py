"""The in-process handle store: `HandleStore` (handles.py) behind the async `Store`
interface (base.py), for one router replica (the default)."""

from __future__ import annotations

from collections.abc import Iterator

from bidirkv.router.store.base import EvictHook, PrefixKeys
from bidirkv.router.store.handles import Entry, HandleStore


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
                  request_id: str | None = None, blocks: int = 0, chars: int = 0,
                  prompt_key: bytes | None = None, max_pinned: int | None = None,
                  tenant_max_pinned: int | None = None, kept_at: float | None = None,
                  gap: float | None = None) -> None:
        self.local.put(key, params, decode_url, engine_id, num_tokens, tenant=tenant,
                       prefix_len=prefix_len, request_id=request_id, blocks=blocks,
                       chars=chars, prompt_key=prompt_key, kept_at=kept_at, gap=gap)
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
