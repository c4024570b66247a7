"""The order the replica bounds take one tenant's handles on one decode replica in:
overdue conversations first, then the one expected back last (bidirkv/returns.py), the
same rule decode follows under pressure. The memory store keeps one `ReturnOrder` per
replica and tenant; the shared store keeps the same two orders as sorted sets.

Both orders are fixed when a handle is stored, so two heaps serve them: one by when the
conversation turns overdue (the earliest first), one by when it is expected back (the
latest first). Removed handles stay in the heaps until they reach the top (lazy
deletion), and a heap is rebuilt once it holds more dead items than live ones.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

from bidirkv.returns import expected_at, overdue_at
from bidirkv.router.store.entry import Entry

_SEQ = itertools.count()  # ties go to the handle stored first
# Below this many items a heap is never rebuilt: rebuilding would cost more than it saves.
_COMPACT_MIN = 64


def rank_gap(entry: Entry, prior: float | None) -> float:
    """The gap a handle is ranked by: its conversation's own, else the typical one."""
    if entry.gap is not None:
        return entry.gap
    return prior or 0.0


class ReturnOrder:
    __slots__ = ("_due", "_back")

    def __init__(self) -> None:
        self._due: list[tuple[float, int, Entry]] = []
        self._back: list[tuple[float, int, Entry]] = []

    def add(self, entry: Entry, gap: float, expires: float = math.inf) -> None:
        """`expires`: when the handle expires, on the clock of `kept_at` (an expired one
        is overdue whatever its gap)."""
        seq = next(_SEQ)
        heapq.heappush(self._due, (overdue_at(entry.kept_at, gap, expires), seq, entry))
        heapq.heappush(self._back, (-expected_at(entry.kept_at, gap), seq, entry))

    def victim(self, now: float, live: Callable[[Entry], bool],
               skip: Callable[[Entry], bool]) -> Entry | None:
        """The handle to drop first among those `live` and not `skip`ped (reserved, or
        pinning nothing); dead ones met on the way are discarded."""
        due = self._top(self._due, live, skip)
        if due is not None and due[0] < now:
            return due[2]
        back = self._top(self._back, live, skip)
        return back[2] if back is not None else None

    def compact(self, live: Callable[[Entry], bool], alive: int) -> None:
        """Rebuild the heaps without dead items once they outnumber the `alive` ones."""
        for heap in (self._due, self._back):
            if len(heap) > max(_COMPACT_MIN, 2 * alive):
                heap[:] = [item for item in heap if live(item[2])]
                heapq.heapify(heap)

    @staticmethod
    def _top(heap: list[tuple[float, int, Entry]], live: Callable[[Entry], bool],
             skip: Callable[[Entry], bool]) -> tuple[float, int, Entry] | None:
        aside = []  # skipped, not dead: back on the heap after the look
        found = None
        while heap:
            item = heap[0]
            if not live(item[2]):
                heapq.heappop(heap)
            elif skip(item[2]):
                aside.append(heapq.heappop(heap))
            else:
                found = item
                break
        for item in aside:
            heapq.heappush(heap, item)
        return found
