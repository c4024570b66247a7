"""The handle store's behaviour, once for each implementation (one suite, two fixtures):
the in-process store and the shared store against a real Redis-protocol server."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis_server import RedisServer, binary, started

from bidirkv.router.request.identity import completion_key, prefix_keys
from bidirkv.router.store.base import StoreUnavailable
from bidirkv.router.store.handles import EXPIRED, HIT, MISS
from bidirkv.router.store.memory import InProcessStore

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
        from bidirkv.router.store.shared import RedisStore

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
    await s.put(key, b'{"remote_request_id":"%s"}' % rid.encode(), url, engine, 100,
                request_id=rid, blocks=blocks, **kw)


async def test_single_use_and_release(make):
    s = await make()
    await put(s, b"k", "r1", chars=1234, prompt_key=b"\x00\x00\x00\x02" + b"h" * 16,
              kept_at=1_790_000_000.25, gap=7.5)
    status, e = await s.lookup(b"k")
    assert status == HIT and e.request_id == "r1" and e.decode_url == D0
    # What the placement measures the next turn's append, and checks its prefix, against.
    assert e.chars == 1234 and e.prompt_key == b"\x00\x00\x00\x02" + b"h" * 16
    # When the conversation's next turn is expected, for the one that looks it up.
    assert (e.kept_at, e.gap) == (1_790_000_000.25, 7.5)
    assert await s.lookup(b"k") == (MISS, None)  # taken: a concurrent turn misses
    await s.release(e)  # P was never asked: usable again
    status, e = await s.lookup(b"k")
    assert status == HIT
    await s.consume(e)
    assert await s.lookup(b"k") == (MISS, None)
    assert make.made.evicted == {}


async def test_two_takers_one_winner(make):
    s1, s2 = await make(), (await make() if make.kind == "redis" else None)
    s2 = s2 or s1
    for i in range(20):
        await put(s1, b"k%d" % i, f"r{i}")
    results = await asyncio.gather(*(st.lookup(b"k%d" % i) for i in range(20)
                                     for st in (s1, s2)))
    hits = [r for r in results if r[0] == HIT]
    assert len(hits) == 20  # each handle once, whichever store asked first


async def test_replace_lru_and_end_release(make):
    s = await make(max_entries=2)
    await put(s, b"a", "r-a")
    await put(s, b"a", "r-a2")  # a newer turn of the same conversation
    await put(s, b"b", "r-b")
    await put(s, b"c", "r-c")  # over the bound: the oldest goes
    assert make.made.evicted["replaced"] == ["r-a"]
    assert make.made.evicted["lru"] == ["r-a2"]
    assert await s.count() == 2
    assert await s.end(b"b") and not await s.end(b"b")
    assert make.made.evicted["ended"] == ["r-b"]


async def test_ttl(make):
    s = await make(ttl=0.2)
    await put(s, b"a", "r-a")
    await asyncio.sleep(0.3)
    assert await s.lookup(b"a") == (EXPIRED, None)
    await put(s, b"b", "r-b")
    await asyncio.sleep(0.3)
    assert await s.sweep() == 1 and await s.count() == 0
    assert make.made.evicted["ttl"] == ["r-a", "r-b"]


async def test_pinned_blocks_watermark_and_replica_drops(make):
    s = await make()
    for i in range(4):
        await put(s, b"k%d" % i, f"r{i}", blocks=3)
    await put(s, b"x", "rx", url=D1, blocks=5, engine="e1")
    assert await s.pinned(D0) == 12 and await s.pinned(D1) == 5
    # No gap known for any: each is expected back one typical gap after it was kept, so
    # the newest goes first.
    assert await s.trim_replica(D0, 7) == 2
    assert make.made.evicted["watermark"] == ["r3", "r2"] and await s.pinned(D0) == 6
    await put(s, b"new", "rnew", blocks=1, engine="e0-restarted")
    assert await s.drop_replica(D0, "engine_changed", keep_engine_id="e0-restarted") == 2
    assert await s.pinned(D0) == 1 and await s.pinned(D1) == 5
    assert await s.drop_replica(D1, "replica_unhealthy") == 1


async def test_completion_prefix_lookup(make):
    s = await make()
    tenant = b"t" * 32
    text = "the quick brown fox"
    await put(s, completion_key(tenant, text[:9]), "short", tenant=tenant, prefix_len=9)
    await put(s, completion_key(tenant, text[:15]), "long", tenant=tenant, prefix_len=15)
    status, e = await s.lookup_prefix(tenant, text, prefix_keys(tenant))
    assert status == HIT and e.request_id == "long"  # the longest stored prefix
    status, e = await s.lookup_prefix(b"u" * 32, text, prefix_keys(b"u" * 32))
    assert status == MISS  # another tenant sees nothing


async def test_a_store_that_went_away_raises_and_comes_back(make):
    if make.kind != "redis":
        pytest.skip("the in-process store cannot go away")
    from bidirkv.router.store.shared import RedisStore

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
        assert await s.lookup(b"a") == (MISS, None) and s.available
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


# -- fairness between tenants --------------------------------------------------------------
A, B = b"a" * 16, b"b" * 16


async def test_the_entry_bound_takes_from_the_tenant_holding_the_most(make):
    """A tenant flooding the store with conversations spends its own handles only."""
    s = await make(max_entries=10)
    for i in range(3):
        await put(s, b"a%d" % i, f"a{i}", tenant=A)
    for i in range(20):
        await put(s, b"b%d" % i, f"b{i}", tenant=B)
    assert await s.count() == 10
    assert make.made.evicted["lru"] == [f"b{i}" for i in range(13)]
    for i in range(3):  # the quiet tenant's conversations all survived
        status, e = await s.lookup(b"a%d" % i)
        assert status == HIT
        await s.release(e)


async def test_a_tenant_over_its_own_cap_loses_its_oldest(make):
    s = await make()
    s.configure(100.0, 100, max_per_tenant=2)
    for i in range(4):
        await put(s, b"a%d" % i, f"a{i}", tenant=A)
    await put(s, b"b0", "b0", tenant=B)
    assert make.made.evicted["tenant_cap"] == ["a0", "a1"]
    assert await s.count() == 3


async def test_the_watermark_takes_from_the_tenant_pinning_the_most(make):
    s = await make()
    for i in range(2):
        await put(s, b"a%d" % i, f"a{i}", blocks=2, tenant=A)  # the oldest entries
    for i in range(6):
        await put(s, b"b%d" % i, f"b{i}", blocks=2, tenant=B)
    await put(s, b"other", "other", url=D1, blocks=40, tenant=B)  # another replica
    assert await s.pinned(D0) == 16
    assert await s.trim_replica(D0, 10) == 3
    assert make.made.evicted["watermark"] == ["b5", "b4", "b3"]  # no gaps: newest first
    assert await s.pinned(D0) == 10 and await s.pinned(D1) == 40
    # Heaviest first (B: 6 blocks), then, even at 4 each, either tenant's.
    assert await s.trim_replica(D0, 6) == 2
    assert make.made.evicted["watermark"][3] == "b2"
    assert make.made.evicted["watermark"][4] in ("a1", "b1")


async def test_the_block_bounds_take_the_conversation_expected_back_last(make):
    """Not the oldest: agents taken in turn come back oldest first. Overdue ones (idle
    past 3 gaps + 10 s: most likely finished) go before any still expected."""
    s = await make()
    now = time.time()
    await put(s, b"stale", "stale", blocks=2, kept_at=now - 120, gap=5.0)  # overdue
    await put(s, b"soon", "soon", blocks=2, kept_at=now - 4, gap=5.0)  # back in 1 s
    await put(s, b"late", "late", blocks=2, kept_at=now - 2, gap=60.0)  # in 58 s
    await put(s, b"new", "new", blocks=2, kept_at=now, gap=10.0)  # in 10 s
    assert await s.trim_replica(D0, 6) == 1
    assert await s.trim_replica(D0, 4) == 1
    assert await s.trim_replica(D0, 2) == 1
    assert make.made.evicted["watermark"] == ["stale", "late", "new"]
    status, e = await s.lookup(b"soon")
    assert status == HIT
    await s.release(e)
    # A tenant over its share of the replica loses its own the same way: neither its
    # oldest nor its newest, but the one expected back last.
    await put(s, b"t-old", "t-old", blocks=2, tenant=A, kept_at=now - 4, gap=5.0)
    await put(s, b"t-mid", "t-mid", blocks=2, tenant=A, kept_at=now - 2, gap=60.0)
    await put(s, b"t-new", "t-new", blocks=2, tenant=A, kept_at=now, gap=10.0,
              tenant_max_pinned=4)
    assert make.made.evicted["tenant_cap"] == ["t-mid"]


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


async def test_a_tenant_over_its_share_of_a_replica_loses_its_own_there(make):
    s = await make()
    await put(s, b"elsewhere", "elsewhere", url=D1, blocks=3, tenant=A)
    for i in range(4):
        await put(s, b"a%d" % i, f"a{i}", blocks=3, tenant=A, tenant_max_pinned=7)
    await put(s, b"b0", "b0", blocks=3, tenant=B, tenant_max_pinned=7)
    assert make.made.evicted["tenant_cap"] == ["a2", "a3"]  # no gaps: newest first
    assert await s.pinned(D0) == 9 and await s.pinned(D1) == 3
