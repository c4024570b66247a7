"""The handle store's rules as one table of cases, run against the in-process store and
against the shared store's Lua on a real Redis-protocol server: each case must come out
the same on both, which is what keeps the two rule sets equal.

A case is a list of steps on one fresh store; each step names what it expects (a lookup's
outcome, a trim's count, the evictions so far). Both stores read one fake clock, so time
moves only when a case says so. What one store cannot show the same way (a reserved entry
is still counted in-process, but taken out of the shared store) stays out of the table,
in tests/test_router_handlestore.py.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from redis_server import started

from bidirkv.router.request.identity import completion_key, prefix_keys, tenant_of
from bidirkv.router.store.base import EXPIRED, HIT, MISS, Entry, Kept, Store
from bidirkv.router.store.memory import InProcessStore
from bidirkv.router.store.shared import RedisStore

pytestmark = pytest.mark.timeout(60)
D0, D1 = "http://d0:8000", "http://d1:8000"
A, B = b"a" * 16, b"b" * 16
T1, T2 = tenant_of("Bearer one"), tenant_of("Bearer two")
START = 1_790_000_000.0  # Unix seconds: kept_at and the store's clock are one clock here


class Clock:
    """Both stores' clock. Each put moves it a millisecond first, as time moves between
    two turns: handles kept at one instant would tie, and ties are no rule of the store."""

    def __init__(self) -> None:
        self.t = START

    def __call__(self) -> float:
        return self.t


@dataclass
class Run:
    """One case on one store: the entries its lookups took, the evictions in order."""

    clock: Clock
    store: Any = None
    taken: dict[str, Entry] = field(default_factory=dict)
    log: list[tuple[str, str | None]] = field(default_factory=list)

    def on_evict(self, reason: str, entries: list[Entry]) -> None:
        self.log += [(reason, e.request_id) for e in entries]


@dataclass(frozen=True)
class Step:
    what: str
    act: Callable[[Run], Awaitable[Any]]
    want: Any = None
    method: str | None = None  # the store's, if it calls one


@dataclass(frozen=True)
class Case:
    name: str
    steps: list[Step]
    ttl: float = 100.0
    max_entries: int = 100
    max_per_tenant: int | None = None


# -- the steps ----------------------------------------------------------------------------
def put(key: str, rid: str | None = None, url: str = D0, blocks: int = 2, engine: str = "e0",
        ago: float | None = None, extends: str | None = None, **kw: Any) -> Step:
    """Store `key` (request id `rid`, else the key); kw: Kept's other fields; `ago`: kept
    that many seconds before now; `extends`: the name of a taken handle it replaces."""
    rid = rid or key

    async def act(run: Run) -> None:
        run.clock.t += 0.001
        kept_at = run.clock.t - ago if ago is not None else kw.get("kept_at")
        fields = {k: v for k, v in kw.items() if k != "kept_at"}
        if extends is not None:
            fields["replaces"] = run.taken[extends]
        await run.store.put(Kept(key.encode(), b'{"rid":"%s"}' % rid.encode(), url, engine,
                                 100, request_id=rid, blocks=blocks, kept_at=kept_at,
                                 **fields))
    return Step(f"put {key}", act, method="put")


def extend(name: str, key: str, rid: str, **kw: Any) -> Step:
    """The holder of the handle taken under `name` extends it: the turn's new handle
    `key` (request id `rid`) replaces it in the same put; the taken one is still the
    turn's to end (discard)."""
    step = put(key, rid, extends=name, **kw)
    return Step(f"extend {name} -> {key}", step.act, method="put")


def put_prefix(tenant: bytes, text: str, rid: str) -> Step:
    async def act(run: Run) -> None:
        run.clock.t += 0.001
        await run.store.put(Kept(completion_key(tenant, text), text.encode(), D0,
                                 request_id=rid, tenant=tenant, prefix_len=len(text)))
    return Step(f"put prefix {text!r}", act, method="put")


def _taking(name: str, method: str, args: Callable[[], tuple[Any, ...]], status: str,
            rid: str | None, fields: dict[str, Any]) -> Step:
    async def act(run: Run) -> tuple[Any, ...]:
        got, entry = await getattr(run.store, method)(*args())
        if entry is None:
            return got, None
        run.taken[name] = entry
        return got, entry.request_id, {f: getattr(entry, f) for f in fields}
    want = (status, rid, fields) if status == HIT else (status, None)
    return Step(f"{method} {name}", act, want, method)


