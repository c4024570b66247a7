"""The router's side of decode residency: it owns the handles, so it says what goes
(the engines' side is bidirkv/connector/core/residency.py). Per decode replica, on
`POST /bidirkv/residency`: the releases of every handle dropped unread, sent at once in
batches off the request path; the lease, renewed every health round; the replica's
capacity, learned for `retentionWatermark`; with the in-process store, a note beside each
kept handle (notes.py) and the first answer handed to the recall (recall.py).

Nothing here waits on a request: a failed call costs only reuse (decode's lease and
pressure reclaim still free the blocks) and its releases go with the next call. A batch
decode refuses (400) does not hold the lease back; a replica without the route (404) is
left alone; `close` sends what is queued within `SHUTDOWN_FLUSH_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bidirkv.proof import residency_headers, residency_target
from bidirkv.router.codec import dumps, loads
from bidirkv.router.pool.notes import encode, stable_owner
from bidirkv.router.store.base import Kept
from bidirkv.wire import (
    MAX_KEEP,
    RESIDENCY_KEEP_FIELD,
    RESIDENCY_PATH,
    RESIDENCY_VERSION_FIELD,
    VERSION,
)

log = logging.getLogger("bidirkv.router")

BATCH = 1000
# Releases kept for a retry while a replica does not answer; past this the oldest go
# (decode frees them anyway once this router's lease lapses, or under pressure).
MAX_PENDING = 100_000
# Notes waiting for a replica that does not answer; past this the oldest go (those
# conversations are then only lost by a restart, as without notes).
MAX_PENDING_NOTES = 10_000
# How long a router that stops may take to send what it still has queued for decode
# (the last turns' notes and releases), after its turns in flight: part of its stop's
# deadline (bidirkv/router/server/app.py).
SHUTDOWN_FLUSH_S = 5.0
# Reasons the store drops a handle whose blocks decode can no longer hold for us, or
# already freed: nothing to release.
NO_RELEASE = frozenset({"engine_changed", "replica_removed", "replica_unhealthy"})


@dataclass
class Replica:
    url: str
    pending: list[str] = field(default_factory=list)
    num_blocks: int | None = None  # from the engine; None until it answered
    supported: bool = True
    last: dict[str, Any] = field(default_factory=dict)  # the engine's last report
    keeping: dict[str, str] = field(default_factory=dict)  # request id -> note to send
    answered: bool = False  # it answered once (the recall starts then)


class ResidencyClient:
    """The client of decode's residency route: this router's releases and lease, and the
    capacity each replica reports."""

    def __init__(self, lease_seconds: float, timeout: aiohttp.ClientTimeout,
                 on_result: Callable[[str, str, int], None] | None = None,
                 owner: str | None = None, handle_key: bytes | None = None) -> None:
        # One id for every process of the resource (derived from its handle key): a
        # restarted router renews its predecessor's lease, and decode keeps its blocks.
        # Without a key (no call would be answered anyway) a new id per process.
        self.owner = owner or (stable_owner(handle_key) if handle_key
                               else f"router-{uuid.uuid4().hex[:16]}")
        self.lease_seconds = lease_seconds
        self.timeout = timeout
        # Signs every call (bidirkv/proof.py): the engines answer 401 to anyone else.
        self.handle_key = handle_key
        self.replicas: dict[str, Replica] = {}
        self._on_result = on_result or (lambda url, result, n: None)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None  # the sender's, for the flush
        # Set with the in-process store (context.py): the key notes are signed with, and
        # what a replica's first answer starts (the recall of its notes).
        self.notes_key: bytes | None = None
        self.on_first_answer: Callable[[aiohttp.ClientSession, str], None] | None = None

    def replica(self, url: str) -> Replica:
        r = self.replicas.get(url)
        if r is None:
            r = self.replicas[url] = Replica(url)
        return r

    def forget(self, url: str) -> None:
        self.replicas.pop(url, None)

    def capacity(self, url: str) -> int | None:
        r = self.replicas.get(url)
        return r.num_blocks if r is not None else None

    # -- called by the store's evict hook (synchronous, on the request path) -------------
    def release(self, reason: str, entries: list[Any]) -> int:
        if reason in NO_RELEASE:
            return 0
        n = 0
        for e in entries:
            if e.request_id:
                n += self.release_ids(e.decode_url, [e.request_id])
        return n

    def release_ids(self, url: str, request_ids: list[str]) -> int:
        r = self.replica(url)
        if not r.supported:
            return 0  # nobody to tell: a replica without the route frees by vLLM's TTL
        for rid in request_ids:
            r.keeping.pop(rid, None)  # a note beside a released request is kept by no one
        r.pending.extend(request_ids)
        if request_ids:
            self._wake.set()
        return len(request_ids)

    def keep(self, kept: Kept, params: dict[str, Any]) -> None:
        """Queue the note of a handle the store kept (in-process store only; `params`: the
        handle, as parsed), for the next call to its replica."""
        if self.notes_key is None or kept.request_id is None:
            return
        r = self.replica(kept.decode_url)
        note = encode(self.notes_key, kept, time.time(), params) if r.supported else None
        if note is None:
            return
        r.keeping[kept.request_id] = note
        while len(r.keeping) > MAX_PENDING_NOTES:
            del r.keeping[next(iter(r.keeping))]
        self._wake.set()

    @staticmethod
    def _requeue(r: Replica, batch: list[str], notes: dict[str, str] | None = None) -> None:
        r.pending = (batch + r.pending)[-MAX_PENDING:]
        if notes:
            r.keeping = {**notes, **r.keeping}
            while len(r.keeping) > MAX_PENDING_NOTES:
                del r.keeping[next(iter(r.keeping))]

    # -- the sender --------------------------------------------------------------------
    def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        self._task = asyncio.create_task(self._flush_loop(session), name="router-residency")

    async def close(self, flush_s: float = 0.0) -> None:
        """Stop the sender, then send what is still queued, for up to `flush_s`: a router
        that stops cleanly leaves its last turns' notes on decode (the router after it
        recalls them) and frees what it released, instead of dropping both."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if flush_s <= 0 or self._session is None:
            return
        self.on_first_answer = None  # a router on its way out recalls nothing
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(flush_s):
                await self.flush(self._session)
        left = [(len(r.pending), len(r.keeping)) for r in self.replicas.values()
                if (r.pending or r.keeping) and r.supported]
        if left:
            log.warning("stopping with %d releases and %d notes not sent to decode",
                        sum(n for n, _ in left), sum(n for _, n in left))

    async def flush(self, session: aiohttp.ClientSession) -> None:
        """Send every queued release and note now, in as many calls as they take, while
        each round gets one through (a replica that does not answer is not waited for)."""
        while todo := [r.url for r in self.replicas.values()
                       if (r.pending or r.keeping) and r.supported]:
            if not any(await asyncio.gather(*(self.call(session, url) for url in todo))):
                return

    async def _flush_loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            todo = [r for r in self.replicas.values()
                    if (r.pending or r.keeping) and r.supported]
            await asyncio.gather(*(self.call(session, r.url) for r in todo))

    def body(self, **extra: Any) -> dict[str, Any]:
        """A call's body: this router's lease, and `extra`."""
        return {"owner": self.owner, "leaseSeconds": self.lease_seconds, **extra,
                RESIDENCY_VERSION_FIELD: VERSION}

    async def post(self, session: aiohttp.ClientSession, url: str,
                   body: dict[str, Any]) -> tuple[int, bytes]:
        """POST a signed residency call; (status, body). Raises what aiohttp raises."""
        data = dumps(body)
        headers = {"Content-Type": "application/json"}
        if self.handle_key:
            # Signed for this replica only: a call seen on the way fits no other engine.
            headers.update(residency_headers(self.handle_key, residency_target(url),
                                             RESIDENCY_PATH, data))
        async with session.post(url + RESIDENCY_PATH, data=data, timeout=self.timeout,
                                headers=headers) as resp:
            return resp.status, await resp.read()

    async def call(self, session: aiohttp.ClientSession, url: str) -> bool:
        """One call to a replica: renew the lease, send pending releases and notes, read
        capacity."""
        r = self.replica(url)
        if not r.supported:
            return False
        batch, r.pending = r.pending[:BATCH], r.pending[BATCH:]
        notes = dict(itertools.islice(r.keeping.items(), MAX_KEEP))
        for rid in notes:
            del r.keeping[rid]
        extra: dict[str, Any] = {"release": batch}
        if notes:
            extra[RESIDENCY_KEEP_FIELD] = notes
        try:
            status, raw = await self.post(session, url, self.body(**extra))
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            # Kept for the next round (bounded): a replica that was briefly away still
            # gets told, instead of holding the blocks until this router's lease lapses.
            self._requeue(r, batch, notes)
            self._on_result(url, "error", len(batch))
            log.debug("residency call failed url=%s: %s", url, type(exc).__name__)
            return False
        except asyncio.CancelledError:  # the router stops: its flush sends them (close)
            self._requeue(r, batch, notes)
            raise
        if status == 400 and (batch or notes):
            # Decode refused this batch: renew the lease alone, so a batch it cannot take
            # never costs every conversation of this router (decode skips ids it cannot
            # read, so this is a decode of another version). The batch is dropped: sent
            # again it would be refused again (its notes too: those conversations are
            # then only lost by a restart).
            log.warning("decode %s refused a batch of %d releases and %d notes: %s", url,
                        len(batch), len(notes), raw[:200])
            self._on_result(url, "refused", len(batch))
            return await self.call(session, url)
        report, outcome = self._answer(r, status, raw)
        if report is None:
            if outcome != "unsupported":  # nothing was done: they wait for the next round
                self._requeue(r, batch, notes)
            self._on_result(url, outcome, len(batch))
            return False
        n = report.get("numBlocks")
        if isinstance(n, int) and n > 0:
            r.num_blocks = n
        r.last = report
        self._on_result(url, "ok", len(batch))
        if r.pending or r.keeping:
            self._wake.set()
        if not r.answered:
            r.answered = True
            if self.on_first_answer is not None:
                self.on_first_answer(session, url)
        return True

    @staticmethod
    def _answer(r: Replica, status: int, raw: bytes) -> tuple[dict[str, Any] | None, str]:
        """What decode's answer reports, and the call's outcome (no report: it did
        nothing with the call; a replica without the route is marked so)."""
        url = r.url
        if status in (401, 429):
            # 401: decode holds another handle key (a rotation half done) or this router
            # none; 429: decode tracks as many owners as it keeps.
            log.warning("decode %s refused the residency call (%d): %s", url, status,
                        raw[:200])
            return None, "refused"
        if status == 409:
            # Decode speaks another wire version: nothing it would do with the call is
            # what this router means. The releases wait for after the upgrade settles.
            log.warning("decode %s refused the residency call: %s", url, raw[:200])
            return None, "wire_version"
        if status == 404:
            r.supported = False
            log.warning("decode %s has no %s (bidir-kv plugin not loaded?): its retained "
                        "KV is freed only by vLLM's TTL", url, RESIDENCY_PATH)
            return None, "unsupported"
        try:
            report = loads(raw) if status == 200 else None
        except ValueError:
            report = None
        return (report, "ok") if isinstance(report, dict) else (None, "error")
