"""Decode residency decisions (connector/core/residency.py) and the grant wire (lease.py)."""

import threading

import msgspec

from bidirkv.connector.core import lease
from bidirkv.connector.core.residency import (
    GRANT_MARGIN_S,
    Residency,
    blocks_wanted,
)
from bidirkv.connector.settings import Settings


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(**kw):
    clock = Clock()
    return Residency(clock=clock, **kw), clock


def test_release_then_grant_is_refused_and_grant_then_release_is_a_no_op():
    res, clock = make()
    res.retain("a", 3, "r1", clock.t + 100)
    res.retain("b", 2, "r1", clock.t + 100)
    assert res.release(["a"]) == 3
    assert res.grant("a")[:2] == (False, "released:router")
    assert res.grant("b")[:2] == (True, "granted")
    assert res.release(["b"]) == 0  # a read may be in flight: only its notification frees
    # Every worker of the reader (one per TP rank) asks for the same read: granted
    # again, with the same ids, until the read's notification frees the blocks.
    assert res.grant("b")[:2] == (True, "granted") and res.grants == 1
    assert res.take_pending() == ["a"]
    assert res.take_pending() == []
    # Refusals name what released the blocks.
    assert res.stats()["refusals"] == {"released_router": 1}
    res.frees(["b"])
    assert res.grant("b")[:2] == (False, "unknown")


def test_a_grant_hands_out_the_retained_blocks_ids_per_group():
    res, clock = make()
    res.retain("a", 5, "r1", clock.t + 100, block_ids=[7, 3, 9, 4, 4],
               groups=(3, 2))
    assert res.grant("a") == (True, "granted", [[7, 3, 9], [4, 4]])
    assert res.grant("nope") == (False, "unknown", [])


def test_grant_refused_near_vllms_deadline_and_for_unknown_ids():
    res, clock = make()
    res.retain("a", 1, None, clock.t + GRANT_MARGIN_S - 1)
    assert res.grant("a")[:2] == (False, "near_expiry")
    assert res.grant("nope")[:2] == (False, "unknown")
    assert res.stats()["refusals"] == {"near_expiry": 1, "unknown": 1}


def test_pressure_reclaims_whole_requests_and_skips_granted():
    res, clock = make()
    for rid, blocks in (("old", 2), ("granted", 4), ("mid", 3), ("new", 5)):
        res.retain(rid, blocks, None, clock.t + 100)
    res.grant("granted")
    # Kept at one instant, with no gap: a tie, which goes oldest first.
    assert res.reclaim(4) == 5  # old (2) + mid (3): whole requests
    assert res.take_pending() == ["old", "mid"]
    assert res.stats()["released"] == {"pressure": 2}
    assert res.releasing_blocks() == 5 and res.kept_blocks() == 9


def test_pressure_releases_the_conversation_expected_back_last():
    """Not the oldest: under agents taken in turn that is the one about to come back."""
    res, clock = make()
    res.retain("fast", 1, None, clock.t + 900, gap=1.0)  # back at 101
    clock.t += 1
    res.retain("slow", 1, None, clock.t + 900, gap=60.0)  # back at 161
    clock.t += 1
    res.retain("usual", 1, None, clock.t + 900, gap=5.0)  # back at 107
    assert res.reclaim(1) == 1 and res.take_pending() == ["slow"]
    assert res.reclaim(1) == 1 and res.take_pending() == ["usual"]
    assert res.reclaim(1) == 1 and res.take_pending() == ["fast"]


def test_an_overdue_conversation_goes_before_any_still_expected():
    res, clock = make()
    res.retain("stale", 1, None, clock.t + 900, gap=2.0)
    clock.t += 17  # idle 17 s: more than 3 gaps + 10 s, most likely finished
    res.retain("later", 1, None, clock.t + 900, gap=300.0)
    assert res.reclaim(1) == 1 and res.take_pending() == ["stale"]


def test_without_a_gap_an_entry_is_given_the_typical_one():
    res, clock = make()
    res.retain("a", 1, None, clock.t + 900, gap=10.0)  # back at 110
    clock.t += 2
    res.retain("b", 1, None, clock.t + 900, gap=10.0)  # back at 112
    clock.t += 1
    res.retain("new", 1, None, clock.t + 900)  # first turn: assumed back at 103 + 10
    assert res.prior_gap == 10.0
    assert res.reclaim(1) == 1 and res.take_pending() == ["new"]
    # Before any gap came, the newest goes first (the same assumed gap for all).
    res2, clock2 = make()
    for rid in ("first", "second", "third"):
        res2.retain(rid, 1, None, clock2.t + 900)
        clock2.t += 1
    assert res2.reclaim(1) == 1 and res2.take_pending() == ["third"]


