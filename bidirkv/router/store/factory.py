"""The store a router config names: shared (Valkey/Redis) at `handleStore`, else
in-process. Apart from both implementations so neither imports the other."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bidirkv.router.store.base import EvictHook, Store
from bidirkv.router.store.memory import InProcessStore
from bidirkv.router.store.shared import RedisStore


def store_mode(cfg: Any) -> str:
    """`redis` or `memory`: the store `make_store` makes for `cfg`."""
    return "redis" if cfg.handle_store else "memory"


def make_store(cfg: Any, password: str | None, on_evict: EvictHook,
               on_error: Callable[[str], None]) -> Store:
    """The store the config names: a shared one at `handleStore`, else in-process."""
    store: Store
    if store_mode(cfg) == "redis":
        store = RedisStore.from_url(cfg.handle_store, password, cfg.handle_ttl_seconds,
                                    cfg.max_conversations, on_evict, on_error=on_error)
    else:
        store = InProcessStore(cfg.handle_ttl_seconds, cfg.max_conversations, on_evict)
    store.configure(cfg.handle_ttl_seconds, cfg.max_conversations,
                    cfg.max_conversations_per_tenant)
    return store
