"""What every part of the data path shares, declared in one place: `Context`.

The router is a few parts (clients, health, upkeep, admission, conversations, placing,
the legs and the flow that runs them), each a class that takes the context and the parts
it calls in its constructor. What one request carries across them is its `Turn`
(turn.py), handed to each call. Nothing here is per request: a request that needs a
value of its own puts it on its Turn.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp

from bidirkv.router.config import RouterConfig
from bidirkv.router.metrics import Metrics
from bidirkv.router.pool.backends import DECODE, PREFILL, Backend, Pool
from bidirkv.router.pool.notes import note_key
from bidirkv.router.pool.placement import CostModel
from bidirkv.router.pool.recall import Recall
from bidirkv.router.pool.residency import ResidencyClient
from bidirkv.router.request.identity import LookupKeys
from bidirkv.router.store.base import Entry, Store
from bidirkv.router.store.memory import InProcessStore
from bidirkv.router.store.shared import make_store, store_mode
from bidirkv.router.tracing.spans import Traces


@dataclass(frozen=True)
class Timeouts:
    """The client timeouts of one config (a reload swaps the whole set; a request in
    flight keeps the one it started with). The legs' client (engine/http.py) reads
    `prefill` and `decode` as bounds on the connect (sock_connect), the whole exchange
    (total) and each wait for bytes (sock_read); aiohttp's session takes `probe`, and
    `prefill` for a client's GET /v1/models (flow.py)."""

    prefill: aiohttp.ClientTimeout
    decode: aiohttp.ClientTimeout
    probe: aiohttp.ClientTimeout


def timeouts_of(cfg: RouterConfig) -> Timeouts:
    t = cfg.timeouts
    probe = max(1.0, min(5.0, cfg.health_check_interval_seconds))
    return Timeouts(
        prefill=aiohttp.ClientTimeout(total=t.prefill_seconds, sock_connect=t.connect_seconds),
        decode=aiohttp.ClientTimeout(total=None, sock_connect=t.connect_seconds,
                                     sock_read=t.decode_seconds),
        probe=aiohttp.ClientTimeout(total=probe, sock_connect=t.connect_seconds),
    )


class Context:
    """The router's shared state. `cfg` and `timeouts` are replaced whole by a reload;
    `max_model_len` is learned by the health loop and read at admission."""

    def __init__(self, cfg: RouterConfig, metrics: Metrics | None = None,
                 handle_key: bytes | None = None, store_password: str | None = None) -> None:
        self.cfg = cfg
        self.timeouts = timeouts_of(cfg)
        # The resource's handle key: signs the proof that a leg comes from this router.
        self.handle_key = handle_key
        # Lookup keys every replica holding this handle key computes alike (identity.py).
        self.keys = LookupKeys(handle_key)
        self.metrics = metrics or Metrics()
        # The served model's context length, from prefill's /v1/models: a max_tokens
        # above it is refused before any engine works on the request.
        self.max_model_len: int | None = None
        # Per-token costs and characters per token, learned from the legs (placement.py).
        self.costs = CostModel()
        self.prefill = Pool(PREFILL, cfg.prefill)
        self.decode = Pool(DECODE, cfg.decode)
        self.residency = ResidencyClient(cfg.owner_lease_seconds, self.timeouts.probe,
                                         on_result=self._on_residency_call,
                                         handle_key=handle_key)
        # The request spans and their exporters (tracing/spans.py); a reload may replace them.
        # First: a span file that cannot be opened stops the start before anything else.
        self.traces = Traces(cfg.tracing)
        self.store: Store = make_store(cfg, store_password, self.evicted,
                                       self._on_store_error)
        # Kept for the router's life: a reload does not change the store.
        self.metrics.store_info.labels(store_mode(cfg)).set(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        store = self.store
        if handle_key and isinstance(store, InProcessStore):
            # The in-process store dies with the process: decode keeps a note of each
            # handle, and a restarted router recalls them (pool/recall.py).
            self.residency.notes_key = note_key(handle_key)
            self.residency.on_first_answer = Recall(
                self.residency, store, store.peek, lambda: store.ttl, self.spawn)

    def backends(self) -> list[Backend]:
        return self.prefill.backends + self.decode.backends

    def max_pinned(self, url: str) -> int | None:
        """Blocks this router's handles may pin on a replica (None: capacity unknown)."""
        total = self.residency.capacity(url)
        return None if total is None else int(self.cfg.retention_watermark * total)

    def spawn(self, coro: Any) -> None:
        """Run `coro` beside the request (cancelled at close, never awaited)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    # The store's and residency's callbacks: what they report goes to the metrics, and
    # an evicted handle's blocks are released on its decode (also called for a handle
    # that could not go back to the store).
    def evicted(self, reason: str, entries: list[Entry]) -> None:
        self.metrics.evicted(reason, len(entries))
        self.residency.release(reason, entries)

    def _on_store_error(self, op: str) -> None:
        self.metrics.store_errors.labels(op).inc()

    def _on_residency_call(self, url: str, result: str, released: int) -> None:
        self.metrics.residency_calls.labels(result).inc()
        if released:
            self.metrics.releases_sent.labels(result).inc(released)