def test_pressure_takes_from_the_tenant_holding_the_most_first():
    """One tenant's flood of retained conversations yields before anyone else's."""
    res, clock = make()
    res.retain("quiet-old", 4, None, clock.t + 100, tenant="quiet")
    for i in range(5):
        res.retain(f"flood-{i}", 3, None, clock.t + 100, tenant="flood")
    res.retain("quiet-new", 4, None, clock.t + 100, tenant="quiet")
    res.grant("flood-0")  # granted: not releasable, not counted as the flood's
    # The flood holds 12 releasable blocks, the quiet tenant 8: two of the flood's go
    # (12 -> 6), then the quiet tenant holds the most and its oldest goes.
    assert res.reclaim(9) == 10
    assert res.take_pending() == ["flood-1", "flood-2", "quiet-old"]
    assert res.reclaim(1) == 3 and res.take_pending() == ["flood-3"]  # 6 against 4
    res.frees(["quiet-new"])  # vLLM's TTL: no longer anyone's to reclaim
    assert res.reclaim(100) == 3 and res.take_pending() == ["flood-4"]
    assert res.reclaim(100) == 0 and res.kept_blocks() == 3  # the granted one stays


def test_owner_lease_lapses_unless_renewed():
    res, clock = make(owner_lease_s=10)
    res.retain("a", 1, "gone", clock.t + 100)
    res.retain("b", 1, "alive", clock.t + 100)
    res.retain("c", 1, None, clock.t + 100)  # no owner: TTL and pressure only
    clock.t += 5
    res.renew("alive", 10)
    clock.t += 6
    assert res.expire_owners() == 1
    assert res.take_pending() == ["a"]
    clock.t += 20
    assert res.expire_owners() == 1
    assert res.take_pending() == ["b"]


def test_watermark_counts_only_what_is_still_kept():
    res, clock = make(watermark=0.5)
    res.retain("a", 6, None, clock.t + 100)
    res.retain("b", 6, None, clock.t + 100)
    assert res.over_watermark(20) == 2
    res.reclaim(res.over_watermark(20), "watermark")
    assert res.over_watermark(20) == 0


def test_freed_requests_are_counted_by_how_they_went():
    res, clock = make()
    for rid in ("read", "released", "expired"):
        res.retain(rid, 1, None, clock.t + 100)
    res.grant("read")
    res.release(["released"])
    res.frees(["read", "released", "expired", "never-seen"])
    st = res.stats()
    assert st["freed"] == {"read": 1, "released": 1, "expired": 1}
    assert st["retainedRequests"] == 0
    assert res.kept_blocks() == res.releasing_blocks() == 0  # the running totals agree


