"""HandleStore: TTL, LRU bound, single use (reservation), drops by replica and engine id."""

from bidirkv.router.request.identity import completion_key, prefix_keys, tenant_of
from bidirkv.router.store.handles import EXPIRED, HIT, MISS, HandleStore


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(ttl=100.0, max_entries=10):
    clock = Clock()
    evicted: dict[str, int] = {}

    def on_evict(reason: str, entries: list) -> None:
        evicted[reason] = evicted.get(reason, 0) + len(entries)

    return HandleStore(ttl, max_entries, clock=clock, on_evict=on_evict), clock, evicted


def test_hit_then_consume_is_single_use():
    s, _, _ = make()
    s.put(b"k", b'{"a":1}', "http://d0")
    status, e = s.lookup(b"k")
    assert status == HIT and e is not None and e.params == b'{"a":1}'
    s.consume(e)
    assert s.lookup(b"k") == (MISS, None)
    assert len(s) == 0


def test_reserved_entry_is_invisible_to_a_concurrent_lookup():
    s, _, _ = make()
    s.put(b"k", b"{}", "http://d0")
    _, e = s.lookup(b"k")
    assert s.lookup(b"k") == (MISS, None)
    s.release(e)  # P was never asked: the handle is usable again
    assert s.lookup(b"k")[0] == HIT


def test_discard_counts_reason():
    s, _, evicted = make()
    s.put(b"k", b"{}", "http://d0")
    _, e = s.lookup(b"k")
    s.discard(e, "reuse_failed")
    assert len(s) == 0 and evicted == {"reuse_failed": 1}


def test_ttl_expiry_on_lookup_and_sweep():
    s, clock, evicted = make(ttl=10)
    s.put(b"a", b"{}", "http://d0")
    clock.t += 5
    s.put(b"b", b"{}", "http://d0")
    clock.t += 6  # a is 11 s old, b 6 s
    assert s.lookup(b"a") == (EXPIRED, None)
    clock.t += 5
    assert s.sweep() == 1
    assert len(s) == 0 and evicted["ttl"] == 2


def test_lru_bound_drops_oldest():
    s, _, evicted = make(max_entries=3)
    for k in (b"1", b"2", b"3", b"4"):
        s.put(k, b"{}", "http://d0")
    assert len(s) == 3 and s.lookup(b"1") == (MISS, None)
    assert evicted == {"lru": 1}
    s.configure(10, 2)
    assert len(s) == 2 and s.lookup(b"2") == (MISS, None)


def test_put_replaces_and_refreshes_position():
    s, _, evicted = make(max_entries=2)
    s.put(b"1", b"old", "http://d0")
    s.put(b"2", b"{}", "http://d0")
    s.put(b"1", b"new", "http://d0")
    s.put(b"3", b"{}", "http://d0")  # evicts 2, the least recently stored
    assert s.lookup(b"2") == (MISS, None)
    assert s.lookup(b"1")[1].params == b"new"
    assert evicted == {"replaced": 1, "lru": 1}


def test_drop_replica_and_engine_change():
    s, _, evicted = make()
    s.put(b"a", b"{}", "http://d0", "e1")
    s.put(b"b", b"{}", "http://d0", "e2")
    s.put(b"c", b"{}", "http://d1", "e9")
    assert s.drop_replica("http://d0", "engine_changed", keep_engine_id="e2") == 1
    assert s.lookup(b"a") == (MISS, None)
    assert s.drop_replica("http://d0", "replica_unhealthy") == 1
    assert len(s) == 1
    assert evicted == {"engine_changed": 1, "replica_unhealthy": 1}


def test_consume_after_eviction_is_harmless():
    s, _, _ = make(max_entries=1)
    s.put(b"a", b"{}", "http://d0")
    _, e = s.lookup(b"a")
    s.put(b"b", b"{}", "http://d0")  # evicts the reserved entry
    s.consume(e)
    assert s.lookup(b"b")[0] == HIT


def test_prefix_lookup_longest_stored_prefix_per_tenant():
    s, _, _ = make()
    t1, t2 = tenant_of("Bearer one"), tenant_of("Bearer two")
    for text in ("Once upon", "Once upon a time"):
        s.put(completion_key(t1, text), text.encode(), "http://d0", tenant=t1,
              prefix_len=len(text))
    status, e = s.lookup_prefix(t1, "Once upon a time, there was", prefix_keys(t1))
    assert status == HIT and e.params == b"Once upon a time"
    s.consume(e)
    status, e = s.lookup_prefix(t1, "Once upon a time, there was", prefix_keys(t1))
    assert status == HIT and e.params == b"Once upon"
    s.release(e)
    assert s.lookup_prefix(t2, "Once upon a time", prefix_keys(t2)) == (MISS, None)
    assert s.lookup_prefix(t1, "Twice", prefix_keys(t1)) == (MISS, None)
    # Non-ASCII text hashes the same in one piece and incrementally.
    s.put(completion_key(t1, "héllo wörld"), b"x", "http://d0", tenant=t1, prefix_len=11)
    assert s.lookup_prefix(t1, "héllo wörld and more", prefix_keys(t1))[0] == HIT


def test_prefix_index_is_cleaned_up():
    s, _, _ = make(max_entries=1)
    t = tenant_of(None)
    s.put(completion_key(t, "abc"), b"x", "http://d0", tenant=t, prefix_len=3)
    s.put(b"other", b"y", "http://d0")  # LRU-evicts the prefix entry
    assert s._lengths == {}