def look(key: str, status: str, rid: str | None = None, **fields: Any) -> Step:
    """Expect `status`; a hit names `rid` (else the key) and `fields`, and is remembered
    under the key for release, consume or discard."""
    return _taking(key, "lookup", lambda: (key.encode(),), status, rid or key, fields)


def peek(key: str, rid: str | None) -> Step:
    """`Store.look`: the request id of the live handle under `key`, left in place."""
    async def act(run: Run) -> str | None:
        entry = await run.store.look(key.encode())
        return None if entry is None else entry.request_id
    return Step(f"look {key}", act, rid, "look")


def prefix(tenant: bytes, text: str, status: str, rid: str | None = None) -> Step:
    """A prefix lookup; a hit is remembered under `rid`."""
    return _taking(rid or "", "lookup_prefix", lambda: (tenant, text, prefix_keys(tenant)),
                   status, rid, {})


def _on_taken(verb: str, name: str, *args: Any) -> Step:
    async def act(run: Run) -> None:
        done = getattr(run.store, verb)(run.taken.pop(name), *args)
        if inspect.isawaitable(done):  # `forget` does not wait
            await done
    return Step(f"{verb} {name}", act, method=verb)


def release(name: str) -> Step:
    return _on_taken("release", name)


def consume(name: str) -> Step:
    return _on_taken("consume", name)


def discard(name: str, reason: str) -> Step:
    return _on_taken("discard", name, reason)


def forget(name: str, reason: str) -> Step:
    return _on_taken("forget", name, reason)


def call(method: str, want: Any, *args: Any, **kw: Any) -> Step:
    """One store method and what it returns."""
    return Step(f"{method}{args}", lambda run: getattr(run.store, method)(*args, **kw), want,
                method)


def end(key: str, found: bool) -> Step:
    return call("end", found, key.encode())


def later(seconds: float) -> Step:
    async def act(run: Run) -> None:
        run.clock.t += seconds
    return Step(f"{seconds} s later", act)


def kept_now(name: str) -> Step:
    """The handle taken under `name` reads as kept at the store's clock."""
    async def act(run: Run) -> bool:
        return run.taken[name].kept_at == run.clock.t
    return Step(f"{name} kept now", act, True)


def evicted(**by_reason: list[Any]) -> Step:
    """The evictions so far: per reason, the request ids in order (a frozenset: any one
    of its members)."""
    async def act(run: Run) -> dict[str, list[str | None]]:
        out: dict[str, list[str | None]] = {}
        for reason, rid in run.log:
            out.setdefault(reason, []).append(rid)
        return out
    return Step("evictions", act, by_reason)


def matches(got: Any, want: Any) -> bool:
    if isinstance(want, frozenset):
        return got in want
    if isinstance(want, (list, tuple)):
        return (isinstance(got, (list, tuple)) and len(got) == len(want)
                and all(matches(g, w) for g, w in zip(got, want, strict=True)))
    if isinstance(want, dict):
        return (isinstance(got, dict) and got.keys() == want.keys()
                and all(matches(got[k], want[k]) for k in want))
    return got == want


def n_keys(stem: str, n: int) -> list[str]:
    return [f"{stem}{i}" for i in range(n)]


# -- the table ------------------------------------------------------------------------------
PROMPT_KEY = b"\x00\x00\x00\x02" + b"h" * 16
ONCE = "Once upon a time, there was"