def test_a_grant_and_a_release_race_one_wins():
    for _ in range(200):
        res, clock = make()
        res.retain("x", 1, None, clock.t + 100)
        out = {}
        go = threading.Barrier(2)

        def grant(res=res, out=out, go=go):
            go.wait()
            out["grant"] = res.grant("x")[0]

        def release(res=res, out=out, go=go):
            go.wait()
            out["release"] = res.release(["x"]) > 0

        threads = [threading.Thread(target=grant), threading.Thread(target=release)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert out["grant"] != out["release"], out


def test_blocks_wanted():
    assert blocks_wanted(0, 16, 0) == 1
    assert blocks_wanted(16, 16, 0) == 2  # the next token starts a block
    assert blocks_wanted(100, 16, 3) == 7 + 3


def test_side_channel_answers_grants_handshakes_and_garbage():
    meta = {(0, 0): b"agent-metadata"}
    calls = []

    def grant(rid):
        calls.append(rid)
        return True, "granted", [[5, 6]]

    frames = lease.answer(lease.lease_request("req-1"), meta, grant)
    assert calls == ["req-1"]
    assert lease.parse_reply(list(frames)) == (True, "granted", [[5, 6]])
    # A grant without usable ids is no grant: the reader would have nothing to read.
    for ids in (None, [[-1]], [["5"]], [5]):
        frames = lease.answer(lease.lease_request("req-2"), meta,
                              lambda rid, ids=ids: (True, "granted", ids))
        assert lease.parse_reply(list(frames))[0] is False
    frames = lease.answer(msgspec.msgpack.encode([b"get_meta_msg", 0, 0]), meta, grant)
    assert frames[0] == b"agent-metadata" and len(frames) == 2
    for junk in (b"\xff\x00", msgspec.msgpack.encode([b"get_meta_msg", 9, 9]),
                 msgspec.msgpack.encode({"a": 1}), lease.lease_request("x")):
        frames = lease.answer(junk, meta, None)
        assert lease.parse_reply(list(frames))[0] is False


def test_settings_for_residency():
    s = Settings.from_env({"BIDIRKV_OWNER_LEASE_SECONDS": "45",
                           "BIDIRKV_RETENTION_WATERMARK": "0.3"})
    assert (s.owner_lease_s, s.retention_watermark) == (45.0, 0.3)
    bad = Settings.from_env({"BIDIRKV_OWNER_LEASE_SECONDS": "soon",
                             "BIDIRKV_RETENTION_WATERMARK": "7"})
    assert (bad.owner_lease_s, bad.retention_watermark) == (30, 0.9)  # the knobs' defaults


def test_parked_counts_retained_entries_nothing_acts_on():
    res = Residency()
    for rid in ("a", "b", "c", "d"):
        res.retain(rid, 2, None, deadline=1e12)
    assert res.parked() == 4
    assert res.grant("a")[:2] == (True, "granted")
    res.release(["b"])
    assert res.parked() == 2
    res.frees(["a", "b", "c"])  # read, released, expired
    assert res.parked() == 1
    assert res.parked() == sum(1 for h in res.held.values() if h.state == "held")


def test_a_peer_that_gave_no_answer_is_not_asked_again_for_a_while():
    """Prefill's grant asks run in its worker, one read after another: a hung decode must
    cost one timeout per quiet window, not one per read."""
    asked: list[tuple[str, int]] = []
    answers = {("d0", 1): (False, "no answer in 1000 ms", []),
               ("d1", 1): (True, "granted", [[1]])}
    now = [0.0]

    def ask(host, port, req_id):
        asked.append((host, port))
        return answers[(host, port)]

    gate = lease.PeerGate(quiet_s=10, ask=ask, clock=lambda: now[0])
    assert gate.confirm("d0", 1, "r1") == (False, "no answer in 1000 ms", [])
    for i in range(5):  # refused at once: recomputed, nothing waits
        ok, why, _ = gate.confirm("d0", 1, f"r{i + 2}")
        assert not ok and "not asked" in why
    assert gate.confirm("d1", 1, "r9")[:2] == (True, "granted")  # other peers unaffected
    assert asked == [("d0", 1), ("d1", 1)]
    now[0] = 10.5
    answers[("d0", 1)] = (True, "granted", [[2]])
    assert gate.confirm("d0", 1, "r10")[:2] == (True, "granted")  # asked again, answered
    assert gate.confirm("d0", 1, "r11")[:2] == (True, "granted") and len(asked) == 4


def test_confirm_gives_up_on_a_side_channel_that_never_answers():
    import zmq

    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # accepts the request, never replies
    try:
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        ok, why, _ = lease.confirm("127.0.0.1", port, "r1", timeout_ms=200)
        assert not ok and why.startswith(lease.NO_ANSWER)
    finally:
        silent.close(0)


class Label(str):
    """A tenant label that counts how often the residency hashes it: each dict lookup or
    scan over tenants does, so the count is the work a reclaim does per tenant."""

    hashed = 0

    def __hash__(self) -> int:
        Label.hashed += 1
        return str.__hash__(self)

    def __eq__(self, other: object) -> bool:
        return str.__eq__(self, other)


def reclaim_work(tenants: int, releases: int = 200) -> int:
    res, clock = make()
    for i in range(tenants):
        for j in range(2):
            res.retain(f"r{i}-{j}", 1, None, clock.t + 900, tenant=Label(f"t{i}"),
                       gap=float(j + 1))
    Label.hashed = 0
    assert res.reclaim(releases) == releases
    return Label.hashed


def test_reclaim_work_grows_with_the_log_of_the_tenants_not_their_number():
    """Reclaim runs in the scheduler step under the lock: 10x the tenants must not cost
    10x per release (a scan over every tenant per release did)."""
    small, large = reclaim_work(500), reclaim_work(5000)
    assert large < 2 * small, (small, large)
    assert large < 200 * 100, large  # a scan would hash each of 5,000 labels per release


def test_reclaim_order_matches_the_sorted_rule_under_random_traffic():
    """The indexes (releaseorder.py) against the rule written plainly: the heaviest
    tenant by (blocks, entries), then its entry with the largest release_key, oldest on
    a tie, through retains, grants, frees and reclaims in random order."""
    import random

    from bidirkv.returns import release_key

    rng = random.Random(7)
    res, clock = make()
    kept = {}  # req id -> (tenant, blocks, kept_at, gap, seq)
    seq = 0
    for step in range(3000):
        clock.t += rng.random() * 3
        op = rng.random()
        if op < 0.55 or not kept:
            rid, tenant = f"r{step}", f"t{rng.randrange(12)}"
            gap = rng.choice([None, rng.random() * 30])
            blocks = rng.randrange(1, 5)
            rank = gap if gap is not None else (res.prior_gap or 0.0)
            res.retain(rid, blocks, None, clock.t + 10_000, tenant=tenant, gap=gap)
            kept[rid] = (tenant, blocks, clock.t, rank, seq)
            seq += 1
        elif op < 0.7:
            rid = rng.choice(sorted(kept))
            if rng.random() < 0.5:
                assert res.grant(rid)[0]
            else:
                res.frees([rid])
            del kept[rid]
        else:
            weights = {}
            for tenant, blocks, *_ in kept.values():
                b, n = weights.get(tenant, (0, 0))
                weights[tenant] = (b + blocks, n + 1)
            top = max(weights.values())
            # Ties between tenants: any of the heaviest may go (the order of first
            # arrival is the index's own); the entry within the tenant is exact.
            choices = {t for t, w in weights.items() if w == top}
            res.reclaim(1)
            (rid,) = res.take_pending()
            tenant = kept[rid][0]
            assert tenant in choices, (rid, weights)
            mine = [(r, v) for r, v in kept.items() if v[0] == tenant]
            want = max(mine, key=lambda rv: (release_key(clock.t, rv[1][2], rv[1][3],
                                                         rv[1][2] + 10_000), -rv[1][4]))
            assert rid == want[0], (rid, want)
            del kept[rid]


def test_an_extend_and_the_turn_it_extends_pin_their_shared_blocks_once():
    """The extend takes the old turn's blocks by prefix caching; until the router
    releases the old turn (after the leg), both are retained. Counted twice, decode's
    watermark saw 22 of its 24 blocks pinned and released the conversation just extended."""
    res, clock = make(watermark=0.5)
    assert res.retain("turn1", 10, "r", clock.t + 100, gap=5.0, block_ids=range(1, 11)) == 0
    clock.t += 5
    # Said in its handle: the router counts the 10 it shares once, too.
    assert res.retain("turn2", 12, "r", clock.t + 100, gap=5.0, block_ids=range(1, 13)) == 10
    assert res.kept_blocks() == 12
    assert res.over_watermark(24) == 0
    # The router drops the old turn's handle: nothing is freed, the extend pins it all.
    assert res.release(["turn1"]) == 0
    assert (res.kept_blocks(), res.releasing_blocks()) == (12, 0)
    res.frees(res.take_pending())
    assert (res.kept_blocks(), res.releasing_blocks()) == (12, 0)
    assert res.release(["turn2"]) == 12 and res.releasing_blocks() == 12


def test_a_release_counts_only_the_blocks_it_frees():
    res, clock = make()
    res.retain("old", 4, None, clock.t + 100, block_ids=[1, 2, 3, 4])
    res.retain("new", 6, None, clock.t + 100, block_ids=[1, 2, 3, 4, 5, 6])
    res.retain("other", 3, None, clock.t + 100)  # ids unknown: all its own
    assert res.kept_blocks() == 9
    assert res.release(["new"]) == 2  # 5 and 6; the rest stays pinned by "old"
    assert (res.kept_blocks(), res.releasing_blocks()) == (7, 2)
    assert res.release(["old"]) == 4
    assert (res.kept_blocks(), res.releasing_blocks()) == (3, 6)
    res.frees(["new"])  # vLLM freed 5 and 6; 1-4 go with "old"
    assert (res.kept_blocks(), res.releasing_blocks()) == (3, 4)
    res.frees(["old", "other"])
    assert (res.kept_blocks(), res.releasing_blocks()) == (0, 0)
    assert not res._pins and not res._rel


def test_the_block_totals_agree_with_a_recount_under_random_traffic():
    import random

    rng = random.Random(11)
    res, clock = make()
    for step in range(2000):
        op, live = rng.random(), sorted(res.held)
        if op < 0.4 or not live:
            start, n = rng.randrange(20), rng.randrange(1, 8)
            res.retain(f"r{step}", n, None, clock.t + 100, tenant=f"t{step % 3}",
                       block_ids=range(start, start + n))
        elif op < 0.55:
            res.grant(rng.choice(live))
        elif op < 0.7:
            res.release([rng.choice(live)])
        elif op < 0.8:
            res.reclaim(rng.randrange(1, 6))
        else:
            res.frees([rng.choice(live)])
        kept = {b for h in res.held.values() if h.state != "releasing" for b in h.ids}
        going = {b for h in res.held.values() if h.state == "releasing" for b in h.ids}
        assert res.kept_blocks() == len(kept), step
        assert res.releasing_blocks() == len(going - kept), step
        st = res.stats()
        assert st["retainedBlocks"] == len(kept | going), step
        assert st["grantedBlocks"] == sum(h.blocks for h in res.held.values()
                                          if h.state == "granted"), step


def test_blocks_wanted_leaves_out_what_prefix_caching_shares():
    # 100 tokens: 7 blocks of 16; 5 of them are held by a retained turn it extends.
    assert blocks_wanted(100, 16, 3, shared=5) == 2 + 3
    assert blocks_wanted(100, 16, 0, shared=99) == 0


def test_owners_are_bounded_and_a_refused_owner_changes_nothing():
    res, clock = make(max_owners=2)
    assert res.renew("a", 30) is None and res.renew("b", 30) is None
    refused = res.renew("c", 30)
    assert "refused" in refused and "2 owners" in refused
    assert res.renew("a", 60) is None  # a known owner still renews
    assert sorted(res.owners) == ["a", "b"]
    # A request retained for an owner decode has no room for keeps no lease to lapse.
    res.retain("x", 1, "c", clock.t + 100)
    assert res.held["x"].owner is None and "c" not in res.owners
    clock.t += 45
    assert res.expire_owners() == 0 and res.take_pending() == []


class NoWalk(dict):
    """`held` that refuses to be walked: the report and the lease check must not."""

    def _walk(self, *a):
        raise AssertionError("walked every retained request")

    __iter__ = values = items = keys = _walk


def test_the_report_and_lapsed_leases_walk_no_retained_requests():
    res, clock = make(owner_lease_s=10)
    for i in range(50):
        res.retain(f"r{i}", 2, "gone" if i % 10 == 0 else "alive", clock.t + 100,
                   block_ids=range(i, i + 2))
    res.grant("r1")
    res.release(["r2"])
    res.held = NoWalk(res.held)
    st = res.stats()
    assert (st["retainedRequests"], st["grantedBlocks"], st["releasingBlocks"]) == (50, 2, 0)
    assert st["retainedBlocks"] == 51  # ids 0..50: neighbours share one block
    res.renew("alive", 100)
    clock.t += 11
    assert res.expire_owners() > 0
    assert sorted(res.take_pending()) == sorted(["r2"] + [f"r{i}" for i in range(0, 50, 10)])


def test_prefills_lent_blocks_are_answered_until_vllm_frees_them():
    """P's handle names its blocks by count; D asks P for their ids before it reads.
    Answering changes nothing on P (vLLM's lease keeps the blocks until D's read)."""
    res, clock = make()
    res.lent.lend("p-1", [[4, 5, 6]])
    assert res.answer("p-1") == (True, "lent", [[4, 5, 6]])
    assert res.answer("p-1") == (True, "lent", [[4, 5, 6]])  # every worker of D asks
    assert res.grants == 0 and res.kept_blocks() == 0
    res.frees(iter(["p-1"]))  # D read them (or the lease ran out)
    assert res.answer("p-1") == (False, "unknown", []) and len(res.lent) == 0
    # Decode's retained requests are answered by their grant, as before.
    res.retain("d-1", 2, None, clock.t + 100, block_ids=[8, 9], groups=(2,))
    assert res.answer("d-1") == (True, "granted", [[8, 9]])


def test_a_fork_storm_shares_its_parents_blocks_once_and_yields_before_another_tenant():
    """100 children of one parent, each extending the parent's 64 blocks by prefix
    caching with 2 of its own: decode counts the shared prefix once (64 + 200, not
    6,600), and over the watermark the storm's tenant yields its children before a
    smaller tenant loses anything, and before the parent it forked from goes."""
    res, clock = make(watermark=0.5)
    res.retain("parent", 64, "r", clock.t + 400, tenant="storm", gap=1.0,
               block_ids=range(64))
    res.retain("quiet", 10, "r", clock.t + 400, tenant="other", gap=60.0,
               block_ids=range(1000, 1010))
    for i in range(100):
        clock.t += 0.01
        res.retain(f"child{i}", 66, "r", clock.t + 400, tenant="storm", gap=30.0,
                   block_ids=[*range(64), 2000 + 2 * i, 2001 + 2 * i])
    assert res.kept_blocks() == 64 + 200 + 10
    total = 400  # decode's blocks: the watermark lets retention pin 200
    over = res.over_watermark(total)
    assert over == 74
    res.reclaim(over, "watermark")
    assert res.over_watermark(total) == 0
    assert res.held["quiet"].state == "held" and res.held["parent"].state == "held"
    assert res.released["watermark"] == 37  # children, 2 blocks each


def test_shared_reads_keep_the_blocks_and_hold_back_what_would_free_them_mid_read():
    from bidirkv.wire import SHARE_PREFIX

    res, clock = make()
    res.retain("parent", 4, "r", clock.t + 100, tenant="t", block_ids=[1, 2, 3, 4],
               groups=(4,))
    assert res.answer(SHARE_PREFIX + "parent")[:2] == (False, "no_shared_reads")
    res.shares = True  # a worker in this process counts their notifications
    assert res.answer(SHARE_PREFIX + "parent") == (True, "shared", [[1, 2, 3, 4]])
    assert res.share("parent")[0]  # a second child at once
    # While read: neither pressure nor the router's release frees it, and a read that
    # would spend it after that release is refused as after any release.
    assert res.reclaim(4) == 0 and res.release(["parent"]) == 0
    assert res.grant("parent")[:2] == (False, "released:router")
    assert res.held["parent"].state == "held" and not res.take_pending()
    res.shared_done("parent")
    assert res.held["parent"].readers == 1 and not res.take_pending()
    res.shared_done("parent")  # the last: the release decided meanwhile is made now
    assert res.take_pending() == ["parent"] and res.released["router"] == 1
    assert res.share("parent")[:2] == (False, "released:router")
    res.shared_done("parent")  # a late or stray notification changes nothing
    assert res.stats()["sharedReads"] == 2


def test_the_parent_spends_its_handle_while_children_read_it_and_is_freed_after_them():
    """The parent's own read-back during a child's shared read is granted; its
    notification frees the blocks only once the shared reads are done, or at the TTL."""
    res, clock = make()
    res.shares = True
    res.retain("parent", 2, "r", clock.t + 100, tenant="t", block_ids=[1, 2], groups=(2,))
    res.retain("other", 1, "r", clock.t + 100, tenant="t", block_ids=[3], groups=(1,))
    assert res.share("parent")[0]
    assert res.grant("parent") == (True, "granted", [[1, 2]])
    assert res.share("parent")[:2] == (True, "shared")  # a child after the spend too
    # The parent's read notified, and "other" expired: only "other" is freed now.
    assert res.frees(["parent", "other"]) == {"other"} and "other" not in res.held
    res.shared_done("parent")
    assert res.frees([]) == set() and "parent" in res.held
    res.shared_done("parent")  # the last reader: the held-back free goes now
    assert res.frees([]) == {"parent"}
    assert res.freed["read"] == 1 and not res.held and res.frees([]) == set()
    assert res.share("parent")[:2] == (False, "unknown")  # freed: nothing to share
    # A reader that never notifies holds the blocks back until their TTL, no longer.
    res.retain("p2", 1, "r", clock.t + 100, tenant="t", block_ids=[4], groups=(1,))
    assert res.share("p2")[0] and res.grant("p2")[0]
    assert res.frees(["p2"]) == set()
    clock.t += 100
    assert res.frees([]) == {"p2"} and not res.held


def test_after_its_shared_reads_the_parent_is_read_once_as_before():
    res, clock = make()
    res.shares = True
    res.retain("parent", 2, "r", clock.t + 100, tenant="t", block_ids=[1, 2], groups=(2,))
    for _ in range(3):
        assert res.share("parent")[0]
        res.shared_done("parent")
    assert res.reclaim(0) == 0 and res.held["parent"].readers == 0
    assert res.grant("parent")[:2] == (True, "granted")
    res.frees(["parent"])
    assert res.freed["read"] == 1 and not res.held
    # Releasable again after its shared reads: pressure takes it as any other.
    res.retain("other", 2, "r", clock.t + 100, tenant="t", block_ids=[5, 6], groups=(2,))
    assert res.share("other")[0]
    res.shared_done("other")
    assert res.reclaim(2) == 2 and res.take_pending() == ["other"]
