"""Degraded paths: a kept-alive connection prefill had closed, and prefill-only mode
(no healthy decode replica), against the fake engines over HTTP."""

import asyncio
import contextlib

import pytest
from fake_engine import Cluster, FakeEngine

pytestmark = pytest.mark.timeout(30)

U1 = [{"role": "user", "content": "hi"}]
STALE = 'bidirkv_router_retries_total{reason="prefill_stale_connection"} 1.0'
P_REPLY = ["Served", " by", " prefill"]


async def without_health_rounds(c):
    """Stop the background health loop: only the test's own requests (and its explicit
    check_health calls) then use the router's connection pool and change health."""
    task = c.router.upkeep.health_task
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def ready(c):
    async with c.session.get(c.url + "/ready") as r:
        return r.status, await r.json()


async def decodes_down(c, *decodes):
    for d in decodes or c.d:
        d.behaviour.health_status = 503
    await c.router.health.check_health()


async def test_prefill_closing_a_kept_alive_connection_is_retried_on_a_new_one():
    async with Cluster(handle_key=b"k" * 32) as c:
        await without_health_rounds(c)
        assert (await c.chat(U1))["status"] == 200  # leaves a kept-alive connection to P
        c.p[0].behaviour.close_next = 1
        r = await c.chat(U1, stream=True, headers={"X-Request-Id": "rid-2"})
        assert r["status"] == 200 and r["text"] == "Hello from the fake."
        first, retry = c.p[0].generations()[1:]
        assert first.headers["X-Request-Id"] == retry.headers["X-Request-Id"] == "rid-2"
        # The same request, with a fresh single-use proof: P may have seen the first one
        # (and would then keep nothing for D).
        proofs = [g.kv.pop("bidirkv_proof") for g in (first, retry)]
        assert proofs[0] != proofs[1] and first.body == retry.body
        assert c.d[0].generations()[1].headers["X-Request-Id"] == "rid-2"
        assert c.router.ctx.prefill.backends[0].healthy
        m = await c.metrics()
        assert STALE in m and 'reason="prefill_failed"' not in m


async def test_stale_connection_on_a_reuse_turn_keeps_the_handle():
    async with Cluster() as c:
        await without_health_rounds(c)
        r1 = await c.chat(U1, conversation_id="a")
        c.p[0].behaviour.close_next = 1
        r2 = await c.chat(U1 + [r1["message"]], conversation_id="a")
        assert r2["status"] == 200
        first, retry = c.p[0].generations()[1:]
        # P refuses a handle it already accepted, so sending it again is safe.
        assert first.has_handle and retry.kv == first.kv
        m = await c.metrics()
        assert STALE in m and 'reuse_total{outcome="hit"} 1.0' in m
        assert 'reuse_total{outcome="dropped"} 0.0' in m and "reuse_failed" not in m
        assert len(c.router.ctx.store) == 1  # turn 2's own handle


