"""The order decode's reclaim takes retained requests in, O(log n) per change.

- `Heaviest`: the tenant holding the most releasable blocks (then the most entries; on a
  tie, the tenant that has held releasable entries the longest).
- `ReleaseOrder`: one tenant's releasable entries, overdue ones first (the longest overdue
  first), then the one expected back last (bidirkv/returns.py); on a tie, the one kept
  first. Both orders are fixed once an entry is kept, which is what lets a heap serve them.

Both run on `IndexedHeap`, a binary heap that knows where each key sits, so a weight that
changes or an entry that leaves (granted, freed) is moved or taken out in place. Lazy
deletion (dead items dropped at the top, the heap rebuilt now and then) would be shorter,
but decode reclaims inside the scheduler step, under the residency's lock, where one
rebuild costs that step the whole index.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable
from typing import Any

from bidirkv.returns import expected_at, overdue_at


class IndexedHeap:
    """A min-heap of keys by priority. Priorities must be distinct (end them with a
    sequence number): keys are never compared."""

    __slots__ = ("_items", "_pos")

    def __init__(self) -> None:
        self._items: list[tuple[tuple, Hashable]] = []
        self._pos: dict[Hashable, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._pos

    def first(self) -> tuple[tuple, Hashable]:
        """(priority, key) of the smallest priority; IndexError when empty."""
        return self._items[0]

    def set(self, key: Hashable, priority: tuple) -> None:
        i = self._pos.get(key)
        if i is None:
            self._items.append((priority, key))
            i = self._pos[key] = len(self._items) - 1
        else:
            self._items[i] = (priority, key)
        self._sift_down(self._sift_up(i))

    def remove(self, key: Hashable) -> None:
        i = self._pos.pop(key, None)
        if i is None:
            return
        last = self._items.pop()
        if i < len(self._items):
            self._items[i] = last
            self._pos[last[1]] = i
            self._sift_down(self._sift_up(i))

    def _swap(self, i: int, j: int) -> None:
        items = self._items
        items[i], items[j] = items[j], items[i]
        self._pos[items[i][1]] = i
        self._pos[items[j][1]] = j

    def _sift_up(self, i: int) -> int:
        items = self._items
        while i > 0:
            parent = (i - 1) // 2
            if items[i][0] >= items[parent][0]:
                break
            self._swap(i, parent)
            i = parent
        return i

    def _sift_down(self, i: int) -> int:
        items, n = self._items, len(self._items)
        while True:
            smallest, left = i, 2 * i + 1
            for child in (left, left + 1):
                if child < n and items[child][0] < items[smallest][0]:
                    smallest = child
            if smallest == i:
                return i
            self._swap(i, smallest)
            i = smallest


class Heaviest:
    """Weights per key (tuples, the largest first) with the heaviest at hand."""

    __slots__ = ("_heap", "_since", "_seq")

    def __init__(self) -> None:
        self._heap = IndexedHeap()
        self._since: dict[Hashable, int] = {}  # when the key got its first weight: ties
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def set(self, key: Hashable, weight: tuple | None) -> None:
        """The key's weight from now on (None: it leaves)."""
        if weight is None:
            self._heap.remove(key)
            self._since.pop(key, None)
            return
        since = self._since.get(key)
        if since is None:
            since = self._since[key] = next(self._seq)
        self._heap.set(key, (*(-x for x in weight), since))

    def top(self) -> Hashable:
        """The heaviest key (None is a key like any other: ask `len` first)."""
        return self._heap.first()[1]


class ReleaseOrder:
    """One tenant's releasable entries, by key (a request id)."""

    __slots__ = ("_due", "_back", "_seq")

    def __init__(self) -> None:
        self._due = IndexedHeap()  # when it turns overdue, the earliest first
        self._back = IndexedHeap()  # when it is expected back, the latest first
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._due)

    def add(self, key: Hashable, kept_at: float, gap: float,
            expires: float = math.inf) -> None:
        seq = next(self._seq)
        self._due.set(key, (overdue_at(kept_at, gap, expires), seq))
        self._back.set(key, (-expected_at(kept_at, gap), seq))

    def remove(self, key: Hashable) -> None:
        self._due.remove(key)
        self._back.remove(key)

    def first(self, now: float) -> Any:
        """The key to release first at `now`; IndexError when empty."""
        (due, _), key = self._due.first()
        if due < now:
            return key
        return self._back.first()[1]
