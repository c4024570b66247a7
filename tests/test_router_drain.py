"""A draining decode replica (its pod is leaving): no new work there, and a conversation
it holds reads back through prefill and decodes elsewhere. Pure selection and placement,
then the router against fake engines."""

from __future__ import annotations

import asyncio

import pytest

from bidirkv.router.config import Placement
from bidirkv.router.pool.backends import Backend
from bidirkv.router.pool.drain import mark_draining, says_draining
from bidirkv.router.pool.placement import COST, EXTEND, MOVE, Costs, Inputs, place
from bidirkv.router.pool.selection import least_outstanding, pick_decode


def decodes(n):
    return [Backend(f"http://d{i}:8000", "decode") for i in range(n)]


def test_a_draining_replica_is_picked_only_when_every_healthy_one_drains():
    a, b, c = decodes(3)
    a.draining, b.outstanding, c.outstanding = True, 5, 2
    assert least_outstanding([a, b, c]) is c  # idle a is leaving
    c.healthy = False
    assert least_outstanding([a, b, c]) is b
    b.draining = True
    assert least_outstanding([a, b, c]) is a  # all leaving: the least loaded still serves
    assert least_outstanding([a, b, c], exclude=[a, b]) is None


def test_a_draining_holder_loses_its_turn():
    a, b = decodes(2)
    a.draining, b.outstanding = True, 3
    assert pick_decode([a, b], decode_url=a.url) is b
    b.healthy = False  # nobody else: the holder serves rather than nobody
    assert pick_decode([a, b], decode_url=a.url) is a
    b.healthy, a.draining = True, False
    assert pick_decode([a, b], decode_url=a.url) is a


@pytest.mark.parametrize("report, want", [
    ({"draining": True}, True), ({"draining": False}, False), ({}, None), (None, None),
    ({"numBlocks": 10}, None), ({"draining": "yes"}, None), ({"draining": 1}, None),
])
def test_says_draining(report, want):
    assert says_draining(report) is want


def test_mark_draining_keeps_what_it_knew_when_a_report_says_nothing():
    a, b = decodes(2)
    reports = {a.url: {"draining": True}, b.url: {}}
    assert mark_draining([a, b], reports.get) == [a]
    assert a.draining and not b.draining
    reports[b.url] = None
    assert mark_draining([a, b], reports.get) == []
    reports[a.url] = {"draining": False}  # a drain called off
    assert mark_draining([a, b], reports.get) == [a] and not a.draining


@pytest.mark.parametrize("inputs, want", [
    # Held on a leaving replica with another to take it: read back, decoded elsewhere,
    # however cheap the extend would be.
    (Inputs(4000, 10, 0, 0, other_inflight=3, holder_draining=True), (MOVE, "holder_draining")),
    (Inputs(4000, 10, 0, 0, other_inflight=0, sized=False, holder_draining=True),
     (MOVE, "holder_draining")),
    # Nobody else: as if it were not leaving (serving beats refusing).
    (Inputs(4000, 10, 0, 0, other_inflight=None, holder_draining=True),
     (EXTEND, "cheaper_on_decode")),
    (Inputs(4000, 10, 0, 0, other_inflight=3), (EXTEND, "cheaper_on_decode")),
])
def test_placement_with_a_draining_holder(inputs, want):
    d = place(inputs, Placement(policy=COST), Costs())
    assert (d.path, d.reason) == want


# -- the router against fake engines ---------------------------------------------------
from fake_engine import Cluster  # noqa: E402

U1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
FAST = {"healthCheckIntervalSeconds": 0.05}


async def until_draining(c, engine, draining=True):
    backend = c.router.ctx.decode.get(engine.url)
    for _ in range(200):
        if backend.draining is draining:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the router never saw {engine.url} draining={draining}")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("policy", [COST, "thresholds", "alwaysDisaggregate"])
async def test_a_turn_held_on_a_draining_replica_reads_back_and_decodes_elsewhere(policy):
    async with Cluster(decode=2, config={**FAST, "placement": {"policy": policy}}) as c:
        await c.chat([{"role": "user", "content": "warm up"}])  # sizes turns from now on
        r1 = await c.chat(U1)
        holder = next(d for d in c.d if any(g.body.get("messages") == U1
                                            for g in d.generations()))
        other = next(d for d in c.d if d is not holder)
        holder.behaviour.draining = True  # as its launcher's `"drain": true` leaves it
        await until_draining(c, holder)
        seen_holder, seen_other = len(holder.generations()), len(other.generations())
        r2 = await c.chat(U1 + [r1["message"], {"role": "user", "content": "ok"}])
        assert r2["status"] == 200
        if policy != "alwaysDisaggregate":
            assert r2["headers"]["X-Bidirkv-Placement"] == "move; reason=holder_draining"
        assert c.p[0].generations()[-1].has_handle  # P read the draining holder's blocks
        assert len(holder.generations()) == seen_holder  # nothing new on it
        assert len(other.generations()) == seen_other + 1  # the other decoded the turn
        # New conversations go elsewhere too.
        for i in range(3):
            assert (await c.chat([{"role": "user", "content": f"new {i}"}]))["status"] == 200
        assert len(holder.generations()) == seen_holder
        # The conversation moved: its next turn is held by the other replica.
        r3 = await c.chat(U1 + [r1["message"], {"role": "user", "content": "ok"},
                                r2["message"], {"role": "user", "content": "more"}])
        assert r3["status"] == 200 and len(holder.generations()) == seen_holder


@pytest.mark.timeout(30)
async def test_the_only_decode_replica_still_serves_while_it_drains():
    async with Cluster(decode=1, config=FAST) as c:
        c.d[0].behaviour.draining = True
        await until_draining(c, c.d[0])
        r = await c.chat(U1)
        assert r["status"] == 200 and c.d[0].generations()


@pytest.mark.timeout(30)
async def test_a_drain_called_off_takes_work_again():
    async with Cluster(decode=2, config=FAST) as c:
        d = c.d[0]
        d.behaviour.draining = True
        await until_draining(c, d)
        for i in range(4):
            await c.chat([{"role": "user", "content": f"a {i}"}])
        assert not d.generations()
        d.behaviour.draining = False
        await until_draining(c, d, draining=False)
        for i in range(4):
            await c.chat([{"role": "user", "content": f"b {i}"}])
        assert d.generations()
