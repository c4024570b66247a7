"""A shared store that answers with errors (not only one that is gone): every turn is still
served, without reuse, and reuse comes back with the store. Faults are made on a real
Redis server: out of memory under noeviction, a user without the commands the router
needs, and a read-only replica after a failover."""

from __future__ import annotations

import asyncio

import pytest
import redis
from fake_engine import Cluster
from redis_server import SlowLink, started

pytestmark = pytest.mark.timeout(60)
U1 = [{"role": "user", "content": "hi"}]


def admin(server) -> redis.Redis:
    return redis.Redis.from_url(server.url)


def handles_sent(c: Cluster) -> int:
    return sum(1 for g in c.p[0].generations() if g.has_handle)


async def two_turns(c: Cluster, cid: str) -> list[int]:
    r1 = await c.chat(U1, conversation_id=cid)
    r2 = await c.chat(U1 + [r1.get("message") or {"role": "assistant", "content": ""},
                            {"role": "user", "content": "x"}], conversation_id=cid)
    return [r1["status"], r2["status"]]


async def test_out_of_memory_serves_without_reuse_then_reuse_returns(redis_url):
    async with Cluster(config={"handleStore": redis_url.url}) as c:
        admin(redis_url).config_set("maxmemory", "1")
        assert await two_turns(c, "oom") == [200, 200]
        assert handles_sent(c) == 0
        async with c.session.get(c.url + "/ready") as r:
            assert (await r.json())["handleStore"]["available"] is False
        assert 'bidirkv_router_handle_store_errors_total{op="put"}' in await c.metrics()
        admin(redis_url).config_set("maxmemory", "0")
        assert await two_turns(c, "after") == [200, 200]
        assert handles_sent(c) == 1


async def test_a_user_without_permission_is_a_store_fault_not_a_500(redis_url):
    # The router's user (here the default one) may not run scripts or SET: NOPERM.
    admin(redis_url).execute_command("ACL", "SETUSER", "default", "-evalsha", "-eval", "-set")
    async with Cluster(config={"handleStore": redis_url.url}) as c:
        assert await two_turns(c, "noperm") == [200, 200]
        assert handles_sent(c) == 0


async def test_a_read_only_replica_is_a_store_fault_not_a_500(redis_url, monkeypatch):
    import asyncio

    from bidirkv.router.store import shared as redisstore

    monkeypatch.setattr(redisstore, "BREAKER_OPEN_S", 0.2)  # failures open the breaker
    primary = started()
    try:
        async with Cluster(config={"handleStore": redis_url.url}) as c:
            admin(redis_url).replicaof("127.0.0.1", primary.port)  # now READONLY to writes
            assert await two_turns(c, "ro") == [200, 200]
            assert handles_sent(c) == 0
            admin(redis_url).replicaof("NO", "ONE")
            await asyncio.sleep(0.3)  # past the breaker's open time: the next call tries
            assert await two_turns(c, "rw") == [200, 200]
            assert handles_sent(c) == 1
    finally:
        primary.stop()


async def test_a_slow_store_opens_the_breaker_and_turns_stop_waiting_for_it(redis_url):
    link = SlowLink(redis_url.port, delay=0.0)
    url = await link.start()
    try:
        async with Cluster(config={"handleStore": url, "healthCheckIntervalSeconds": 3600,
                                   "ownerLeaseSeconds": 7200}) as c:
            assert await two_turns(c, "fast") == [200, 200] and handles_sent(c) == 1
            link.delay = 0.6  # longer than a store call may take
            for i in range(3):  # each fails on the store's timeout: served, no reuse
                assert (await c.chat(U1, conversation_id=f"slow{i}"))["status"] == 200
            assert not c.router.ctx.store.available  # the breaker is open
            sent = link.chunks
            assert await two_turns(c, "open") == [200, 200]
            assert link.chunks == sent, "calls went to the store while the breaker was open"
            assert handles_sent(c) == 1
    finally:
        link.close()


async def test_a_lost_cancel_does_not_hang_the_routers_stop():
    """A loop whose first cancel is lost (Python 3.11's wait_for around a redis command
    that just completed) and that then waits for an event nobody sets still stops."""
    from bidirkv.router.datapath.upkeep import stopped

    never = asyncio.Event()

    async def loop():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass  # lost
        await never.wait()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    await asyncio.wait_for(stopped(task), 5)
    assert task.cancelled()
