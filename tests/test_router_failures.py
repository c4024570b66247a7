"""Failures: retries, mid-stream errors, 503s, timeouts, cancellation on client disconnect."""

import asyncio
import json

import aiohttp
import pytest
from fake_engine import Cluster, sse_events

from bidirkv.bench.traces import read_spans

pytestmark = pytest.mark.timeout(30)

U1 = [{"role": "user", "content": "hi"}]


async def test_prefill_failure_on_reuse_turn_is_retried_without_the_handle():
    async with Cluster() as c:
        r1 = await c.chat(U1, conversation_id="a")
        c.p[0].behaviour.fail_with_handle = 500
        r2 = await c.chat(U1 + [r1["message"]], conversation_id="a", stream=True)
        assert r2["status"] == 200 and r2["events"][-1] == "[DONE]"
        ps = c.p[0].generations()
        assert ps[1].has_handle and not ps[2].has_handle
        # The retry pair uses its own request id on both legs.
        assert ps[2].headers["X-Request-Id"] == c.d[0].generations()[1].headers["X-Request-Id"]
        # P answered 5xx because of the handle: it is not taken out of rotation.
        assert c.router.ctx.prefill.backends[0].healthy
        m = await c.metrics()
        assert 'bidirkv_router_reuse_total{outcome="dropped"} 1.0' in m
        assert 'bidirkv_router_retries_total{reason="prefill_reuse_failed"} 1.0' in m
        # Turn 2 stored a fresh handle, so turn 3 reuses again.
        c.p[0].behaviour.fail_with_handle = None
        await c.chat(U1 + [r1["message"], r2["message"]], conversation_id="a")
        assert c.p[0].generations()[3].has_handle


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("how", ["status", "close"])
async def test_decode_failure_before_first_byte_retries_on_the_other_decode(stream, how):
    async with Cluster(decode=2) as c:
        if how == "status":
            c.d[0].behaviour.fail_next, c.d[0].behaviour.status_next = 1, 503
        else:
            c.d[0].behaviour.close_before_reply = True
        c.router.ctx.decode.backends[1].outstanding += 1  # so that d0 is picked first
        r = await c.chat(U1, stream, conversation_id="a")
        c.router.ctx.decode.backends[1].outstanding -= 1
        assert r["status"] == 200, r
        assert r["text"] == "Hello from the fake."
        assert len(c.d[0].generations()) == 1 and len(c.d[1].generations()) == 1
        # A fresh prefill leg for the retry: P's first blocks may have been read already.
        ps = c.p[0].generations()
        assert len(ps) == 2 and ps[1].headers["X-Request-Id"].endswith("-retry1")
        assert c.d[1].generations()[0].headers["X-Request-Id"] == ps[1].headers["X-Request-Id"]
        assert not c.router.ctx.decode.backends[0].healthy
        assert len(c.router.ctx.store) == 1
        assert next(iter(c.router.ctx.store)).decode_url == c.d[1].url


async def test_decode_failing_twice_is_a_502():
    async with Cluster(decode=2) as c:
        for d in c.d:
            d.behaviour.status = 500
        r = await c.chat(U1, stream=True)
        assert r["status"] == 502
        assert r["error"]["error"]["type"] == "upstream_error"


@pytest.mark.parametrize("mode", ["break", "stall"])
async def test_mid_stream_failure_ends_with_error_event_and_done(mode):
    async with Cluster(config={"timeouts": {"decodeSeconds": 0.5}}) as c:
        if mode == "break":
            c.d[0].behaviour.break_after = 3
        else:
            c.d[0].behaviour.stall_after = 3
        r = await c.chat(U1, stream=True, conversation_id="a")
        assert r["status"] == 200
        events = r["events"]
        assert events[-1] == "[DONE]"
        assert "error" in events[-2] and events[-2]["error"]["type"] == "upstream_error"
        assert events[1]["choices"][0]["delta"]["content"] == "Hello"
        assert len(c.router.ctx.store) == 0
        assert 'outcome="stream_error",route="chat"} 1.0' in await c.metrics()