CASES = [
    Case("a hit is single use until released, and keeps what was stored", [
        put("k", "r1", chars=1234, prompt_key=PROMPT_KEY, kept_at=START - 0.75, gap=7.5),
        look("k", HIT, "r1", params=b'{"rid":"r1"}', decode_url=D0, engine_id="e0",
             num_tokens=100, blocks=2, chars=1234, prompt_key=PROMPT_KEY,
             kept_at=START - 0.75, gap=7.5),
        look("k", MISS),  # taken: a concurrent turn misses
        release("k"),  # P was never asked: usable again
        look("k", HIT, "r1"),
        consume("k"),
        look("k", MISS),
        call("count", 0),
        evicted(),
    ]),
    Case("look finds a live handle and leaves it single use", [
        put("p", "rp", chars=99), peek("p", "rp"), peek("p", "rp"),
        look("p", HIT, "rp", chars=99),  # still there to take, once
        release("p"), peek("p", "rp"),
        peek("other", None),
        later(11), peek("p", None),  # past its TTL: not a parent any more
        evicted(),
    ], ttl=10),
    Case("a discarded or forgotten handle is released under its reason", [
        put("k"), look("k", HIT), discard("k", "reuse_failed"),
        put("c"), look("c", HIT), forget("c", "cancelled"),
        call("count", 0), evicted(reuse_failed=["k"], cancelled=["c"]),
    ]),
    Case("a replaced handle and the oldest over the entry bound go; end drops", [
        put("a", "r-a"),
        put("a", "r-a2"),  # a newer turn of the same conversation
        put("b"),
        put("c"),  # over the bound: the oldest goes
        evicted(replaced=["r-a"], lru=["r-a2"]),
        call("count", 2),
        end("b", True), end("b", False),
        evicted(replaced=["r-a"], lru=["r-a2"], ended=["b"]),
    ], max_entries=2),
    Case("a put moves its conversation to the newest place", [
        put("1", "old"), put("2"), put("1", "new"),
        put("3"),  # over the bound: 2, the least recently stored
        look("2", MISS), look("1", HIT, "new"),
        evicted(replaced=["old"], lru=["2"]),
    ], max_entries=2),
    Case("the LRU bound drops the oldest", [
        *(put(k) for k in "1234"),
        call("count", 3), look("1", MISS), evicted(lru=["1"]),
    ], max_entries=3),
    Case("past the TTL a lookup expires the handle and the sweep takes the rest", [
        put("a"), later(5), put("b"), later(6),  # a is 11 s old, b 6 s
        look("a", EXPIRED),
        later(5),
        call("sweep", 1), call("count", 0),
        evicted(ttl=["a", "b"]),
    ], ttl=10),
    # A recalled handle (a note's `kept_at`) lives the TTL from when decode kept it, not
    # from the put: a restart never lengthens a handle's life past decode's blocks.
    Case("a handle kept earlier expires the TTL after it was kept", [
        put("old", ago=90), put("new"),
        put("gone", ago=100),  # expired already: released, never stored
        evicted(ttl=["gone"]), call("count", 2), call("pinned", 4, D0),
        later(10.5),
        look("old", EXPIRED), look("new", HIT), release("new"),
        put("older", ago=95), put("newer"),
        later(5),  # older's TTL ran out behind entries stored before it: swept all the same
        call("sweep", 1), call("count", 2), look("older", MISS),
        # A kept_at ahead of the store's clock (another host's) counts as now.
        put("ahead", ago=-500),
        look("ahead", HIT), kept_now("ahead"), release("ahead"),
        later(99), look("ahead", HIT), release("ahead"),  # the whole TTL from the put
        later(2), call("sweep", 3),
        evicted(ttl=["gone", "old", "older", "new", "newer", "ahead"]),
    ], ttl=100),
    Case("a replica's handles drop, but those of the engine that stayed", [
        put("a", engine="e1"), put("b", engine="e2"), put("c", url=D1, engine="e9"),
        call("drop_replica", 1, D0, "engine_changed", keep_engine_id="e2"),
        look("a", MISS),
        call("drop_replica", 1, D0, "replica_unhealthy"),
        call("count", 1),
        evicted(engine_changed=["a"], replica_unhealthy=["b"]),
    ]),
    Case("blocks are counted per replica and trimmed to the watermark", [
        *(put(k, blocks=3) for k in n_keys("k", 4)),
        put("x", url=D1, blocks=5, engine="e1"),
        call("pinned", 12, D0), call("pinned", 5, D1),
        # No gap known for any: each is expected back one typical gap after it was kept,
        # so the newest goes first.
        call("trim_replica", 2, D0, 7),
        evicted(watermark=["k3", "k2"]),
        call("pinned", 6, D0),
        put("new", blocks=1, engine="e0-restarted"),
        call("drop_replica", 2, D0, "engine_changed", keep_engine_id="e0-restarted"),
        call("pinned", 1, D0), call("pinned", 5, D1),
        call("drop_replica", 1, D1, "replica_unhealthy"),
    ]),
    Case("a prefix lookup finds the tenant's longest stored prompt prefix", [
        put_prefix(T1, "Once upon", "short"),
        put_prefix(T1, "Once upon a time", "long"),
        prefix(T1, ONCE, HIT, "long"),
        consume("long"),
        prefix(T1, ONCE, HIT, "short"),
        release("short"),
        prefix(T2, "Once upon a time", MISS),  # another tenant sees nothing
        prefix(T1, "Twice", MISS),
        # Non-ASCII text hashes the same in one piece and incrementally.
        put_prefix(T1, "héllo wörld", "utf8"),
        prefix(T1, "héllo wörld and more", HIT, "utf8"),
    ]),
    Case("a prompt prefix the LRU bound dropped is found no more", [
        put_prefix(T1, "abc", "p"), put("other"),
        prefix(T1, "abc", MISS), evicted(lru=["p"]),
    ], max_entries=1),
    Case("the entry bound takes from the tenant holding the most", [
        *(put(k, tenant=A) for k in n_keys("a", 3)),
        *(put(k, tenant=B) for k in n_keys("b", 20)),
        call("count", 10),
        evicted(lru=n_keys("b", 13)),
        # The quiet tenant's conversations all survived.
        *(step for k in n_keys("a", 3) for step in (look(k, HIT), release(k))),
    ], max_entries=10),
    Case("a tenant over its own cap loses its oldest", [
        *(put(k, tenant=A) for k in n_keys("a", 4)),
        put("b0", tenant=B),
        evicted(tenant_cap=["a0", "a1"]),
        call("count", 3),
    ], max_per_tenant=2),
    Case("the watermark takes from the tenant pinning the most", [
        *(put(k, tenant=A) for k in n_keys("a", 2)),  # the oldest entries
        *(put(k, tenant=B) for k in n_keys("b", 6)),
        put("other", url=D1, blocks=40, tenant=B),  # another replica
        call("pinned", 16, D0),
        call("trim_replica", 3, D0, 10),
        evicted(watermark=["b5", "b4", "b3"]),  # no gaps: newest first
        call("pinned", 10, D0), call("pinned", 40, D1),
        # Heaviest first (B: 6 blocks), then, at 4 each, either tenant's.
        call("trim_replica", 2, D0, 6),
        evicted(watermark=["b5", "b4", "b3", "b2", frozenset({"a1", "b1"})]),
    ]),
    # Not the oldest: agents taken in turn come back oldest first. Overdue ones (idle past
    # 3 gaps + 10 s: most likely finished) go before any still expected.
    Case("the block bounds take the conversation expected back last", [
        put("stale", ago=120, gap=5.0),  # overdue
        put("soon", ago=4, gap=5.0),  # back in 1 s
        put("late", ago=2, gap=60.0),  # in 58 s
        put("new", ago=0, gap=10.0),  # in 10 s
        call("trim_replica", 1, D0, 6),
        call("trim_replica", 1, D0, 4),
        call("trim_replica", 1, D0, 2),
        evicted(watermark=["stale", "late", "new"]),
        look("soon", HIT), release("soon"),
        # A tenant over its share of the replica loses its own the same way: neither its
        # oldest nor its newest, but the one expected back last.
        put("t-old", tenant=A, ago=4, gap=5.0),
        put("t-mid", tenant=A, ago=2, gap=60.0),
        put("t-new", tenant=A, ago=0, gap=10.0, tenant_max_pinned=4),
        evicted(watermark=["stale", "late", "new"], tenant_cap=["t-mid"]),
    ], ttl=1000),
    Case("a tenant over its share of a replica loses its own there", [
        put("elsewhere", url=D1, blocks=3, tenant=A),
        *(put(k, blocks=3, tenant=A, tenant_max_pinned=7) for k in n_keys("a", 4)),
        put("b0", blocks=3, tenant=B, tenant_max_pinned=7),
        evicted(tenant_cap=["a2", "a3"]),  # no gaps: newest first
        call("pinned", 9, D0), call("pinned", 3, D1),
    ]),
    Case("a put over the watermark trims the replica at once", [
        *(put(k, blocks=3) for k in n_keys("k", 3)),
        put("k3", blocks=3, max_pinned=7),
        evicted(watermark=["k3", "k2"]),
        call("pinned", 6, D0),
    ]),
    # The extended handle covers the old one's history plus the new turn, and decode
    # holds that history once: counting both would trim what is really under the bounds.
    Case("an extend counts the history it shares with the handle it replaces once", [
        put("other", blocks=2),
        put("conv", blocks=6),
        look("conv", HIT),
        extend("conv", "conv2", "conv2", blocks=7, max_pinned=10),  # 9 really pinned
        call("pinned", 9, D0), call("count", 2),
        evicted(),
        discard("conv", "extended"),  # the turn's end: D frees what only it held
        evicted(extended=["conv"]),
        look("other", HIT), release("other"),
        look("conv2", HIT),
        # A superseded handle its turn releases unused does not come back beside its
        # successor.
        extend("conv2", "conv3", "conv3", blocks=8, max_pinned=10),
        release("conv2"),
        look("conv2", MISS), call("count", 2),
        evicted(extended=["conv"], replaced=["conv2"]),
    ], max_entries=2),
    Case("an extend's new handle is not the victim of its own put", [
        put("a", blocks=3), put("b", blocks=3), put("c", blocks=4),
        look("c", HIT),
        # An explicit id: the same key. 12 blocks over a watermark of 10: not the newest
        # handle (this one) goes, but the next expected back last.
        extend("c", "c", "c2", blocks=6, max_pinned=10),
        evicted(watermark=["b"]),
        call("pinned", 9, D0),
        discard("c", "extended"),
        evicted(watermark=["b"], extended=["c"]),
        look("c", HIT, "c2"),
    ]),
]


