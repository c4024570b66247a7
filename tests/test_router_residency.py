"""Every way the router drops a handle tells that decode to free its blocks (fake engines).

Decode's side of the contract (the engines' /bidirkv/residency, the lease, the grant
before a read) runs against real vLLM servers in e2e/test_residency.py.
"""

import asyncio

import pytest
from fake_engine import Cluster

pytestmark = pytest.mark.timeout(30)

U1 = [{"role": "user", "content": "hi"}]


def more(r, text="more"):
    return U1 + [r["message"], {"role": "user", "content": text}]


async def test_decode_leg_names_the_owner_and_heartbeats_renew_it():
    async with Cluster(config={"healthCheckIntervalSeconds": 0.05,
                               "ownerLeaseSeconds": 7}) as c:
        await c.chat(U1, conversation_id="a")
        owner = c.router.ctx.residency.owner
        d_req = c.d[0].generations()[0]
        assert d_req.kv["bidirkv_owner"] == owner
        # The prefill leg carries no owner: P's blocks are read once, by D.
        assert "bidirkv_owner" not in c.p[0].generations()[0].kv
        for _ in range(100):
            if c.d[0].residency_calls:
                break
            await asyncio.sleep(0.02)
        call = c.d[0].residency_calls[0]
        assert call["owner"] == owner and call["leaseSeconds"] == 7


async def test_explicit_end_releases_and_is_tenant_scoped():
    async with Cluster() as c:
        await c.chat(U1, conversation_id="a", headers={"X-Request-Id": "rid-a",
                                                       "Authorization": "Bearer t1"})
        async with c.session.delete(c.url + "/v1/conversations/a",
                                    headers={"Authorization": "Bearer t2"}) as r:
            assert r.status == 404  # another tenant's conversation is not visible
        async with c.session.delete(c.url + "/v1/conversations/a",
                                    headers={"Authorization": "Bearer t1"}) as r:
            assert r.status == 204
        assert await c.d[0].wait_released("rid-a")
        async with c.session.delete(c.url + "/v1/conversations/a",
                                    headers={"Authorization": "Bearer t1"}) as r:
            assert r.status == 404
            assert (await r.json())["error"]["param"] == "conversation_id"
        assert 'bidirkv_router_handle_evictions_total{reason="ended"} 1.0' in await c.metrics()


async def test_concurrent_duplicates_release_the_superseded_handle():
    async with Cluster() as c:
        await asyncio.gather(
            c.chat(U1, conversation_id="a", headers={"X-Request-Id": "dup-1"}),
            c.chat(U1, conversation_id="a", headers={"X-Request-Id": "dup-2"}))
        assert len(c.router.ctx.store) == 1 and await c.router.ctx.store.pinned(c.d[0].url) > 0
        released = [rid for rid in ("dup-1", "dup-2") if await c.d[0].wait_released(rid, 2)]
        assert len(released) == 1


async def test_lru_bound_releases_the_oldest():
    async with Cluster(config={"maxConversations": 1}) as c:
        await c.chat(U1, conversation_id="a", headers={"X-Request-Id": "rid-a"})
        await c.chat(U1, conversation_id="b", headers={"X-Request-Id": "rid-b"})
        assert await c.d[0].wait_released("rid-a")
        assert "rid-b" not in c.d[0].released


async def test_router_ttl_releases():
    async with Cluster(config={"conversationTtlSeconds": 0.2,
                               "healthCheckIntervalSeconds": 0.05}) as c:
        await c.chat(U1, conversation_id="a", headers={"X-Request-Id": "rid-a"})
        assert await c.d[0].wait_released("rid-a")
        assert len(c.router.ctx.store) == 0


