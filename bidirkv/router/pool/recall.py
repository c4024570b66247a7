"""The router's recall: with the in-process store, a starting router asks each decode
replica, when it first answers, for the notes this owner left (notes.py) and puts the
live ones back into its store; meanwhile a turn whose handle is not back recomputes.
For `FOLLOW_S` after that it asks again from its cursor: in a rolling update the old
router still keeps handles after the new one started (its own come back too: `merge`).
Until each healthy replica's first recall is done, for at most `READY_WAIT_S` after the
start, `/ready` answers 503 (`waiting`): in a rollout the old router serves meanwhile,
instead of the new one taking turns whose handles are not back yet.

A recalled handle lives what its note has left of the TTL, counted from when it was
kept (`Kept.time_left`), so a restart never makes it outlive decode's blocks; notes past
it are released. A recalled handle is verified when used: never a wrong read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp

from bidirkv.router.codec import loads
from bidirkv.router.pool.notes import decode, merge
from bidirkv.router.pool.residency import ResidencyClient
from bidirkv.router.store.base import Entry, Store, StoreUnavailable
from bidirkv.wire import (
    RECALL_FIELD,
    RECALL_HANDLES_FIELD,
    RECALL_MORE_FIELD,
    RECALL_NEXT_FIELD,
    RECALL_NOTES_FIELD,
)

log = logging.getLogger("bidirkv.router")

# How long after the first recall of a replica its new notes are asked for again, and
# how often: long enough for an old router's last turns during a rollout.
FOLLOW_S = 60.0
FOLLOW_EVERY_S = 5.0
# Pages of one recall, at most (decode's page is up to 1 MiB of notes).
MAX_PAGES = 1000
# How long after its start a router reports not ready while a first recall is under way:
# a recall of thousands of notes takes a second or two; a replica whose residency calls
# fail must not keep a restarted router (the only one after a crash) out of service.
READY_WAIT_S = 30.0


class Recall:
    """Puts this owner's notes on each decode replica back into the in-process store."""

    def __init__(self, residency: ResidencyClient, store: Store,
                 peek: Callable[[bytes], Entry | None], ttl: Callable[[], float],
                 spawn: Callable[[Any], None],
                 on_recalled: Callable[[str, int], None] | None = None) -> None:
        self.residency = residency
        self.store = store
        self.peek = peek
        self.ttl = ttl  # the store's TTL now (a reload may change it)
        self.spawn = spawn
        self.on_recalled = on_recalled or (lambda url, n: None)
        self.follow_s = FOLLOW_S
        self.follow_every_s = FOLLOW_EVERY_S
        self.refused: set[str] = set()  # replicas that take no recall: not followed
        self.started = time.monotonic()
        self.ready_wait_s = READY_WAIT_S
        self.asked: set[str] = set()  # replicas whose first recall ended (or failed)

    def waiting(self, urls: Iterable[str]) -> list[str]:
        """Which of these replicas a starting router still waits for, within
        `ready_wait_s` of its start: those whose first recall has not ended. One without
        the residency route has nothing to give back; one whose recall failed is asked
        again at its next answer, while the router serves."""
        if time.monotonic() - self.started >= self.ready_wait_s:
            return []
        out = []
        for url in urls:
            r = self.residency.replicas.get(url)
            if url not in self.asked and (r is None or r.supported):
                out.append(url)
        return out

    def __call__(self, session: aiohttp.ClientSession, url: str) -> None:
        """A replica answered for the first time: recall from it, beside the traffic."""
        self.spawn(self.replica(session, url))

    async def replica(self, session: aiohttp.ClientSession, url: str) -> int:
        """Recall from `url`, then follow its new notes for a while; handles put back."""
        cursor = await self.pages(session, url, 0)
        self.asked.add(url)
        if cursor is None:
            # Not answered: try again at its next answer.
            self.residency.replica(url).answered = False
            return 0
        restored = cursor[1]
        self.on_recalled(url, restored)
        log.info("recalled %d conversations from decode %s", restored, url)
        until = time.monotonic() + self.follow_s
        at = cursor[0]
        while time.monotonic() < until and url not in self.refused:
            await asyncio.sleep(self.follow_every_s)
            if url not in self.residency.replicas:
                break  # removed from the pool
            got = await self.pages(session, url, at)
            if got is not None:
                at = got[0]
                restored += got[1]
                if got[1]:
                    self.on_recalled(url, got[1])
        return restored

    async def pages(self, session: aiohttp.ClientSession, url: str,
                    cursor: int) -> tuple[int, int] | None:
        """Every page after `cursor`: (the cursor to follow from, handles put back);
        None when decode did not answer a page as asked."""
        restored = 0
        for _ in range(MAX_PAGES):
            try:
                status, raw = await self.residency.post(
                    session, url, self.residency.body(**{RECALL_FIELD: cursor}))
                report = loads(raw) if status == 200 else None
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                log.debug("recall from %s failed: %s", url, type(exc).__name__)
                return None
            if status == 400:
                # A decode that takes no recall (a release before notes): asking again
                # would be refused again.
                log.warning("decode %s refused the recall: %s", url, raw[:200])
                self.refused.add(url)
                return cursor, restored
            if not isinstance(report, dict):
                log.warning("decode %s did not answer the recall (%d): %s", url, status,
                            raw[:200])
                return None
            notes, nxt = report.get(RECALL_NOTES_FIELD), report.get(RECALL_NEXT_FIELD)
            if not isinstance(notes, dict) or not isinstance(nxt, int) or nxt < cursor:
                return None  # a decode without notes: nothing to recall there
            handles = report.get(RECALL_HANDLES_FIELD)
            restored += await self.restore(url, notes,
                                           handles if isinstance(handles, dict) else {})
            cursor = nxt
            if report.get(RECALL_MORE_FIELD) is not True:
                break
        return cursor, restored

    async def restore(self, url: str, notes: dict[str, Any],
                      handles: dict[str, Any]) -> int:
        """Put the live notes of one page back into the store, their handles completed
        from `handles`; how many went in."""
        key = self.residency.notes_key
        if key is None:
            return 0
        recalled = [k for rid, note in notes.items()
                    if (k := decode(key, rid, note, url, handles.get(rid))) is not None]
        live, expired = merge(recalled, self.peek, time.time(), self.ttl())
        # Past the TTL: what this router's sweep would have released had it kept them.
        self.residency.release_ids(url, expired)
        n = 0
        for kept in live:
            try:
                await self.store.put(kept)
            except StoreUnavailable:
                return n
            n += 1
        return n
