"""Router replicas that share conversations through a real Redis-protocol server."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from fake_engine import Cluster

from bidirkv.router.config import load_config
from bidirkv.router.server.app import build_app, start_router

pytestmark = pytest.mark.timeout(60)
U1 = [{"role": "user", "content": "hi"}]


class Replica:
    """One more router process-equivalent over the cluster's engines and config."""

    def __init__(self, cluster: Cluster, config: dict) -> None:
        self.cluster, self.config = cluster, config
        self.running = None

    async def __aenter__(self) -> Replica:
        overrides = {"prefill": [e.url for e in self.cluster.p],
                     "decode": [e.url for e in self.cluster.d],
                     "placement": {"policy": "alwaysDisaggregate"}, **self.config}
        self.running = await start_router(build_app(load_config(None, overrides)))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.running.stop()

    async def chat(self, messages, **extra):
        body = {"model": "fake-model", "messages": messages, **extra}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s, s.post(
                self.running.url + "/v1/chat/completions", json=body) as r:
            return r.status, await r.json()


def handles_sent(cluster: Cluster) -> int:
    return sum(1 for g in cluster.p[0].generations() if g.has_handle)


async def test_turn_one_on_a_turn_two_on_b_reuses(redis_url):
    cfg = {"handleStore": redis_url.url}
    async with Cluster(config=cfg) as c, Replica(c, cfg) as b:
        r1 = await c.chat(U1, conversation_id="conv")
        assert r1["status"] == 200
        status, _ = await b.chat(U1 + [r1["message"], {"role": "user", "content": "x"}],
                                 conversation_id="conv")
        assert status == 200 and handles_sent(c) == 1
        # Both routers tell decode the same owner: the store's, not their own.
        owners = {g.kv.get("bidirkv_owner") for g in c.d[0].generations()}
        store = c.router.ctx.store
        assert owners == {store.owner} and store.owner.startswith("store-")
        assert b.running.router.ctx.residency.owner == c.router.ctx.residency.owner


async def test_two_routers_racing_for_one_handle_one_wins(redis_url):
    cfg = {"handleStore": redis_url.url}
    async with Cluster(config=cfg) as c, Replica(c, cfg) as b:
        r1 = await c.chat(U1, conversation_id="conv")
        turn2 = U1 + [r1["message"], {"role": "user", "content": "x"}]
        c.p[0].behaviour.chunk_delay = 0.0
        results = await asyncio.gather(c.chat(turn2, conversation_id="conv"),
                                       b.chat(turn2, conversation_id="conv"))
        assert results[0]["status"] == 200 and results[1][0] == 200
        # Exactly one of them took turn 1's handle. The other either found nothing or,
        # when it looked after the winner's turn had ended, that turn's own new handle:
        # never turn 1's a second time.
        offered = [g.kv["remote_request_id"] for g in c.p[0].generations() if g.has_handle]
        assert offered and len(offered) == len(set(offered))


async def test_a_restarted_router_keeps_the_conversation(redis_url):
    cfg = {"handleStore": redis_url.url}
    async with Cluster(config=cfg) as c:
        async with Replica(c, cfg) as a:
            status, out = await a.chat(U1, conversation_id="conv")
            assert status == 200
        message = out["choices"][0]["message"]
        async with Replica(c, cfg) as restarted:
            status, _ = await restarted.chat(
                U1 + [message, {"role": "user", "content": "x"}], conversation_id="conv")
        assert status == 200 and handles_sent(c) == 1


async def test_store_down_and_back_requests_keep_succeeding(redis_url, monkeypatch):
    from bidirkv.router.store import shared as redisstore

    monkeypatch.setattr(redisstore, "BREAKER_OPEN_S", 0.2)
    cfg = {"handleStore": redis_url.url, "healthCheckIntervalSeconds": 0.05}
    async with Cluster(config=cfg) as c:
        r1 = await c.chat(U1, conversation_id="conv")
        redis_url.stop()
        r2 = await c.chat(U1 + [r1["message"], {"role": "user", "content": "x"}],
                          conversation_id="conv")
        assert r2["status"] == 200  # served without reuse
        async with c.session.get(c.url + "/ready") as r:
            ready = await r.json()
        assert r.status == 200 and ready["handleStore"] == {"shared": True, "available": False}
        assert "bidirkv_router_handle_store_errors_total" in await c.metrics()
        # D kept blocks for the handle the router could not store: released at once.
        assert await c.d[0].wait_released(r2["headers"]["X-Request-Id"])
        redis_url.start()
        await asyncio.sleep(0.3)  # past the breaker's open time
        r3 = await c.chat(U1, conversation_id="conv2")
        r4 = await c.chat(U1 + [r3["message"], {"role": "user", "content": "y"}],
                          conversation_id="conv2")
        assert r4["status"] == 200 and handles_sent(c) == 1  # reuse is back
        async with c.session.get(c.url + "/ready") as r:
            assert json.loads(await r.read())["handleStore"]["available"] is True


async def _owner_of(router, want: str) -> str:
    """The router's owner once it is `want` (bounded: its store rounds run every 50 ms)."""
    for _ in range(200):
        if router.ctx.residency.owner == want:
            break
        await asyncio.sleep(0.02)
    return router.ctx.residency.owner


async def test_after_a_failover_to_an_empty_replica_the_routers_converge_on_one_owner(
        redis_url):
    import redis.asyncio as redis

    cfg = {"handleStore": redis_url.url, "healthCheckIntervalSeconds": 0.05}
    r = redis.from_url(redis_url.url)
    try:
        async with Cluster(config=cfg) as c:
            assert (await c.chat(U1, conversation_id="conv"))["status"] == 200
            first = c.router.ctx.residency.owner
            assert first is not None and first.startswith("store-")
            # An empty replica takes over: nothing in the store, not even the owner. The
            # running router plants its own again, so decode keeps what it holds for it.
            await r.flushall()
            for _ in range(200):
                if await r.get("bidirkv:owner"):
                    break
                await asyncio.sleep(0.02)
            assert (await r.get("bidirkv:owner")).decode() == first
            # A new router pod got there first and set a fresh owner: the running one
            # reads it and tells decode the new one on its next turn.
            await r.flushall()
            await r.set("bidirkv:owner", "store-newpod")
            assert await _owner_of(c.router, "store-newpod") == "store-newpod"
            assert c.router.ctx.store.owner == "store-newpod"
            assert (await c.chat(U1, conversation_id="conv2"))["status"] == 200
            last = c.d[0].generations()[-1]
            assert last.kv.get("bidirkv_owner") == "store-newpod"
    finally:
        await r.aclose()
