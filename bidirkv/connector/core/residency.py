"""Decode's retained KV: a cache with an owner, a lease, and a yield to new work.

With bidirectional transfer, decode keeps every finished request's blocks so prefill can
read them back on the next turn. vLLM keeps them for a fixed TTL and never gives them up
early, so a loaded decode stalls new requests behind blocks nobody may ever read. Here
each retained request is one `Held` entry, and it leaves by one of these causes:

    read        prefill read it and notified decode (vLLM's own path)
    expired     vLLM's TTL ran out
    router      the router that holds the only handle dropped it (LRU, superseded,
                its own TTL, an explicit end of the conversation)
    owner_gone  the router that owns it stopped renewing its lease (gone, restarted)
    pressure    a request is waiting for blocks and these are only kept for reuse
    watermark   retained blocks above the configured share of decode's KV

Pressure and the watermark take from the tenant (`bidirkv_tenant`, a label the router
derives from its keyed tenant hash) holding the most releasable blocks: one tenant's
flood of conversations yields before anyone else's. Within the tenant they take the
conversation expected back last (bidirkv/returns.py: overdue ones first, then by when
the router's gap, `bidirkv_return_s`, says it returns), not the oldest: under agents
taken in turn, the oldest is the one about to come back. A conversation without a gap
is expected after the typical gap of those that have one (a moving average here, as it
stood when the conversation was kept). Both choices are indexed (releaseorder.py): a
reclaim costs O(log n) per entry it releases, however many tenants decode holds.

Safety does not rest on timing. A read is one-sided (decode never sees it), so prefill
asks decode for a *grant* over the side channel right before it reads. A grant and a
release are decided under one lock: once granted, nothing but the read's notification
(or vLLM's TTL, which prefill already stays clear of) frees the blocks; once a release
was decided, a grant is refused and prefill recomputes. Both transitions happen here;
the vLLM patches only move ids in and out (connector/patches/residency.py).

The engine thread (scheduler, utility calls) and the side-channel thread (grants) share
one instance per engine-core process.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from bidirkv.connector.core.lease import Grant, Lent
from bidirkv.connector.core.notes import Notes
from bidirkv.connector.core.releaseorder import Heaviest, ReleaseOrder
from bidirkv.returns import next_gap
from bidirkv.wire import SHARE_PREFIX

HELD = "held"
GRANTED = "granted"
RELEASING = "releasing"

CAUSES = ("router", "owner_gone", "pressure", "watermark")
# A grant is refused this close to vLLM's own deadline: prefill would decline the read
# anyway (it keeps a 5 s margin), and the blocks must outlive the read.
GRANT_MARGIN_S = 10.0
# A request retained before its owner's first heartbeat gets this long to be renewed.
DEFAULT_OWNER_LEASE_S = 30.0
# Owners (router processes) decode tracks at once: the routers of one resource and their
# restarts within a lease. Past it a new owner is refused (its requests are then kept
# for vLLM's TTL and pressure only), so no caller grows the table the scheduler scans.
MAX_OWNERS = 256


@dataclass
class Held:
    req_id: str
    blocks: int
    owner: str | None
    deadline: float  # vLLM's TTL, on this process's perf_counter
    state: str = HELD
    cause: str | None = None
    tenant: str | None = None
    kept_at: float = 0.0  # when it was retained, on this process's perf_counter
    gap: float | None = None  # the router's estimate of its conversation's idle time
    # vLLM's ids of its blocks (empty: unknown, then all `blocks` count as its own). An
    # extend shares its history's blocks with the turn it extends (prefix caching).
    ids: tuple[int, ...] = ()
    # What a router's note leaves out of the handle this request was issued with
    # (wire.NOTE_LEAVES_OUT), given back beside the note on a recall.
    bulk: dict | None = None
    # `ids` per KV group, as vLLM lists them: the reader gets them with its grant.
    groups: tuple[int, ...] = ()
    # Shared reads in flight (a child reading its parent's blocks, which stay retained),
    # and the release decided meanwhile, made once the last of them is done.
    readers: int = 0
    release_after: str | None = None

    def id_lists(self) -> list[list[int]]:
        out, at = [], 0
        for n in self.groups:
            out.append(list(self.ids[at: at + n]))
            at += n
        return out


@dataclass
class Residency:
    owner_lease_s: float = DEFAULT_OWNER_LEASE_S
    watermark: float = 1.0  # share of decode's blocks that retained KV may pin
    clock: Callable[[], float] = time.perf_counter
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Retention order: the first entry is the oldest, the first to yield.
    held: OrderedDict[str, Held] = field(default_factory=OrderedDict)
    owners: dict[str, float] = field(default_factory=dict)  # owner -> lease deadline
    max_owners: int = MAX_OWNERS
    released: Counter = field(default_factory=Counter)  # cause -> requests
    freed: Counter = field(default_factory=Counter)  # read | expired | released
    grants: int = 0
    refusals: Counter = field(default_factory=Counter)  # reason -> grants refused
    _pending: list[str] = field(default_factory=list)
    # Spent requests whose blocks vLLM frees only once their shared reads end (`frees`;
    # the engine thread's alone, so read without the lock).
    _deferred: set[str] = field(default_factory=set)
    # Running totals: the scheduler reads them before every step, so no step walks
    # `held`. Kept = held or granted (pinned until something frees them). Blocks, not
    # entries' sums: a block two entries share (an extend and the turn it extends) is
    # counted once, and a releasing one only once no kept entry pins it (`_move`).
    _kept: int = 0
    _parked: int = 0  # entries in state HELD: retained, nothing acting on them
    _releasing: int = 0
    _granted: int = 0  # entries' blocks in state GRANTED (each entry's own count)
    _pins: dict[int, int] = field(default_factory=dict)  # block id -> kept entries
    _rel: dict[int, int] = field(default_factory=dict)  # block id -> releasing entries
    # Entries in state HELD per owner: what a lapsed lease releases, without a walk.
    _owned: dict[str, dict[str, Held]] = field(default_factory=dict)
    # Entries in state HELD (the only releasable ones) per tenant, oldest first, and
    # their blocks: what fair reclaiming picks from, through two indexes (releaseorder.py):
    # the tenant holding the most, and each tenant's order of release.
    _free: dict[str | None, OrderedDict[str, Held]] = field(default_factory=dict)
    _free_blocks: Counter = field(default_factory=Counter)
    _heaviest: Heaviest = field(default_factory=Heaviest)
    _order: dict[str | None, ReleaseOrder] = field(default_factory=dict)
    # The gap assumed for an entry that came without one: a moving average of the gaps
    # entries came with when it was kept (0 before any: then the newest of them goes
    # first). Fixed per entry when kept, as the router's order does, so an index holds.
    prior_gap: float | None = None
    # What each owner left beside its held requests to rebuild its handles after a
    # restart (notes.py); a note goes when its request leaves state held.
    notes: Notes = field(default_factory=Notes)
    # On prefill: the ids of blocks lent to decode for a turn (lease.Lent).
    lent: Lent = field(default_factory=Lent)
    # Shared reads are granted only where one notification is one read: a decode of one
    # worker (its connector sets this, nixl/connector.py).
    shares: bool = False
    shared: int = 0  # shared reads granted

    # -- engine thread: lifecycle ---------------------------------------------------------
    def retain(self, req_id: str, blocks: int, owner: str | None, deadline: float,
               tenant: str | None = None, gap: float | None = None,
               block_ids: Iterable[int] = (), bulk: dict | None = None,
               groups: tuple[int, ...] = ()) -> int:
        """Keep a finished request's blocks; how many of them other kept requests already
        pinned (a prefix it shares with them: pinned once, and said so in its handle)."""
        now = self.clock()
        ids = tuple(block_ids)
        with self.lock:
            pins = self._pins
            shared = sum(1 for b in ids if b in pins)
            h = self.held[req_id] = Held(req_id, blocks, owner, deadline, tenant=tenant,
                                         kept_at=now, gap=gap, ids=ids,
                                         bulk=bulk, groups=groups)
            if gap is not None:
                self.prior_gap = next_gap(self.prior_gap, gap)
            if owner is not None and owner not in self.owners:
                if len(self.owners) < self.max_owners:
                    self.owners[owner] = now + self.owner_lease_s
                else:
                    h.owner = None  # no lease to lapse: vLLM's TTL and pressure free it
            self._move(h, kept=1)
            self._parked += 1
            self._refree(h)
        return shared

    def _refree(self, h: Held) -> None:
        """Caller holds the lock: `h`, in state HELD, is releasable (again)."""
        tenant = h.tenant
        mine = self._free.setdefault(tenant, OrderedDict())
        mine[h.req_id] = h
        self._free_blocks[tenant] += h.blocks
        self._heaviest.set(tenant, (self._free_blocks[tenant], len(mine)))
        rank_gap = h.gap if h.gap is not None else self.prior_gap or 0.0
        self._order.setdefault(tenant, ReleaseOrder()).add(h.req_id, h.kept_at, rank_gap,
                                                           h.deadline)
        if h.owner is not None:
            self._owned.setdefault(h.owner, {})[h.req_id] = h

    def _gone(self, req_ids: Iterable[str]) -> None:
        """Caller holds the lock: vLLM frees these requests' blocks (read, TTL, or a
        release we asked for)."""
        for rid in req_ids:
            h = self.held.pop(rid, None)
            if h is None:
                continue
            self.notes.drop(rid)
            if h.state == RELEASING:
                self._move(h, releasing=-1)
                self.freed["released"] += 1
            else:
                self._move(h, kept=-1)
                if h.state == GRANTED:
                    self._granted -= h.blocks
                if h.state == HELD:
                    self._parked -= 1
                    self._unfree(h)
                self.freed["read" if h.state == GRANTED else "expired"] += 1

    def take_pending(self) -> list[str]:
        """Releases decided since the last call, for vLLM to free now."""
        with self.lock:
            out, self._pending = self._pending, []
        return out

    # -- decisions -----------------------------------------------------------------------
    def _move(self, h: Held, kept: int = 0, releasing: int = 0) -> int:
        """Caller holds the lock: `h` starts (+1) or stops (-1) pinning its blocks as kept,
        or as releasing; the running totals follow. Returns how many blocks no kept entry
        pins any more (what a release of `h` frees)."""
        if not h.ids:
            self._kept += kept * h.blocks
            self._releasing += releasing * h.blocks
            return h.blocks if kept < 0 else 0
        pins, rel = self._pins, self._rel
        unpinned = 0
        for b in h.ids:
            k0, r0 = pins.get(b, 0), rel.get(b, 0)
            k1, r1 = k0 + kept, r0 + releasing
            self._kept += (k1 > 0) - (k0 > 0)
            self._releasing += (k1 == 0 and r1 > 0) - (k0 == 0 and r0 > 0)
            unpinned += k0 > 0 and k1 == 0
            for counts, n in ((pins, k1), (rel, r1)):
                if n:
                    counts[b] = n
                else:
                    counts.pop(b, None)
        return unpinned

    def _unfree(self, h: Held) -> None:
        """Caller holds the lock: `h` leaves state HELD."""
        owned = self._owned.get(h.owner) if h.owner is not None else None
        if owned is not None and owned.pop(h.req_id, None) is not None and not owned:
            del self._owned[h.owner]
        t = h.tenant
        mine = self._free.get(t)
        if mine is not None and mine.pop(h.req_id, None) is not None:
            self._free_blocks[t] -= h.blocks
            if not mine:
                del self._free[t]
                del self._free_blocks[t]
                del self._order[t]
                self._heaviest.set(t, None)
            else:
                self._heaviest.set(t, (self._free_blocks[t], len(mine)))
                self._order[t].remove(h.req_id)

    def _release(self, h: Held, cause: str) -> int:
        """Caller holds the lock. Only an entry nobody was granted can go; one being read
        shared goes once its last shared read is done."""
        if h.state != HELD:
            return 0
        if h.readers:
            h.release_after = h.release_after or cause
            return 0
        self._unfree(h)
        self.notes.drop(h.req_id)
        h.state, h.cause = RELEASING, cause
        self._parked -= 1
        self.released[cause] += 1
        self._pending.append(h.req_id)
        return self._move(h, kept=-1, releasing=1)

    def release(self, req_ids: Iterable[str], cause: str = "router") -> int:
        """Free these now (the router dropped their handles); blocks released."""
        with self.lock:
            return sum(self._release(h, cause) for rid in req_ids
                       if (h := self.held.get(rid)) is not None)

    def bulk_of(self, req_id: str) -> dict | None:
        """What the handle `req_id` was issued with and a note leaves out (under `lock`)."""
        h = self.held.get(req_id)
        return None if h is None else h.bulk

    def holds(self, req_id: str, owner: str) -> bool:
        """Caller holds the lock: `owner`'s request is retained here, nothing acting on it
        (what a note may be kept beside)."""
        h = self.held.get(req_id)
        return h is not None and h.state == HELD and h.owner == owner

    def renew(self, owner: str, lease_s: float) -> str | None:
        """Extend `owner`'s lease to `lease_s` from now; why not (None: done)."""
        with self.lock:
            if owner not in self.owners and len(self.owners) >= self.max_owners:
                return (f"owner {owner[:64]!r} refused: decode already tracks "
                        f"{len(self.owners)} owners, the most it keeps (MAX_OWNERS "
                        f"{self.max_owners}); others' leases must lapse first")
            self.owners[owner] = self.clock() + lease_s
            return None

    def expire_owners(self) -> int:
        """Release what belongs to owners whose lease lapsed; blocks released. Costs the
        owners (bounded) and the lapsed owners' own entries, not a walk of `held`."""
        now = self.clock()
        with self.lock:
            gone = [o for o, t in self.owners.items() if t <= now]
            got = 0
            for o in gone:
                del self.owners[o]
                for h in list(self._owned.pop(o, {}).values()):
                    got += self._release(h, "owner_gone")
            return got

    def reclaim(self, blocks: int, cause: str = "pressure") -> int:
        """Release whole entries until `blocks` are on their way (an entry whose blocks
        another kept entry shares frees only the rest): each time, of the tenant
        holding the most releasable blocks, the one to go first by releaseorder.py
        (O(log n) per entry released, whatever the number of tenants)."""
        got = 0
        now = self.clock()
        with self.lock:
            while got < blocks and self._heaviest:
                # Entries of no blocks free nothing but still count as one tenant's.
                tenant = self._heaviest.top()
                got += self._release(self._free[tenant][self._order[tenant].first(now)],
                                     cause)
        return got

    def over_watermark(self, total_blocks: int) -> int:
        """Retained blocks (not yet released) above the watermark share of decode's KV."""
        limit = int(self.watermark * total_blocks)
        return max(0, self.kept_blocks() - limit)

    # -- side-channel thread --------------------------------------------------------------
    def answer(self, req_id: str) -> Grant:
        """The side channel's answer to a reader's ask: blocks prefill lent (no state to
        change), else a shared read or a grant of blocks decode retained."""
        if req_id.startswith(SHARE_PREFIX):
            return self.share(req_id[len(SHARE_PREFIX):])
        return self.lent.answer(req_id) or self.grant(req_id)

    def share(self, req_id: str) -> Grant:
        """May a child read these retained blocks and leave them retained? Like a grant,
        decided under the lock, but the entry stays held (its handle, note and owner are
        the parent's) and leaves the releasable ones until its shared reads are done
        (`shared_done`, on each read's notification). Also while a read that spends it is
        granted: vLLM frees the blocks on that read's notification only after this one's
        (`frees`)."""
        now = self.clock()
        with self.lock:
            h = self.held.get(req_id)
            reason = self._unreadable(h, now) if self.shares else "no_shared_reads"
            if reason is None:
                assert h is not None
                if not h.readers:
                    self._unfree(h)
                h.readers += 1
                self.shared += 1
                return True, "shared", h.id_lists()
            self.refusals["shared_" + reason.replace(":", "_")] += 1
            return False, reason, []

    def _unreadable(self, h: Held | None, now: float) -> str | None:
        """Caller holds the lock: why no read of `h` may start now, whether it spends the
        blocks or shares them (None: it may)."""
        if h is None:
            return "unknown"
        if h.state == RELEASING:
            return f"released:{h.cause}"
        if h.release_after is not None:  # decided while shared reads were in flight
            return f"released:{h.release_after}"
        if h.deadline - now < GRANT_MARGIN_S:
            return "near_expiry"
        return None

    def shared_done(self, req_id: str) -> None:
        """A shared read's notification: the last one makes the entry releasable again,
        or releases it when a release was decided meanwhile."""
        with self.lock:
            h = self.held.get(req_id)
            if h is None or not h.readers:
                return  # a notification with no shared read (a local hit), or a late one
            h.readers -= 1
            if h.readers or h.state != HELD:
                return
            self._refree(h)
            if h.release_after is None and h.owner is not None and h.owner not in self.owners:
                h.release_after = "owner_gone"  # its lease lapsed meanwhile
            if h.release_after is not None:
                self._release(h, h.release_after)

    def frees(self, finished: Iterable[str]) -> set[str]:
        """Of the requests whose blocks vLLM is about to free (a read notified, or their
        TTL ran out), those it may free now, and those held back before that may go now;
        those leave the residency in the same hold of the lock, so no shared read is
        granted between this decision and the free. A request spent while children
        still read it shared keeps its blocks until the last of them notifies, or until
        its TTL (a reader that never notifies)."""
        todo = [*finished, *self._deferred]
        if not todo:  # most steps: no lock taken
            return set()
        now = self.clock()
        with self.lock:
            out: set[str] = set()
            for rid in todo:
                h = self.held.get(rid)
                if h is not None and h.readers and now < h.deadline:
                    self._deferred.add(rid)
                else:
                    self._deferred.discard(rid)
                    out.add(rid)
            self._gone(out)
        self.lent.freed(out)
        return out

    def grant(self, req_id: str) -> Grant:
        """May prefill read this request's blocks now, and which are they? Decided once,
        under the lock; every worker of a prefill engine asks (one per TP rank), so a
        granted request is granted again until its read frees it (the blocks stay
        pinned meanwhile; the reader's replay guard keeps a handle to one read)."""
        now = self.clock()
        with self.lock:
            h = self.held.get(req_id)
            if h is not None and h.state == GRANTED:
                return True, "granted", h.id_lists()
            # With shared reads in flight too: vLLM frees the blocks on this read's
            # notification only after theirs (`frees`).
            reason = self._unreadable(h, now)
            if reason is None:
                assert h is not None
                self._unfree(h)
                self.notes.drop(req_id)  # read once: no router will hold it again
                h.state = GRANTED
                self._parked -= 1
                self._granted += h.blocks
                self.grants += 1
                return True, "granted", h.id_lists()
            # released_<cause>: a read refused after pressure differs from one after the
            # router's release (the benchmark counts misses by it).
            self.refusals[reason.replace(":", "_")] += 1
            return False, reason, []

    # -- views -----------------------------------------------------------------------------
    def kept_blocks(self) -> int:
        """Blocks held or granted: what retention pins until something frees it."""
        return self._kept

    def releasing_blocks(self) -> int:
        return self._releasing

    def parked(self) -> int:
        """Requests retained for a later turn that no read or release is acting on (a
        running total: the idle loop reads it between steps)."""
        return self._parked

    def stats(self) -> dict:
        """The report of the residency route: running totals and counters of bounded
        labels, never a walk of `held` (the route is called every few seconds)."""
        with self.lock:
            return {
                "retainedRequests": len(self.held),
                # Blocks as vLLM holds them: one a shared prefix, once.
                "retainedBlocks": self._kept + self._releasing,
                "grantedBlocks": self._granted,
                "releasingBlocks": self._releasing,
                "owners": len(self.owners),
                "released": dict(self.released),
                "freed": dict(self.freed),
                "grants": self.grants,
                "sharedReads": self.shared,
                "refusals": dict(self.refusals),
            }


def blocks_wanted(num_tokens: int, block_size: int, running: int, shared: int = 0) -> int:
    """Free blocks a waiting request needs to start: all its tokens plus the next one,
    less the `shared` blocks prefix caching finds for it in blocks some request holds
    (retained ones included: it takes them without a free block), plus one per running
    request, which may cross into a new block on this step."""
    return max(0, -(-(num_tokens + 1) // block_size) - shared) + running


_current: Residency | None = None


def current() -> Residency | None:
    """This engine-core process's residency (None before its scheduler exists)."""
    return _current


def install(res: Residency) -> Residency:
    global _current
    _current = res
    return res