# One server for the module: each run its own prefix (an object's id may be reused once
# it is freed, and a prefix reused would see the keys an earlier case left).
PREFIXES = itertools.count()


@pytest.fixture(scope="module")
def redis_server():
    server = started()
    yield server
    server.stop()


async def open_store(kind: str, case: Case, run: Run, request: Any) -> Any:
    if kind == "in-process":
        store = InProcessStore(case.ttl, case.max_entries, run.on_evict,
                               clock=run.clock, wall=run.clock)
    else:
        server = request.getfixturevalue("redis_server")
        store = RedisStore.from_url(server.url, None, case.ttl, case.max_entries,
                                    run.on_evict, prefix=f"case{next(PREFIXES)}:",
                                    clock=run.clock)
        await store.start()
    store.configure(case.ttl, case.max_entries, case.max_per_tenant)
    return store


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("kind", ["in-process", "redis"])
async def test_the_rules(kind: str, case: Case, request: Any) -> None:
    run = Run(Clock())
    run.store = await open_store(kind, case, run, request)
    try:
        for i, step in enumerate(case.steps):
            got = await step.act(run)
            assert matches(got, step.want), (
                f"{kind}, step {i} ({step.what}): got {got!r}, want {step.want!r}")
    finally:
        await run.store.close()


def test_the_table_covers_every_step_of_the_store_protocol():
    """A store method no case calls could drift apart between the two stores unseen
    (`configure` and `close`: every run calls them)."""
    called = {step.method for case in CASES for step in case.steps}
    methods = {name for name in vars(Store) if not name.startswith("_")
               and callable(getattr(Store, name))}
    assert methods - called == {"configure", "close"}


def test_the_heaviest_tenants_heap_stays_bounded_at_a_bound():
    """At a bound, every put adds to a tenant and the trim takes from the heaviest: a
    tenant's weight swings between two values, and its heap copies must not pile up
    (each put would then cost the whole heap)."""
    from bidirkv.router.store.base import Weights

    w = Weights()
    w.add(b"small", 1)
    w.add(b"big", 5)
    for _ in range(3000):
        w.add(b"big", 1)
        assert w.heaviest() == b"big"
        w.add(b"big", -1)
    assert len(w._heap) <= 2 * len(w) + 64
    w.add(b"small", 10)
    assert w.heaviest() == b"small"
    w.add(b"small", -11)
    assert w.heaviest() == b"big" and w.total == 5
