"""What every part of the data path shares, declared in one place: `Context`.

The router is a few parts (clients, health, upkeep, admission, conversations, placing,
the legs and the flow that runs them), each a class that takes the context and the parts
it calls in its constructor. What one request carries across them is its `Turn`
(turn.py), handed to each call. Nothing here is per request: a request that needs a
value of its own puts it on its Turn.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bidirkv.router.config import RouterConfig
from bidirkv.router.datapath.parents import Parents, Prefixes
from bidirkv.router.engine.clients import client_timeouts
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


class Context:
    """The router's shared state. `cfg` and `client_timeouts` are replaced whole by a reload;
    `max_model_len` is learned by the health loop and read at admission."""

    def __init__(self, cfg: RouterConfig, metrics: Metrics | None = None,
                 handle_key: bytes | None = None, store_password: str | None = None) -> None:
        self.cfg = cfg
        self.client_timeouts = client_timeouts(cfg)
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
        self.residency = ResidencyClient(cfg.owner_lease_seconds, self.client_timeouts.probe,
                                         on_result=self._on_residency_call,
                                         handle_key=handle_key)
        # The request spans and their exporters (tracing/spans.py); a reload may replace them.
        # First: a span file that cannot be opened stops the start before anything else.
        self.traces = Traces(cfg.tracing)
        self.store: Store = make_store(cfg, store_password, self.evicted,
                                       self._on_store_error)
        # Where children of the stored conversations find their prefixes (parents.py).
        self.parents = Parents(self.keys, self.store, Prefixes())
        # Kept for the router's life: a reload does not change the store.
        self.metrics.store_info.labels(store_mode(cfg)).set(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        store = self.store
        self.recall: Recall | None = None
        if handle_key and isinstance(store, InProcessStore):
            # The in-process store dies with the process: decode keeps a note of each
            # handle, and a restarted router recalls them (pool/recall.py).
            self.residency.notes_key = note_key(handle_key)
            self.recall = Recall(self.residency, store, store.peek, lambda: store.ttl,
                                 self.spawn, self._on_recalled)
            self.residency.on_first_answer = self.recall

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

    def _on_recalled(self, url: str, n: int) -> None:
        self.metrics.recalled.labels(url).inc(n)

    def _on_residency_call(self, url: str, result: str, released: int) -> None:
        self.metrics.residency_calls.labels(result).inc()
        if released:
            self.metrics.releases_sent.labels(result).inc(released)
