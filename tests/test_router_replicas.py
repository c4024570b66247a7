"""Router replicas as separate processes (as pods are) sharing one real Redis server.

Each replica is `bidir-kv router` in its own process, with the resource's handle key in
its environment, in front of the same fake engines (this process). A conversation's
lookup keys are derived from that key, so whichever replica a turn lands on finds the
handle an earlier turn stored through another, or through a replica since restarted.
"""

from __future__ import annotations

import asyncio
import json
import signal

import aiohttp
import pytest
from fake_engine import FakeEngine
from redis_server import started
from router_process import KEY, RouterProcess

from bidirkv.router.request.identity import LookupKeys

pytestmark = pytest.mark.timeout(120)
U1 = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def setup(tmp_path):
    redis = started()
    p, d = FakeEngine("prefill", nixl_host="10.0.1.1"), FakeEngine("decode", nixl_host="10.0.2.2")
    await p.start()
    await d.start()
    cfg = tmp_path / "router.json"
    # The handles between router processes are what is tested: every turn takes the legs.
    cfg.write_text(json.dumps({"prefill": [p.url], "decode": [d.url],
                               "placement": {"policy": "alwaysDisaggregate"}}))
    routers: list[RouterProcess] = []

    def router(name: str, key: str = KEY) -> RouterProcess:
        r = RouterProcess(cfg, redis.url, tmp_path / f"{name}.log", key)
        routers.append(r)
        return r

    try:
        yield p, d, router
    finally:
        for r in routers:
            r.stop(signal.SIGKILL)
        await p.stop()
        await d.stop()
        redis.stop()


def handles_sent(p: FakeEngine) -> int:
    return sum(1 for g in p.generations() if g.has_handle)


def test_every_replica_of_a_resource_derives_the_same_keys():
    a, b, other = LookupKeys(KEY.encode()), LookupKeys(KEY.encode()), LookupKeys(b"x" * 64)
    tenant = a.tenant_of("Bearer t")
    assert tenant == b.tenant_of("Bearer t") != other.tenant_of("Bearer t")
    assert a.explicit_key(tenant, "c") == b.explicit_key(tenant, "c")
    assert a.chat_history(tenant, U1).store_key({"role": "assistant", "content": "x"}) == \
        b.chat_history(tenant, U1).store_key({"role": "assistant", "content": "x"})
    # Without a handle key the keys are the process's own (another process draws its own).
    assert LookupKeys().tenant_of("Bearer t") != a.tenant_of("Bearer t")


async def test_turn_two_on_the_other_replica_and_after_a_restart_reuses(setup):
    p, _, router = setup
    a, b = await router("a").start(), await router("b").start()
    status, m1 = await a.chat(U1)
    assert status == 200
    history = U1 + [m1, {"role": "user", "content": "x"}]
    status, m2 = await b.chat(history)
    assert status == 200 and handles_sent(p) == 1, "turn 2 on B found no handle from A"
    history += [m2, {"role": "user", "content": "y"}]
    a.stop()
    a = await router("a-again").start()
    status, m3 = await a.chat(history)
    assert status == 200 and handles_sent(p) == 2, "the restarted replica found no handle"


async def test_chat_history_alone_names_the_conversation_on_every_replica(setup):
    p, _, router = setup
    a, b = await router("a").start(), await router("b").start()
    status, m1 = await a.chat(U1, conversation_id=None)
    assert status == 200
    status, _ = await b.chat(U1 + [m1, {"role": "user", "content": "x"}], conversation_id=None)
    assert status == 200 and handles_sent(p) == 1


async def test_a_conversation_ended_on_the_other_replica_is_gone(setup):
    p, _, router = setup
    a, b = await router("a").start(), await router("b").start()
    status, m1 = await a.chat(U1)
    assert status == 200
    assert await b.delete("conv") == 204
    assert await a.delete("conv") == 404
    status, _ = await a.chat(U1 + [m1, {"role": "user", "content": "x"}])
    assert status == 200 and handles_sent(p) == 0


async def test_another_handle_key_shares_nothing(setup):
    p, _, router = setup
    a, other = await router("a").start(), await router("other", key="f" * 64).start()
    status, m1 = await a.chat(U1)
    assert status == 200
    status, _ = await other.chat(U1 + [m1, {"role": "user", "content": "x"}])
    assert status == 200 and handles_sent(p) == 0


async def test_a_replica_killed_mid_stream_leaves_the_conversation_to_the_other(setup):
    p, d, router = setup
    a, b = await router("a").start(), await router("b").start()
    status, m1 = await a.chat(U1)
    assert status == 200
    turn2 = U1 + [m1, {"role": "user", "content": "x"}]
    d.behaviour.chunk_delay = 0.5
    streaming = asyncio.ensure_future(a.chat(turn2))
    for _ in range(100):  # bounded: until A's decode leg is under way
        if len(d.generations()) >= 2:
            break
        await asyncio.sleep(0.05)
    a.stop(signal.SIGKILL)
    with pytest.raises(aiohttp.ClientError):
        await streaming
    d.behaviour.chunk_delay = 0.0
    # The client retries on B: served, and the conversation goes on reusing there.
    status, m2 = await b.chat(turn2)
    assert status == 200
    sent = handles_sent(p)
    status, _ = await b.chat(turn2 + [m2, {"role": "user", "content": "y"}])
    assert status == 200 and handles_sent(p) == sent + 1
