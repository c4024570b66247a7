"""`/metrics` on a port of its own (`--metrics-port`): scrapers need no access to the port
clients send conversations to, and the client port no longer answers it."""

from __future__ import annotations

import aiohttp
import pytest
from fake_engine import FakeEngine

from bidirkv.router.config import load_config
from bidirkv.router.server.app import build_app, main, start_router

pytestmark = pytest.mark.timeout(60)


async def test_metrics_apart_from_the_client_port():
    engines = [FakeEngine("prefill"), FakeEngine("decode")]
    for e in engines:
        await e.start()
    cfg = load_config(None, {"prefill": [engines[0].url], "decode": [engines[1].url]})
    running = await start_router(build_app(cfg, metrics_apart=True), metrics_port=0)
    try:
        assert running.metrics_url and running.metrics_url != running.url
        async with aiohttp.ClientSession() as s:
            async with s.get(running.url + "/metrics") as r:
                assert r.status == 404
            async with s.get(running.url + "/health") as r:
                assert r.status == 200  # probes keep working on the client port
            async with s.post(running.url + "/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": "hi"}]}) as r:
                assert r.status == 200
            async with s.get(running.metrics_url + "/metrics") as r:
                text = await r.text()
                assert r.status == 200
                assert 'bidirkv_router_requests_total{' in text
            async with s.post(running.metrics_url + "/v1/chat/completions", json={}) as r:
                assert r.status in (404, 405)  # nothing but metrics there
    finally:
        await running.stop()
        for e in engines:
            await e.stop()


def test_metrics_port_must_differ_from_the_client_port(monkeypatch, capsys):
    monkeypatch.setenv("BIDIRKV_HANDLE_KEY", "k")
    assert main(["--port", "18000", "--metrics-port", "18000",
                 "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]) == 2
    assert "--metrics-port 18000 is --port too" in capsys.readouterr().err
    assert main(["--port", "18000", "--metrics-port", "70000",
                 "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]) == 2
    assert "--metrics-port 70000 is not a port" in capsys.readouterr().err
