"""Replica selection: least outstanding, tie spreading, holder preference, exclusions."""

from bidirkv.router.pool.backends import DECODE, PREFILL, Backend, Pool
from bidirkv.router.pool.selection import holder_of, least_outstanding, pick_decode


def backends(n, role=PREFILL, host="10.0.0.{i}"):
    return [Backend(f"http://{host.format(i=i)}:8000", role) for i in range(n)]


def test_least_outstanding_and_health():
    bs = backends(3)
    bs[0].outstanding, bs[1].outstanding, bs[2].outstanding = 3, 1, 2
    assert least_outstanding(bs) is bs[1]
    bs[1].healthy = False
    assert least_outstanding(bs) is bs[2]
    assert least_outstanding(bs, exclude=[bs[2]]) is bs[0]
    for b in bs:
        b.healthy = False
    assert least_outstanding(bs) is None
    assert least_outstanding([]) is None


def test_ties_rotate_with_start():
    bs = backends(3)
    assert [least_outstanding(bs, start=i) for i in range(3)] == bs


def test_decode_prefers_the_holder():
    ds = backends(3, DECODE)
    ds[1].outstanding = 2  # a little busier than the others: still the holder
    assert pick_decode(ds, decode_url=ds[1].url) is ds[1]
    ds[1].healthy = False
    assert pick_decode(ds, decode_url=ds[1].url) is ds[0]
    ds[1].healthy = True
    assert pick_decode(ds, decode_url=ds[1].url, exclude=[ds[1]]) is ds[0]
    assert pick_decode(ds, remote_host="10.0.0.2") is ds[2]


def test_a_busy_holder_loses_the_turn_to_an_idle_replica():
    ds = backends(3, DECODE)
    ds[1].outstanding = 4
    assert pick_decode(ds, decode_url=ds[1].url, slack=4) is ds[1]  # within the slack
    ds[1].outstanding = 5
    assert pick_decode(ds, decode_url=ds[1].url, slack=4) is ds[0]  # a queue: elsewhere
    ds[0].outstanding = ds[2].outstanding = 3
    assert pick_decode(ds, decode_url=ds[1].url, slack=4) is ds[1]  # all busy alike


def test_holder_by_host_only_when_unambiguous():
    ds = [Backend("http://127.0.0.1:1", DECODE), Backend("http://127.0.0.1:2", DECODE)]
    assert holder_of(ds, None, "127.0.0.1") is None
    assert holder_of(ds, "http://127.0.0.1:2", "127.0.0.1") is ds[1]


def test_pool_reconcile_keeps_state():
    pool = Pool(DECODE, ["http://a:1", "http://b:1"])
    a = pool.backends[0]
    a.outstanding = 2
    added, removed = pool.reconcile(["http://a:1", "http://c:1"])
    assert pool.backends[0] is a and a.outstanding == 2
    assert [b.url for b in added] == ["http://c:1"]
    assert [b.url for b in removed] == ["http://b:1"] and not removed[0].in_pool
