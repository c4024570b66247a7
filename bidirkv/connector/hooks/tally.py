"""Counters the connector's hooks keep for vLLM's connector stats (nixl/stats.py).

vLLM asks the scheduler-side connector for its stats after every step; what was counted
since the last ask is handed over and the tally starts again. Labels are bounded: reuse
reasons (core/reuse.py), handle drop reasons (core/handles.py), release causes
(core/residency.py) and grant refusal reasons (core/residency.py).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# Keys of the stats' data (wire of vLLM's stats: engine core -> API server).
REUSE = "bidirkv_reuse"  # reason -> prefill requests that were offered a handle
REUSED_TOKENS = "bidirkv_reused_tokens"
RECOMPUTED_TOKENS = "bidirkv_recomputed_tokens"
DROPPED = "bidirkv_handles_dropped"  # reason -> handles dropped at admission
UNPROVEN = "bidirkv_unproven_requests"  # requests whose KV was not kept: no router proof
RELEASED = "bidirkv_released_requests"  # cause -> retained requests released early
GRANTS = "bidirkv_grants"  # "granted" or the refusal reason -> read grants answered
LABELLED = (REUSE, DROPPED, RELEASED, GRANTS)
TOTALS = (REUSED_TOKENS, RECOMPUTED_TOKENS, UNPROVEN)
KEYS = LABELLED + TOTALS


def empty() -> dict[str, Any]:
    return {**{k: {} for k in LABELLED}, **{k: 0 for k in TOTALS}}


def merge(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Add `other`'s counts to `into` (missing keys count as zero)."""
    for k in LABELLED:
        mine = into.setdefault(k, {})
        for label, n in (other.get(k) or {}).items():
            mine[label] = mine.get(label, 0) + n
    for k in TOTALS:
        into[k] = into.get(k, 0) + (other.get(k) or 0)
    return into


def is_empty(data: dict[str, Any]) -> bool:
    return not any(data.get(k) for k in KEYS)


@dataclass
class Tally:
    """The engine thread counts here; `take` hands the counts over and starts again."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    _data: dict[str, Any] = field(default_factory=empty)
    # Residency counters are cumulative (the residency route reports them): the tally
    # hands over what they grew by since the last take.
    _seen: dict[str, Counter] = field(default_factory=dict)

    def count(self, key: str, label: str, n: int = 1) -> None:
        with self.lock:
            d = self._data[key]
            d[label] = d.get(label, 0) + n

    def add(self, key: str, n: int) -> None:
        if n:
            with self.lock:
                self._data[key] += n

    def grown(self, key: str, totals: dict[str, int]) -> None:
        """Count what the cumulative `totals` grew by since the last call."""
        with self.lock:
            seen = self._seen.setdefault(key, Counter())
            d = self._data[key]
            for label, n in totals.items():
                if n > seen[label]:
                    d[label] = d.get(label, 0) + n - seen[label]
                    seen[label] = n

    def take(self) -> dict[str, Any] | None:
        with self.lock:
            data, self._data = self._data, empty()
        return None if is_empty(data) else data
