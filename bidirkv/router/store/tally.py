"""Weights per tenant with the heaviest one at hand: what fair eviction asks for.

Fair eviction takes from whoever holds the most (entries, or blocks on one replica), so a
tenant that opens conversations by the thousand spends its own handles and nobody
else's; with one tenant it is plain oldest-first. `heaviest()` is amortised O(log n): a
max-heap whose stale items (weights that changed since they were pushed) are dropped when
they reach the top, and which is rebuilt when stale items outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Any


class Tally:
    __slots__ = ("_w", "_heap", "_seq")

    def __init__(self) -> None:
        self._w: dict[Hashable, int] = {}
        self._heap: list[tuple[int, int, Any]] = []
        self._seq = 0  # ties: the first pushed wins, and tenants need not be comparable

    def __len__(self) -> int:
        return len(self._w)

    def get(self, who: Hashable) -> int:
        return self._w.get(who, 0)

    def add(self, who: Hashable, delta: int) -> int:
        w = self._w.get(who, 0) + delta
        if w > 0:
            self._w[who] = w
            self._seq += 1
            heapq.heappush(self._heap, (-w, self._seq, who))
            if len(self._heap) > 2 * len(self._w) + 64:
                self._rebuild()
        else:
            self._w.pop(who, None)
        return max(w, 0)

    def _rebuild(self) -> None:
        self._heap = [(-w, i, who) for i, (who, w) in enumerate(self._w.items())]
        heapq.heapify(self._heap)
        self._seq = len(self._heap)

    def heaviest(self) -> Hashable | None:
        while self._heap:
            neg, _, who = self._heap[0]
            if self._w.get(who) == -neg:
                return who
            heapq.heappop(self._heap)
        return None