async def test_no_healthy_backends_is_503_with_retry_after():
    # Without the prefill-only fallback (test_router_degraded.py has it on).
    async with Cluster(config={"healthCheckIntervalSeconds": 3,
                               "prefillOnlyFallback": False}) as c:
        c.d[0].behaviour.health_status = 503
        await c.router.health.check_health()
        r = await c.chat(U1)
        assert r["status"] == 503 and r["headers"]["Retry-After"] == "3"
        assert "decode" in r["error"]["error"]["message"]
        async with c.session.get(c.url + "/ready") as resp:
            ready = await resp.json()
            assert resp.status == 503 and ready["mode"] == "unavailable"
            assert "prefillOnlyFallback is off" in ready["reason"]
        c.d[0].behaviour.health_status = 200
        c.p[0].behaviour.health_status = 500
        await c.router.health.check_health()
        r = await c.chat(U1)
        assert r["status"] == 503 and "prefill" in r["error"]["error"]["message"]
        c.p[0].behaviour.health_status = 200
        await c.router.health.check_health()
        assert (await c.chat(U1))["status"] == 200
        assert len(c.p[0].generations()) == 1  # nothing was sent while unavailable


async def test_failing_backend_is_taken_out_until_a_good_health_check():
    async with Cluster(prefill=2, config={"healthCheckIntervalSeconds": 0.2}) as c:
        c.p[0].behaviour.close_before_reply = True  # connection drops on every request
        c.router.ctx.prefill.backends[1].outstanding += 1  # so that p0 is tried first
        assert (await c.chat(U1))["status"] == 200  # retried on p1
        c.router.ctx.prefill.backends[1].outstanding -= 1
        assert not c.router.ctx.prefill.backends[0].healthy
        for _ in range(3):
            assert (await c.chat(U1))["status"] == 200
        # Out of rotation: p0 saw only the first request (twice when the first try was
        # on a kept-alive connection: that one is retried on a new connection first).
        stale = 'retries_total{reason="prefill_stale_connection"} 1.0' in await c.metrics()
        assert len(c.p[0].generations()) == 1 + stale
        c.p[0].behaviour.close_before_reply = False
        for _ in range(100):
            if c.router.ctx.prefill.backends[0].healthy:
                break
            await asyncio.sleep(0.02)
        assert c.router.ctx.prefill.backends[0].healthy  # /health answered: back in
        assert 'retries_total{reason="prefill_failed"} 1.0' in await c.metrics()


async def test_decode_turning_unhealthy_drops_its_handles():
    async with Cluster() as c:
        await c.chat(U1, conversation_id="a")
        assert len(c.router.ctx.store) == 1
        c.d[0].behaviour.health_status = 500
        await c.router.health.check_health()
        assert len(c.router.ctx.store) == 0
        assert 'reason="replica_unhealthy"} 1.0' in await c.metrics()


async def test_engine_4xx_is_returned_as_is():
    async with Cluster() as c:
        c.p[0].behaviour.status = 400
        r = await c.chat(U1)
        assert r["status"] == 400 and r["error"]["error"]["message"] == "injected"
        assert c.router.ctx.prefill.backends[0].healthy


async def test_prefill_timeout_is_504_and_cancels_the_leg():
    async with Cluster(prefill=1, config={"timeouts": {"prefillSeconds": 0.3}}) as c:
        c.p[0].behaviour.hang = True
        r = await c.chat(U1)
        assert r["status"] == 504 and r["error"]["error"]["type"] == "upstream_timeout"
        await asyncio.wait_for(c.p[0].cancelled_event.wait(), 5)


async def test_client_disconnect_mid_stream_cancels_decode():
    async with Cluster() as c:
        c.d[0].behaviour.chunk_delay = 0.1
        c.d[0].behaviour.reply = ["x"] * 100
        body = json.dumps({"model": "m", "messages": U1, "stream": True}).encode()
        async with aiohttp.ClientSession() as s:
            resp = await s.post(c.url + "/v1/chat/completions", data=body,
                                headers={"Content-Type": "application/json"})
            assert resp.status == 200
            await resp.content.readline()
            resp.close()  # the client goes away mid-stream
        await asyncio.wait_for(c.d[0].cancelled_event.wait(), 5)
        for _ in range(50):
            if c.router.ctx.decode.backends[0].outstanding == 0:
                break
            await asyncio.sleep(0.02)
        assert c.router.ctx.decode.backends[0].outstanding == 0
        assert 'outcome="cancelled",route="chat"} 1.0' in await c.metrics()


async def test_client_disconnect_during_prefill_cancels_prefill():
    async with Cluster() as c:
        c.p[0].behaviour.hang = True
        body = {"model": "m", "messages": U1}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as s:
            with pytest.raises(asyncio.TimeoutError):
                await s.post(c.url + "/v1/chat/completions", json=body)
        await asyncio.wait_for(c.p[0].cancelled_event.wait(), 5)
        assert c.d[0].generations() == []