async def test_failed_reuse_releases_but_a_read_does_not():
    async with Cluster() as c:
        r1 = await c.chat(U1, conversation_id="a", headers={"X-Request-Id": "rid-1"})
        await c.chat(more(r1), conversation_id="a", headers={"X-Request-Id": "rid-2"})
        c.p[0].behaviour.fail_with_handle = 500
        await c.chat(more(r1, "again"), conversation_id="a", headers={"X-Request-Id": "rid-3"})
        assert await c.d[0].wait_released("rid-2")
        # P took rid-1's handle (it read the blocks; its notification frees them): no
        # release for it, though one was sent after it would have been.
        assert "rid-1" not in c.d[0].released


async def eight_blocks(c: Cluster) -> None:
    """The decode replica reports 8 blocks, and the router has learned it."""
    c.d[0].behaviour.num_blocks = 8
    for _ in range(100):
        if c.router.ctx.residency.capacity(c.d[0].url) == 8:
            return
        await asyncio.sleep(0.02)


async def test_watermark_keeps_pinned_blocks_under_the_share_of_decode():
    async with Cluster(config={"retentionWatermark": 0.5,
                               "healthCheckIntervalSeconds": 0.05}) as c:
        await eight_blocks(c)
        for i in range(6):
            await c.chat(U1, conversation_id=f"c{i}", headers={"X-Request-Id": f"rid-{i}"})
            assert await c.router.ctx.store.pinned(c.d[0].url) <= 4
        # No turn came back, so no gap is known: each handle is expected back one typical
        # gap after it was kept, and the newest goes first (bidirkv/returns.py).
        assert await c.d[0].wait_released("rid-5")
        assert "rid-0" not in c.d[0].released
        metrics = await c.metrics()
        assert 'bidirkv_router_handle_evictions_total{reason="watermark"}' in metrics
        assert "bidirkv_router_decode_kv_blocks" in metrics


@pytest.mark.parametrize(("total", "shared", "replaced", "counted"), [
    (10, 0, None, 10),  # a first turn: all its own
    (12, 10, None, 2),  # a fork on its parent's holder: the prefix is the parent's
    (12, 10, 10, 12),  # an extend: the turn it replaces leaves, its blocks are this one's
    (14, 12, 2, 4),  # a fork's next turn: its own two, two more; the prefix stays shared
    (5, 9, None, 0),  # more than it has (a decode's nonsense): never below 0
    (5, 0, 9, 5),  # never above its own blocks
])
def test_a_handle_counts_the_blocks_decode_kept_for_it_alone(total, shared, replaced, counted):
    from bidirkv.router.datapath.keeping import counted_blocks
    from bidirkv.router.store.base import Entry

    entry = None if replaced is None else Entry(b"k" * 32, b"{}", "http://d", None, 0, 0.0,
                                                None, 0, blocks=replaced)
    assert counted_blocks(total, shared, entry) == counted


async def test_forks_on_the_parents_holder_count_the_shared_prefix_once():
    """Decode says how many of a handle's blocks it kept already (SHARED_BLOCKS_KEY): six
    handles that share everything fit under a watermark that holds four whole ones, and
    the count never reaches the prefill leg."""
    from bidirkv.wire import SHARED_BLOCKS_KEY

    async with Cluster(config={"retentionWatermark": 0.5,
                               "healthCheckIntervalSeconds": 0.05}) as c:
        await eight_blocks(c)
        replies = {}
        for i in range(6):
            replies[i] = await c.chat(U1, conversation_id=f"c{i}")
            c.d[0].behaviour.shared_blocks = 1_000  # the later ones share every block
        assert await c.router.ctx.store.pinned(c.d[0].url) == 1
        assert len(c.router.ctx.store) == 6 and not c.d[0].released
        await c.chat(more(replies[0]), conversation_id="c0")
        (leg,) = [g for g in c.p[0].generations() if g.has_handle]
        assert SHARED_BLOCKS_KEY not in leg.kv


async def test_unidentifiable_turn_releases_at_once():
    async with Cluster() as c:
        # A batched prompt: no conversation can be named for it, so no handle is stored.
        await c.complete(["a", "b"], headers={"X-Request-Id": "batch"})
        assert await c.d[0].wait_released("batch")
        assert len(c.router.ctx.store) == 0


