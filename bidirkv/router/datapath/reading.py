"""Requests whose body is still arriving (admission.py says why they are apart): how
many, in all (maxReadingRequests) and from each client address
(maxReadingRequestsPerSource), so one address cannot hold every place among them. A body
that came with its head is never one of them: nothing of it is waited for.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

PER_SOURCE_KNOB = "maxReadingRequestsPerSource"
ALL_KNOB = "maxReadingRequests"


class Readers:
    """The requests still reading their body, in all and by source address."""

    __slots__ = ("total", "by_source")

    def __init__(self) -> None:
        self.total = 0
        # Only sources with a request reading: an entry goes with its last request.
        self.by_source: dict[str, int] = {}

    def of(self, source: str) -> int:
        return self.by_source.get(source, 0)

    def full(self, source: str, cap: int, per_source: int) -> str | None:
        """The knob that one more request from `source` would go past, or None. The
        source's own cap first: the address holding too many is told so, not that the
        router is full."""
        if self.by_source.get(source, 0) >= per_source:
            return PER_SOURCE_KNOB
        if self.total >= cap:
            return ALL_KNOB
        return None

    @contextmanager
    def reading(self, source: str) -> Iterator[None]:
        """Counted as reading from `source` for the block's length."""
        self.total += 1
        self.by_source[source] = self.by_source.get(source, 0) + 1
        try:
            yield
        finally:
            self.total -= 1
            left = self.by_source[source] - 1
            if left:
                self.by_source[source] = left
            else:
                del self.by_source[source]
