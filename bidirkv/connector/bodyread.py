"""How the residency route reads a body: only once the signature checked, only as long as
it signed, a few at once and each within a deadline (bidirkv/connector/endpoint.py).

The signature (bidirkv/proof.py) carries the body's length and digest, so a caller without
the handle key is refused before a byte is read. What is left is a caller replaying a
header it saw (good for 60 s): it can send that body's length of anything, slowly. So at
most MAX_READS bodies are read at once, per API server process; past that a call is
answered 503 at once rather than queued (a queued call holds its connection all the
same), and a body that has not arrived within READ_S is answered 408. The trade-off: a
replayer holding every slot makes the router's calls of those seconds fail too; the
router sends their releases again next round, and its lease outlasts a few rounds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Bodies read at once. The callers are the router's processes (a lease renewal, a batch of
# releases and a page of recall each at most) and the launcher: well under this.
MAX_READS = 8
# A full body (about 22 MB) crosses a pod network in well under a second.
READ_S = 10.0


class ReadSlots:
    """At most `limit` reads at once; one past it is turned away, not queued."""

    def __init__(self, limit: int = MAX_READS) -> None:
        self.limit = limit
        self.busy = 0

    @contextmanager
    def take(self) -> Iterator[bool]:
        """True while the caller holds a slot; False: none was free."""
        if self.busy >= self.limit:
            yield False
            return
        self.busy += 1
        try:
            yield True
        finally:
            self.busy -= 1


async def read_body(request: Any, length: int, deadline_s: float = READ_S) -> bytes | None:
    """The request's body of `length` bytes, or None when more arrives (not read further).
    Raises TimeoutError when it has not all arrived within `deadline_s`."""
    chunks, size = [], 0
    async with asyncio.timeout(deadline_s):
        async for chunk in request.stream():
            size += len(chunk)
            if size > length:
                return None
            chunks.append(chunk)
    return b"".join(chunks)