async def test_decode_restart_drops_handles_without_a_release():
    async with Cluster() as c:
        await c.chat(U1, conversation_id="a", headers={"X-Request-Id": "rid-a"})
        c.d[0].engine_id = "decode-restarted"
        await c.chat(U1, conversation_id="b", headers={"X-Request-Id": "rid-b"})
        assert len(c.router.ctx.store) == 1
        async with c.session.delete(c.url + "/v1/conversations/b") as r:
            assert r.status == 204
        assert await c.d[0].wait_released("rid-b")
        # The restarted engine no longer has rid-a's blocks: nothing to release.
        assert "rid-a" not in c.d[0].released


async def test_decode_without_the_route_is_left_alone():
    async with Cluster(config={"healthCheckIntervalSeconds": 0.05}) as c:
        c.d[0].behaviour.residency_status = 404
        r = await c.chat(U1, conversation_id="a")
        assert r["status"] == 200
        for _ in range(100):
            if not c.router.ctx.residency.replica(c.d[0].url).supported:
                break
            await asyncio.sleep(0.02)
        assert not c.router.ctx.residency.replica(c.d[0].url).supported
        calls, checks = len(c.d[0].residency_calls), c.d[0].health_checks
        while c.d[0].health_checks < checks + 3:  # three more health rounds
            await asyncio.sleep(0.02)
        assert len(c.d[0].residency_calls) == calls  # not asked again


async def test_a_release_decode_did_not_take_goes_again_with_the_next_call():
    async with Cluster(config={"healthCheckIntervalSeconds": 0.05}) as c:
        await c.chat(U1, conversation_id="a", headers={"X-Request-Id": "rid-a"})
        c.d[0].behaviour.residency_status = 503
        async with c.session.delete(c.url + "/v1/conversations/a") as r:
            assert r.status == 204
        assert not await c.d[0].wait_released("rid-a", timeout=0.3)
        c.d[0].behaviour.residency_status = 200
        assert await c.d[0].wait_released("rid-a")


async def test_a_refused_batch_does_not_hold_back_the_lease():
    async with Cluster(config={"healthCheckIntervalSeconds": 10}) as c:
        await c.chat(U1, conversation_id="a", headers={"X-Request-Id": "rid-a"})
        c.d[0].behaviour.residency_status = 400
        calls = len(c.d[0].residency_calls)
        c.router.ctx.residency.release_ids(c.d[0].url, ["rid-a"])
        assert not await c.router.ctx.residency.call(c.router.clients.pooled, c.d[0].url)
        sent = [call["release"] for call in c.d[0].residency_calls[calls:]]
        # The batch, then the renewal alone (a health round may call too).
        at = sent.index(["rid-a"])
        assert sent[at + 1] == [] and sent.count(["rid-a"]) == 1
        assert all(call["owner"] == c.router.ctx.residency.owner
                   for call in c.d[0].residency_calls[calls:])


async def test_a_long_client_request_id_never_reaches_decode():
    async with Cluster() as c:
        r = await c.chat(U1, conversation_id="a", headers={"X-Request-Id": "x" * 495})
        assert r["status"] == 200
        sent = [g.headers["X-Request-Id"] for g in c.d[0].generations() + c.p[0].generations()]
        assert sent and all(len(rid) <= 128 for rid in sent)


async def test_a_slow_store_never_makes_a_lease_renewal_late():
    async with Cluster(config={"healthCheckIntervalSeconds": 0.05}) as c:
        async def slow_sweep():
            await asyncio.sleep(5)  # a store that takes seconds to answer
            return 0

        c.router.ctx.store.sweep = slow_sweep
        await asyncio.sleep(0.1)
        before = len(c.d[0].residency_calls)
        await asyncio.sleep(1.0)
        # Renewals keep their 50 ms rounds while the store's upkeep is stuck.
        assert len(c.d[0].residency_calls) - before >= 5