async def test_a_new_connection_dropped_is_an_ordinary_prefill_failure():
    async with Cluster() as c:
        await without_health_rounds(c)
        extra = FakeEngine("prefill")
        await extra.start()
        try:
            # Added now, with no health round: the router has never connected to it.
            c.router.apply_config(c.router.ctx.cfg.model_copy(
                update={"prefill": [c.p[0].url, extra.url]}))
            extra.behaviour.close_next = 1
            c.router.ctx.prefill.backends[0].outstanding += 1  # so that `extra` is tried first
            r = await c.chat(U1)
            c.router.ctx.prefill.backends[0].outstanding -= 1
            assert r["status"] == 200 and len(extra.generations()) == 1
            assert not c.router.ctx.prefill.get(extra.url).healthy
            m = await c.metrics()
            assert "prefill_stale_connection" not in m
            assert 'retries_total{reason="prefill_failed"} 1.0' in m
        finally:
            await extra.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_no_healthy_decode_prefill_serves_whole_requests_until_decode_is_back(stream):
    async with Cluster(decode=2) as c:
        await without_health_rounds(c)
        c.p[0].behaviour.reply = P_REPLY
        await decodes_down(c)
        status, body = await ready(c)
        assert status == 200 and body["ready"] is True and body["mode"] == "prefill-only"
        assert "no healthy decode" in body["reason"]
        r = await c.chat(U1, stream, conversation_id="a", max_tokens=9)
        assert r["status"] == 200 and r["text"] == "Served by prefill"
        assert b"kv_transfer_params" not in r["raw"]
        if stream:
            assert r["events"][-1] == "[DONE]" and len(r["events"]) == len(P_REPLY) + 3
        (sent,) = c.p[0].generations()
        # The client's body as it came, salted with its tenant's cache_salt: no params,
        # its own stream flag and max_tokens.
        assert sent.body == {"model": "fake-model", "messages": U1, "stream": stream,
                             "max_tokens": 9,
                             "cache_salt": c.router.ctx.keys.cache_salt(b"anonymous")}
        r = await c.complete("once upon", stream)
        assert r["status"] == 200 and r["text"] == "Served by prefill"
        assert not any(d.generations() for d in c.d) and len(c.router.ctx.store) == 0
        m = await c.metrics()
        assert 'bidirkv_router_prefill_only_total{route="chat"} 1.0' in m
        assert 'bidirkv_router_prefill_only_total{route="completions"} 1.0' in m
        assert 'requests_total{outcome="ok",route="chat"} 1.0' in m
        assert 'leg_duration_seconds_count{leg="prefill_only",result="ok"} 2.0' in m
        assert 'reuse_total{outcome="miss"} 0.0' in m  # no prefill leg, no reuse to count
        # One decode is healthy again: the two legs, on that decode.
        c.d[1].behaviour.health_status = 200
        await c.router.health.check_health()
        assert (await ready(c)) == (200, {**body, "mode": "disaggregated", "reason": None,
                                          "decode": {"healthy": 1, "total": 2}})
        r = await c.chat(U1, stream, conversation_id="a")
        assert r["status"] == 200 and r["text"] == "Hello from the fake."
        assert c.p[0].generations()[-1].kv is not None  # a one-token prefill leg
        assert len(c.d[1].generations()) == 1 and not c.d[0].generations()
        assert len(c.router.ctx.store) == 1


async def test_prefill_only_request_retries_a_stale_connection_and_another_prefill():
    async with Cluster(prefill=2) as c:
        await without_health_rounds(c)
        await decodes_down(c)
        c.router.ctx.prefill.backends[1].outstanding += 1  # so that p0 is tried first
        assert (await c.chat(U1, stream=True))["status"] == 200  # a kept-alive connection
        c.p[0].behaviour.close_next = 1
        assert (await c.chat(U1, stream=True))["status"] == 200
        assert len(c.p[0].generations()) == 3 and c.router.ctx.prefill.backends[0].healthy
        c.p[0].behaviour.fail_next = 1
        assert (await c.chat(U1, stream=True))["status"] == 200
        c.router.ctx.prefill.backends[1].outstanding -= 1
        assert not c.router.ctx.prefill.backends[0].healthy and len(c.p[1].generations()) == 1
        m = await c.metrics()
        assert STALE in m and 'retries_total{reason="prefill_only_failed"} 1.0' in m


async def test_no_healthy_prefill_is_503_even_with_the_fallback():
    async with Cluster() as c:
        await without_health_rounds(c)
        c.p[0].behaviour.health_status = 500
        await decodes_down(c)
        r = await c.chat(U1)
        assert r["status"] == 503 and "prefill" in r["error"]["error"]["message"]
        status, body = await ready(c)
        assert status == 503 and body["mode"] == "unavailable"
        assert body["reason"] == "no healthy prefill engine"
        assert not c.p[0].generations()


async def test_fallback_off_is_503_and_a_reload_turns_it_on():
    async with Cluster(config={"prefillOnlyFallback": False}) as c:
        await without_health_rounds(c)
        await decodes_down(c)
        r = await c.chat(U1, stream=True)
        assert r["status"] == 503 and "decode" in r["error"]["error"]["message"]
        assert "Retry-After" in r["headers"] and not c.p[0].generations()
        assert (await ready(c))[0] == 503
        assert "prefill_only_total{" not in await c.metrics()
        c.router.apply_config(c.router.ctx.cfg.model_copy(update={"prefill_only_fallback": True}))
        assert (await c.chat(U1, stream=True))["status"] == 200
        assert (await ready(c))[1]["mode"] == "prefill-only"
