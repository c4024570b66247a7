"""The HTTP surface: client errors as JSON 4xx, health/ready/metrics/models routes."""

import asyncio
import json

import pytest
from fake_engine import Cluster

pytestmark = pytest.mark.timeout(30)

U1 = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def cluster():
    async with Cluster(config={"maxBodyBytes": 4096, "maxJsonContainers": 1024}) as c:
        yield c


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/chat/completions", b"{oops", "not valid JSON"),
        ("/v1/chat/completions", b"", "not valid JSON"),
        ("/v1/chat/completions", b'"text"', "must be a JSON object"),
        ("/v1/chat/completions", {"model": "m"}, "messages: required"),
        ("/v1/chat/completions", {"messages": {"role": "user"}}, "messages: {'role': 'user'}"),
        ("/v1/chat/completions", {"messages": U1, "stream": 1}, "stream: 1"),
        ("/v1/chat/completions", {"messages": U1, "max_tokens": -3}, "max_tokens: -3"),
        ("/v1/completions", {"model": "m"}, "prompt: required"),
        ("/v1/completions", {"prompt": 5}, "prompt: 5"),
        # Hostile bodies: valid JSON the router cannot carry, refused before any engine.
        ("/v1/chat/completions",
         b'{"messages":[{"role":"user","content":"a\\ud800"}]}',
         "messages[0].content: contains a lone UTF-16 surrogate"),
        ("/v1/chat/completions", b'{"messages":' + b"[" * 100 + b"]" * 100 + b"}",
         "nested deeper than 64 levels"),
        ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}],"x":'
         + b"{\"a\":" * 200 + b"0" + b"}" * 200 + b"}", "nested deeper than 64 levels"),
        # Many tiny values: what a body costs on the loop is its objects, not its bytes.
        ("/v1/chat/completions", b'{"messages":[' + b",".join([b"[]"] * 1100) + b"]}",
         "more than 1024 JSON objects and arrays (maxJsonContainers)"),
    ],
)
async def test_bad_requests_get_a_400_naming_field_and_value(cluster, path, body, needle):
    status, raw, headers = await cluster.post(path, body)
    assert status == 400
    assert headers["Content-Type"].startswith("application/json")
    err = json.loads(raw)["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert cluster.p[0].generations() == []
    # The router is still fine.
    assert (await cluster.chat(U1))["status"] == 200


async def test_max_tokens_above_the_models_context_is_refused_before_any_engine(cluster):
    # The router learns max_model_len (4096 on the fake engines) from prefill's /v1/models.
    for _ in range(100):
        if cluster.router.ctx.max_model_len:
            break
        await asyncio.sleep(0.02)
    assert cluster.router.ctx.max_model_len == 4096
    for field in ("max_tokens", "max_completion_tokens"):
        status, raw, _ = await cluster.post("/v1/chat/completions",
                                            {"messages": U1, field: 10**12})
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == field
        assert err["message"] == (f"{field}: 1000000000000 is more than the model's context "
                                  "length (4096 tokens)")
    assert cluster.p[0].generations() == []
    status, _, _ = await cluster.post("/v1/chat/completions", {"messages": U1, "max_tokens": 4096})
    assert status == 200


async def test_body_over_the_limit_is_413(cluster):
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    status, raw, _ = await cluster.post("/v1/chat/completions", big)
    assert status == 413 and "maxBodyBytes" in json.loads(raw)["error"]["message"]

    async def chunks():
        for _ in range(10):
            yield b" " * 1000

    async with cluster.session.post(cluster.url + "/v1/chat/completions", data=chunks()) as r:
        assert r.status == 413
    assert cluster.p[0].generations() == []


async def test_a_client_that_sends_its_whole_body_first_still_reads_the_413(cluster):
    """httpx (the OpenAI SDK's client) reads the answer only once it has sent the body:
    the router answers at once, then reads and drops the rest instead of resetting the
    connection; the next request on the same client works."""
    import httpx

    big = b'{"messages":[{"role":"user","content":"' + b"x" * (4 << 20) + b'"}]}'
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(cluster.url + "/v1/chat/completions", content=big,
                              headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "maxBodyBytes" in r.json()["error"]["message"]
        r = await client.post(cluster.url + "/v1/chat/completions", json={"messages": U1})
        assert r.status_code == 200
    assert len(cluster.p[0].generations()) == 1


async def test_unknown_route_404_and_wrong_method_405(cluster):
    async with cluster.session.get(cluster.url + "/v2/nothing") as r:
        assert r.status == 404 and "no route" in (await r.json())["error"]["message"]
    async with cluster.session.get(cluster.url + "/v1/chat/completions") as r:
        assert r.status == 405
        body = await r.json()
        assert "POST" in body["error"]["message"] and r.headers["Allow"] == "POST"
    async with cluster.session.delete(cluster.url + "/health") as r:
        assert r.status == 405 and r.headers["Content-Type"].startswith("application/json")


async def test_health_ready_models_metrics(cluster):
    async with cluster.session.get(cluster.url + "/health") as r:
        assert r.status == 200
    async with cluster.session.get(cluster.url + "/ready") as r:
        assert r.status == 200 and (await r.json())["decode"] == {"healthy": 1, "total": 1}
    async with cluster.session.get(cluster.url + "/v1/models") as r:
        assert r.status == 200 and (await r.json())["data"][0]["id"] == "fake-model"
    await cluster.chat(U1, stream=True)
    async with cluster.session.get(cluster.url + "/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    for name in (
        'bidirkv_router_requests_total{outcome="ok",route="chat"} 1.0',
        "bidirkv_router_ttft_seconds_bucket",
        'bidirkv_router_leg_duration_seconds_count{leg="prefill",result="ok"} 1.0',
        'bidirkv_router_leg_duration_seconds_count{leg="decode",result="ok"} 1.0',
        "bidirkv_router_handles 1.0",
        f'bidirkv_router_backend_healthy{{role="decode",url="{cluster.d[0].url}"}} 1.0',
        'bidirkv_router_reuse_total{outcome="miss"} 1.0',
    ):
        assert name in text, name


async def test_models_with_no_healthy_decode_come_from_prefill(cluster):
    cluster.d[0].behaviour.health_status = 500
    await cluster.router.health.check_health()
    async with cluster.session.get(cluster.url + "/v1/models") as r:
        assert r.status == 200 and (await r.json())["data"][0]["id"] == "fake-model"


async def test_models_with_no_healthy_decode_and_no_fallback_is_503():
    async with Cluster(config={"prefillOnlyFallback": False}) as c:
        c.d[0].behaviour.health_status = 500
        await c.router.health.check_health()
        async with c.session.get(c.url + "/v1/models") as r:
            assert r.status == 503 and "Retry-After" in r.headers


async def test_two_routers_in_one_process_have_separate_metrics():
    async with Cluster() as a, Cluster() as b:
        await a.chat(U1)
        assert 'outcome="ok",route="chat"} 1.0' in await a.metrics()
        assert 'outcome="ok",route="chat"}' not in await b.metrics()


def test_a_client_request_id_is_kept_only_when_short_and_plain():
    from bidirkv.router.datapath.admission import request_id

    assert request_id("abc-123_x.y:z~") == "abc-123_x.y:z~"
    for bad in ("x" * 129, "has space", "quote\"", "é", "", None, "a\nb"):
        fresh = request_id(bad)
        assert fresh != bad and len(fresh) == 32


async def test_past_the_in_flight_limits_a_429_with_retry_after():
    async with Cluster(config={"maxInflightRequests": 1, "maxBodyBytes": 4096,
                               "maxInflightBodyBytes": 6000}) as c:
        c.d[0].behaviour.chunk_delay = 0.3  # the first request stays in flight
        first = asyncio.ensure_future(c.chat(U1, stream=True))
        for _ in range(100):  # bounded: until it reached decode
            if c.d[0].generations():
                break
            await asyncio.sleep(0.02)
        status, raw, headers = await c.post("/v1/chat/completions", {"messages": U1})
        assert status == 429 and headers["Retry-After"] == "1"
        assert "maxInflightRequests" in json.loads(raw)["error"]["message"]
        assert (await first)["status"] == 200
        assert (await c.chat(U1))["status"] == 200  # the slot is free again
    async with Cluster(config={"maxBodyBytes": 4096, "maxInflightBodyBytes": 6000}) as c:
        c.d[0].behaviour.chunk_delay = 0.3
        big = [{"role": "user", "content": "x" * 3000}]
        first = asyncio.ensure_future(c.chat(big, stream=True))
        for _ in range(100):
            if c.d[0].generations():
                break
            await asyncio.sleep(0.02)
        status, _, _ = await c.post("/v1/chat/completions", {"messages": big})
        assert status == 429  # 3 kB + 3 kB of bodies is over 6000 bytes
        assert (await first)["status"] == 200
        assert 'outcome="overloaded"' in await c.metrics()


async def test_a_body_that_never_arrives_is_a_408():
    async with Cluster(config={"timeouts": {"bodyReadSeconds": 0.3}}) as c:
        port = int(c.running.url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        assert b" 408 " in status_line


def test_a_body_limit_the_in_flight_bound_cannot_hold_is_refused():
    from bidirkv.router.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="maxInflightBodyBytes"):
        load_config(None, {"prefill": ["http://p:1"], "decode": ["http://d:1"],
                           "maxBodyBytes": 8192, "maxInflightBodyBytes": 4096})


async def test_a_client_trickling_its_request_head_is_disconnected():
    """Slowloris: headers that never end must not hold a socket (timeouts.
    idleConnectionSeconds, from the connection's start, data or not)."""
    import urllib.parse

    async with Cluster(config={"timeouts": {"idleConnectionSeconds": 0.5}}) as c:
        u = urllib.parse.urlsplit(c.url)
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        try:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            await writer.drain()
            for i in range(3):  # still trickling: data does not extend the deadline
                await asyncio.sleep(0.1)
                writer.write(b"X-Slow-%d: 1\r\n" % i)
                await writer.drain()
            assert await asyncio.wait_for(reader.read(), 15) == b""  # closed, no answer
        finally:
            writer.close()
        assert (await c.chat(U1))["status"] == 200  # everyone else is served


async def test_the_placement_header_is_shown_only_when_the_config_asks():
    from bidirkv.router.config import load_config

    base = {"prefill": ["http://p:1"], "decode": ["http://d:1"]}
    assert load_config(None, base).placement_header is False  # off by default
    for shown in (False, True):
        async with Cluster(config={"placementHeader": shown,
                                   "placement": {"policy": "cost"}}) as c:
            r = await c.chat(U1)
            assert r["status"] == 200
            assert ("X-Bidirkv-Placement" in r["headers"]) is shown


async def test_an_unhandled_error_logs_the_client_request_id_bounded_and_escaped(caplog):
    from bidirkv.router.datapath.admission import LOGGED_CHARS

    async with Cluster() as c:
        def broken(*args):
            raise RuntimeError("boom")

        c.router.intake.admit = broken
        rid = "x\tyz" * 2000  # 8 KB with control characters: not a kept id
        with caplog.at_level("ERROR", logger="bidirkv.router"):
            status, raw, _ = await c.post("/v1/chat/completions", {"messages": U1},
                                          headers={"X-Request-Id": rid})
        assert status == 500
        line = next(r for r in caplog.records if "unhandled error" in r.getMessage())
        text = line.getMessage()
        assert "\t" not in text and "(8000 characters)" in text
        assert len(text) < 3 * LOGGED_CHARS + 200
        with caplog.at_level("ERROR", logger="bidirkv.router"):
            await c.post("/v1/chat/completions", {"messages": U1},
                         headers={"X-Request-Id": "plain-id.1"})
        assert "rid=plain-id.1" in caplog.records[-1].getMessage()
