"""Tenants over HTTP against fake engines: each tenant's cache_salt on every leg, a
client's own salt bounded and never kept, a client rotating credentials pooled past its
address's cap, the gateway's trusted header."""

import gc
import tracemalloc

import pytest
from fake_engine import Cluster

from bidirkv.router.pool.placement import THRESHOLDS
from bidirkv.wire import TENANT_KEY

pytestmark = pytest.mark.timeout(30)

U1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
KEY = b"k" * 32
ALICE = {"Authorization": "Bearer alice"}
BOB = {"Authorization": "Bearer bob"}


def salts(engine):
    return [rec.body.get("cache_salt") for rec in engine.generations()]


@pytest.mark.parametrize("stream", [False, True])
async def test_every_leg_and_extend_carries_the_tenants_salt_and_reuse_is_kept(stream):
    config = {"placement": {"policy": THRESHOLDS}, "placementHeader": True}
    async with Cluster(config=config, handle_key=KEY) as c:
        r1 = await c.chat(U1, stream, headers=ALICE)
        turn2 = U1 + [r1["message"], {"role": "user", "content": "and then?"}]
        r2 = await c.chat(turn2, stream, headers=ALICE)
        assert r2["headers"]["X-Bidirkv-Placement"] == "extend; reason=short_append"
        [alice] = set(salts(c.p[0]) + salts(c.d[0]))  # both legs, then the extend
        assert isinstance(alice, str) and len(alice) == 32
        assert len(salts(c.d[0])) == 2
        # The same salt turn to turn: the extend found turn 1's handle (reuse kept).
        assert 'bidirkv_router_reuse_total{outcome="extended"} 1.0' in await c.metrics()
        # Another tenant, the same prompt: another salt, so vLLM's prefix cache and the
        # connector's digests never match across them.
        await c.chat(U1, stream, headers=BOB)
        bob = salts(c.p[0])[-1]
        assert bob != alice and salts(c.d[0])[-1] == bob
        # A client's own salt splits its tenant's cache, scoped to the tenant.
        await c.chat(U1, stream, headers=ALICE, cache_salt="mine")
        await c.chat(U1, stream, headers=BOB, cache_salt="mine")
        mine_a, mine_b = salts(c.p[0])[-2:]
        assert len({mine_a, mine_b, alice, bob, "mine"}) == 5


async def test_plain_pd_and_a_refused_salt():
    async with Cluster(config={"bidirectional": False}, handle_key=KEY) as c:
        await c.chat(U1, headers=ALICE)
        [salt] = set(salts(c.p[0]) + salts(c.d[0]))
        assert salt is not None
        # Not a salt vLLM takes: refused by the router, naming the field; no engine asked.
        r = await c.chat(U1, headers=ALICE, cache_salt="")
        assert r["status"] == 400 and r["error"]["error"]["param"] == "cache_salt"
        assert len(c.p[0].generations()) == 1


async def test_many_distinct_large_salts_grow_nothing_the_router_keeps():
    """Over-long salts are refused before anything is kept (the router kept each one whole
    in its salt cache and answered 200: 16 of 1 MB kept 16 MB); salts it takes reach the
    legs each as its own, while its salt caches hold one entry per tenant."""
    async with Cluster(handle_key=KEY) as c:
        await c.chat(U1, headers=ALICE, cache_salt="warm")
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            answers = [await c.chat(U1, headers=ALICE, cache_salt=f"{i:02d}" + "s" * 999_998)
                       for i in range(16)]
            gc.collect()
            kept = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert kept < 1_000_000, kept
        assert {a["status"] for a in answers} == {400}
        assert answers[0]["error"]["error"]["message"] == (
            "cache_salt: 1000000 characters is too long; at most 128 allowed")
        for i in range(20):
            await c.chat(U1, headers=ALICE, cache_salt=f"{i:03d}" + "s" * 125)
        assert len(set(salts(c.p[0])[-20:])) == 20
        keys = c.router.ctx.keys
        assert keys._salt_state.cache_info().currsize == 1


async def test_a_client_rotating_credentials_is_pooled_past_its_cap():
    """From one address, the third credential on is one tenant for the bounds and for
    decode's eviction, while its conversations stay its own."""
    async with Cluster(config={"maxTenantsPerSource": 2}, handle_key=KEY) as c:
        creds = [{"Authorization": f"Bearer k{i}"} for i in range(4)]
        firsts = [await c.chat(U1, conversation_id="c", headers=h) for h in creds]
        labels = [rec.kv[TENANT_KEY] for rec in c.d[0].generations()]
        assert len(set(labels[:2])) == 2 and labels[2] == labels[3]
        assert labels[2] not in labels[:2]
        # The router's bounds count three tenants: two own, one pool.
        assert len(c.router.ctx.store.ix.by_tenant) == 3
        # Pooled, each still reaches its own handle and no other's.
        turn2 = U1 + [firsts[2]["message"], {"role": "user", "content": "more"}]
        await c.chat(turn2, conversation_id="c", headers=creds[2])
        assert c.p[0].generations()[-1].has_handle
        await c.chat(turn2, conversation_id="c", headers={"Authorization": "Bearer k9"})
        assert not c.p[0].generations()[-1].has_handle
        assert salts(c.p[0])[2] != salts(c.p[0])[3]


async def test_the_trusted_header_alone_names_the_tenant():
    config = {"trustedTenantHeader": "X-Tenant", "maxTenantsPerSource": 1}
    async with Cluster(config=config, handle_key=KEY) as c:
        r1 = await c.chat(U1, conversation_id="c",
                          headers={"X-Tenant": "acme", "Authorization": "Bearer one"})
        turn2 = U1 + [r1["message"]]
        # Another credential of the same verified tenant continues its conversation.
        await c.chat(turn2, conversation_id="c",
                     headers={"X-Tenant": "acme", "Authorization": "Bearer two"})
        assert c.p[0].generations()[1].has_handle
        # Without the header: the anonymous tenant, whatever the credential says.
        await c.chat(turn2, conversation_id="c", headers={"Authorization": "Bearer one"})
        assert not c.p[0].generations()[2].has_handle
        r4 = await c.chat(U1, conversation_id="n", headers={"Authorization": "Bearer x"})
        await c.chat(U1 + [r4["message"]], conversation_id="n",
                     headers={"Authorization": "Bearer y"})
        assert c.p[0].generations()[4].has_handle
        # DELETE names the tenant the same way.
        async with c.session.delete(c.url + "/v1/conversations/c",
                                    headers={"X-Tenant": "other"}) as r:
            assert r.status == 404
        async with c.session.delete(c.url + "/v1/conversations/c",
                                    headers={"X-Tenant": "acme"}) as r:
            assert r.status == 204
