"""When a kept conversation is expected back (bidirkv/returns.py) and the order a replica's
block bounds take handles in (bidirkv/router/store/base.py)."""

from __future__ import annotations

import math

from bidirkv.returns import MAX_GAP_S, gap_of, next_gap, release_key
from bidirkv.router.store.base import Entry, ReturnOrder


def test_the_gap_is_a_moving_average_of_idle_times():
    assert next_gap(None, 4.0) == 4.0
    assert next_gap(4.0, 8.0) == 6.0
    assert next_gap(6.0, -3.0) == 3.0  # a clock step back counts as no idle time
    assert next_gap(None, 1e12) == MAX_GAP_S


def test_only_a_finite_non_negative_number_is_a_gap():
    assert gap_of(2) == 2.0 and gap_of(0.5) == 0.5 and gap_of(1e9) == MAX_GAP_S
    for bad in (None, True, "3", -1, math.inf, math.nan, [1], 10**400):
        assert gap_of(bad) is None, bad


def test_overdue_first_then_expected_back_last():
    now = 1000.0
    keys = {
        "stale": release_key(now, 900.0, 5.0),  # idle 100 s > 3 x 5 + 10: overdue
        "staler": release_key(now, 800.0, 5.0),
        "late": release_key(now, 990.0, 60.0),  # back at 1050
        "soon": release_key(now, 996.0, 5.0),  # back at 1001
    }
    order = sorted(keys, key=keys.get, reverse=True)
    assert order == ["staler", "stale", "late", "soon"]
    # Just inside its overdue line (3 gaps + 10 s) a conversation is still expected.
    assert release_key(now, now - 24.9, 5.0)[0] == 0
    assert release_key(now, now - 25.1, 5.0)[0] == 1
    # Past its expiry a conversation is overdue, whatever its gap.
    assert release_key(now, now - 1, 600.0, expires=now - 0.5)[0] == 1


def entry(key: bytes, kept_at: float) -> Entry:
    return Entry(key, b"{}", "http://d", None, 0, math.inf, None, 0, blocks=1,
                 kept_at=kept_at)


def test_the_order_skips_reserved_and_forgets_removed_handles():
    order, live = ReturnOrder(), {}
    for i, gap in enumerate((1.0, 50.0, 20.0)):
        e = live[b"k%d" % i] = entry(b"k%d" % i, 100.0)
        order.add(e, gap)
    alive = lambda e: live.get(e.key) is e  # noqa: E731
    assert order.victim(101.0, alive, lambda e: e.reserved).key == b"k1"
    live[b"k1"].reserved = True  # in flight: kept, passed over
    assert order.victim(101.0, alive, lambda e: e.reserved).key == b"k2"
    del live[b"k2"]
    assert order.victim(101.0, alive, lambda e: e.reserved).key == b"k0"
    live[b"k1"].reserved = False
    assert order.victim(101.0, alive, lambda e: e.reserved).key == b"k1"
    # Long after: all overdue, the one overdue longest (k0, gap 1) first.
    assert order.victim(10_000.0, alive, lambda e: e.reserved).key == b"k0"


def test_dead_items_do_not_pile_up():
    order, live = ReturnOrder(), {}
    alive = lambda e: live.get(e.key) is e  # noqa: E731
    for i in range(10_000):  # one conversation, replaced every turn
        if b"c" in live:
            order.left()  # as the store counts a replaced handle out
        e = live[b"c"] = entry(b"c", float(i))
        order.add(e, 1.0)
        order.compact(alive)
    assert len(order._due) <= 130 and len(order._back) <= 130
    assert order.victim(0.0, alive, lambda e: False) is live[b"c"]
