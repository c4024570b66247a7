"""What the table of rules (tests/test_router_store.py) cannot hold: concurrent takers, a
server that goes away or expires entries by itself, and where the two stores differ by
design (a reserved entry stays in the in-process store, counted and pinned; the shared
store takes it out at lookup)."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis_server import RedisServer, binary, started

from bidirkv.router.request.identity import completion_key, tenant_of
from bidirkv.router.store.base import HIT, MISS, Kept, StoreUnavailable
from bidirkv.router.store.memory import InProcessStore
from bidirkv.router.store.shared import RedisStore

pytestmark = pytest.mark.timeout(60)
D0, D1 = "http://d0:8000", "http://d1:8000"


@pytest.fixture(scope="module")
def redis_server():
    server = started()
    yield server
    server.stop()


class Made:
    def __init__(self) -> None:
        self.evicted: dict[str, list[str]] = {}
        self.stores: list = []

    def on_evict(self, reason, entries) -> None:
        self.evicted.setdefault(reason, []).extend(e.request_id for e in entries)


@pytest.fixture(params=["in-process", "redis"])
async def make(request):
    """make(ttl, max_entries) -> a store; redis stores of one test share one database."""
    made = Made()
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        prefix = f"t{id(made)}:"

        async def factory(ttl=100.0, max_entries=100):
            s = RedisStore.from_url(server.url, None, ttl, max_entries, made.on_evict,
                                    prefix=prefix)
            await s.start()
            made.stores.append(s)
            return s
    else:
        async def factory(ttl=100.0, max_entries=100):
            s = InProcessStore(ttl, max_entries, made.on_evict)
            made.stores.append(s)
            return s
    factory.made = made
    factory.kind = request.param
    yield factory
    for s in made.stores:
        await s.close()


async def put(s, key, rid, url=D0, blocks=2, engine="e0", **kw):
    await s.put(Kept(key, b'{"remote_request_id":"%s"}' % rid.encode(), url, engine, 100,
                     request_id=rid, blocks=blocks, **kw))


async def test_two_takers_one_winner(make):
    s1, s2 = await make(), (await make() if make.kind == "redis" else None)
    s2 = s2 or s1
    for i in range(20):
        await put(s1, b"k%d" % i, f"r{i}")
    results = await asyncio.gather(*(st.lookup(b"k%d" % i) for i in range(20)
                                     for st in (s1, s2)))
    hits = [r for r in results if r[0] == HIT]
    assert len(hits) == 20  # each handle once, whichever store asked first


async def test_a_store_that_went_away_raises_and_comes_back(make):
    if make.kind != "redis":
        pytest.skip("the in-process store cannot go away")
    server = RedisServer(binary()).start()
    try:
        s = RedisStore.from_url(server.url, None, 100, 100, make.made.on_evict)
        await s.start()
        await put(s, b"a", "ra")
        server.stop()
        with pytest.raises(StoreUnavailable):
            await s.lookup(b"a")
        assert not s.available
        server.start()  # same port, empty (no persistence)
        assert await s.lookup(b"a") == (MISS, None)
        # A read answering says nothing of writes (OOM, a read-only replica refuse only
        # those): available again once one gets through, as the store round's owner set.
        assert not s.available
        await s.start()
        assert s.available
        await s.close()
    finally:
        server.stop()


async def test_entries_the_server_expired_leave_no_pinned_blocks_behind(make):
    """Redis expires `h:` keys by itself (their safety TTL) once no router swept for a
    while: the indexes and the pinned count must follow, or every later handle on that
    replica is trimmed at once (pin stays above the watermark)."""
    if make.kind != "redis":
        pytest.skip("only the shared store's server expires entries by itself")
    import redis.asyncio as aioredis

    s = await make(ttl=0.05)
    for i in range(3):
        await put(s, b"k%d" % i, f"r{i}", blocks=4)
    assert await s.pinned(D0) == 12
    raw = aioredis.Redis(connection_pool=s.r.connection_pool)
    for i in range(3):  # what the server's own expiry does
        assert await raw.delete(s._k("h:" + (b"k%d" % i).hex())) == 1
    await asyncio.sleep(0.1)
    await s.sweep()
    assert await s.pinned(D0) == 0 and await s.count() == 0
    # A new handle under the watermark stays.
    await put(s, b"fresh", "rf", blocks=4)
    assert await s.trim_replica(D0, 8) == 0 and await s.pinned(D0) == 4
    # The trim path meets expired entries too, and first: past its expiry a handle is
    # overdue, whatever its conversation's gap.
    await raw.delete(s._k("h:" + b"fresh".hex()))
    await asyncio.sleep(0.1)  # as the server expires only what expired
    await put(s, b"fresh2", "rf2", blocks=4)
    assert await s.trim_replica(D0, 4) == 0 and await s.pinned(D0) == 4
    # And dropping a replica whose entries the server expired.
    await raw.delete(s._k("h:" + b"fresh2".hex()))
    assert await s.drop_replica(D0, "replica_unhealthy") == 0
    assert await s.pinned(D0) == 0


A, B = b"a" * 16, b"b" * 16


async def test_the_replica_bound_passes_over_what_it_cannot_take(make):
    """The memory store: of a tenant whose handles are all in flight, none is taken (the
    next tenant's go). The shared store: a key its value index holds but the replica's
    does not (left by a router of an older release) is dropped from the index."""
    s = await make()
    await put(s, b"a0", "a0", blocks=4, tenant=A)
    await put(s, b"b0", "b0", blocks=2, tenant=B)
    if make.kind == "redis":
        import redis.asyncio as aioredis

        raw = aioredis.Redis(connection_pool=s.r.connection_pool)
        stale = s._k("rte:" + D0 + "|" + A.hex())
        await raw.zadd(stale, {"gone": time.time() + 10**6})
        assert await s.trim_replica(D0, 4) == 1
        assert make.made.evicted["watermark"] == ["a0"]
        assert await raw.zscore(stale, "gone") is None
    else:
        status, held = await s.lookup(b"a0")  # A's only handle, reserved
        assert status == HIT
        assert await s.trim_replica(D0, 4) == 1
        assert make.made.evicted["watermark"] == ["b0"]
        await s.release(held)


# -- the in-process store: a reserved entry is still in it ---------------------------------
async def test_a_lower_entry_bound_applies_at_once_in_process():
    """(The shared store applies it at the next put.)"""
    s = InProcessStore(100, 3)
    for k in (b"1", b"2", b"3"):
        await put(s, k, k.decode())
    s.configure(10, 2)
    assert len(s) == 2 and await s.lookup(b"1") == (MISS, None)


async def test_consuming_an_entry_the_bound_evicted_while_reserved_is_harmless():
    evicted = []
    s = InProcessStore(100, 1, lambda reason, entries: evicted.append(reason))
    await put(s, b"a", "a")
    _, e = await s.lookup(b"a")
    await put(s, b"b", "b")  # evicts the reserved entry
    await s.consume(e)
    assert evicted == ["lru"] and (await s.lookup(b"b"))[0] == HIT


async def test_the_prefix_index_forgets_dropped_entries():
    s = InProcessStore(100, 1)
    t = tenant_of(None)
    await s.put(Kept(completion_key(t, "abc"), b"x", D0, tenant=t, prefix_len=3))
    await put(s, b"other", "other")  # LRU-evicts the prefix entry
    assert s.ix.lengths == {}


async def test_a_stored_handle_costs_little_beside_its_params():
    """The in-process store's own cost per handle (entry, indexes, return order), its
    params apart: 100k handles must fit a small pod (docs/benchmarks.md#router-overhead)."""
    import tracemalloc

    s = InProcessStore(600, 10**6, None)
    n, params = 20_000, b'{"remote_block_ids":[[1,2,3]]}'
    keys = [i.to_bytes(16, "big") for i in range(n)]
    rids = [f"chatcmpl-{i:032x}" for i in range(n)]
    tracemalloc.start()
    try:
        for key, rid in zip(keys, rids, strict=True):
            await s.put(Kept(key, params, D0, "engine-0", 1023, tenant=bytes(16),
                             request_id=rid, blocks=64, gap=2.5, max_pinned=10**9))
        per_handle = tracemalloc.get_traced_memory()[0] / n
    finally:
        tracemalloc.stop()
    assert len(s) == n
    assert per_handle < 560, per_handle  # 481 measured; 694 with three OrderedDicts