async def test_reserved_handle_is_released_when_prefill_never_ran():
    async with Cluster(prefill=1) as c:
        r1 = await c.chat(U1, conversation_id="a")
        c.p[0].behaviour.health_status = 500
        await c.router.health.check_health()
        assert (await c.chat(U1 + [r1["message"]], conversation_id="a"))["status"] == 503
        c.p[0].behaviour.health_status = 200
        await c.router.health.check_health()
        await c.chat(U1 + [r1["message"]], conversation_id="a")
        assert c.p[0].generations()[1].has_handle


async def test_stream_without_done_gets_one_appended():
    async with Cluster() as c:
        c.d[0].behaviour.no_params = True
        r = await c.chat(U1, stream=True)
        assert sse_events(r["raw"])[-1] == "[DONE]"
        assert len(c.router.ctx.store) == 0  # no params: nothing to store


async def test_single_decode_failing_is_502_and_timeout_is_504():
    async with Cluster(config={"timeouts": {"decodeSeconds": 0.3}}) as c:
        c.d[0].behaviour.fail_next = 1
        r = await c.chat(U1)
        assert r["status"] == 502  # not "no healthy decode": say what happened
        c.router.health.set_health(c.router.ctx.decode.backends[0], True, "test")
        c.d[0].behaviour.hang = True
        r = await c.chat(U1, stream=True)
        assert r["status"] == 504 and r["error"]["error"]["type"] == "upstream_timeout"


async def test_cancel_during_prefill_with_handle_discards_it():
    async with Cluster() as c:
        r1 = await c.chat(U1, conversation_id="a")
        c.p[0].behaviour.hang = True
        body = {"model": "m", "messages": U1 + [r1["message"]], "conversation_id": "a"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as s:
            with pytest.raises(asyncio.TimeoutError):
                await s.post(c.url + "/v1/chat/completions", json=body)
        await asyncio.wait_for(c.p[0].cancelled_event.wait(), 5)
        assert c.p[0].generations()[1].has_handle
        # P may have read D's blocks before the cancel: the handle is not handed out again.
        assert len(c.router.ctx.store) == 0


async def test_a_decode_that_never_sends_a_byte_loses_the_turn_to_another():
    async with Cluster(decode=2, config={"timeouts": {"decodeFirstByteSeconds": 0.3}}) as c:
        c.d[0].behaviour.hang = True  # takes the connection, never answers
        for i in range(2):
            r = await c.chat([{"role": "user", "content": f"hi {i}"}], stream=True)
            assert r["status"] == 200 and r["text"] == "Hello from the fake."
        assert c.d[0].generations(), "no turn went to the silent replica first"
        assert len(c.d[1].generations()) == 2


@pytest.mark.parametrize("how", ["head", "nothing"])
async def test_a_first_byte_timeout_is_a_timeout_on_both_decodes(tmp_path, caplog, how):
    """Each decode sends its head and no event (or nothing at all) within
    decodeFirstByteSeconds: each leg is a timeout (its span, its metric), the turn is
    retried once elsewhere, the client gets a 504, and neither replica is taken out."""
    spans = tmp_path / "s.jsonl"
    async with Cluster(decode=2, config={"timeouts": {"decodeFirstByteSeconds": 0.3},
                                         "tracing": {"file": str(spans)}}) as c:
        for d in c.d:
            if how == "head":
                d.behaviour.stall_after = 0  # the head goes out as the stream is prepared
            else:
                d.behaviour.hang = True
        r = await c.chat(U1, stream=True)
        assert r["status"] == 504, r
        rid = c.p[0].generations()[0].headers["X-Request-Id"]
        error = r["error"]["error"]
        assert (error["message"], error["type"]) == (
            f"decode engine timed out (request {rid})", "upstream_timeout")
        assert [len(d.generations()) for d in c.d] == [1, 1]
        assert all(b.healthy for b in c.router.ctx.decode.backends)
        for d in c.d:
            await asyncio.wait_for(d.cancelled_event.wait(), 5)  # its connection closed
        m = await c.metrics()
        assert 'retries_total{reason="decode_before_first_byte"} 1.0' in m
        assert 'leg_duration_seconds_count{leg="decode",result="error"} 2.0' in m
        assert 'outcome="timeout",route="chat"} 1.0' in m
        assert len(c.router.ctx.store) == 0
    assert "decode failed before first byte (timed out)" in caplog.text
    assert "decode failed (timed out)" in caplog.text
    legs = [s for s in read_spans(spans) if s["name"] == "decode"]
    assert [s["attributes"]["bidirkv.leg.result"] for s in legs] == ["timeout", "timeout"]
    # The head arrived (its status is the span's) or nothing did.
    status = 200 if how == "head" else None
    assert [s["attributes"].get("http.response.status_code") for s in legs] == [status] * 2
