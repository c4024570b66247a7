"""Config reloads while serving, and the `bidir-kv router` command line."""

import asyncio
import json
import os
import signal
import subprocess
import sys

import aiohttp
import pytest
from fake_engine import Cluster, FakeEngine, sse_events

from bidirkv.router.server.app import main

pytestmark = pytest.mark.timeout(30)

U1 = [{"role": "user", "content": "hi"}]


async def wait_for(predicate, seconds=5.0):
    for _ in range(int(seconds / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


async def test_reload_swaps_decodes_without_failing_a_stream_in_flight(tmp_path):
    def files(c):
        return {"prefill": [c.p[0].url], "decode": [c.d[0].url]}

    async with Cluster(decode=2, config_path=tmp_path / "router.json", file_config=files) as c:
        router = c.router
        assert [b.url for b in router.ctx.decode.backends] == [c.d[0].url]
        await c.chat(U1, conversation_id="old")  # a handle on d0
        c.d[0].behaviour.chunk_delay = 0.05
        c.d[0].behaviour.reply = [f" w{i}" for i in range(20)]
        in_flight = asyncio.create_task(c.chat(U1, stream=True, conversation_id="busy"))
        await wait_for(lambda: len(c.d[0].generations()) == 2)
        c.write_config({"prefill": [c.p[0].url], "decode": [c.d[1].url],
                        "maxConversations": 50})
        assert await wait_for(lambda: router.ctx.cfg.max_conversations == 50)
        assert not in_flight.done()
        r = await in_flight
        assert r["status"] == 200 and r["events"][-1] == "[DONE]"
        assert not any(isinstance(e, dict) and "error" in e for e in r["events"])
        assert r["text"] == "".join(f" w{i}" for i in range(20))
        # d0 left: its handles are gone, new traffic goes to d1.
        assert all(e.decode_url != c.d[0].url for e in router.ctx.store)
        await c.chat(U1, conversation_id="new")
        assert len(c.d[1].generations()) == 1
        assert 'config_reloads_total{result="applied"} 1.0' in await c.metrics()


async def test_bad_reload_keeps_the_running_config(tmp_path, caplog):
    def files(c):
        return {"prefill": [c.p[0].url], "decode": [c.d[0].url]}

    async with Cluster(config_path=tmp_path / "router.json", file_config=files) as c:
        c.write_config({"prefill": [c.p[0].url], "decode": [c.d[0].url],
                        "maxConversations": -5})
        reg = c.router.ctx.metrics.registry
        assert await wait_for(lambda: reg.get_sample_value(
            "bidirkv_router_config_reloads_total", {"result": "rejected"}) == 1)
        assert 'config_reloads_total{result="rejected"} 1.0' in await c.metrics()
        assert "maxConversations: value -5 not allowed" in caplog.text
        assert c.router.ctx.cfg.max_conversations == 100_000
        assert (await c.chat(U1))["status"] == 200


async def test_cli_flags_override_the_file(tmp_path):
    other = FakeEngine("decode")
    await other.start()
    try:
        def files(c):
            return {"prefill": [c.p[0].url], "decode": [other.url], "model": "from-file"}

        async with Cluster(config_path=tmp_path / "r.json", file_config=files) as c:
            assert c.router.ctx.cfg.decode == [other.url]
            assert c.router.ctx.cfg.model == "from-file"
        async with Cluster(config_path=tmp_path / "r2.json", file_config=files,
                           config={"model": "from-cli"}) as c:
            assert c.router.ctx.cfg.model == "from-cli"
    finally:
        await other.stop()


def test_main_rejects_bad_arguments_and_config(tmp_path, capsys):
    assert main(["--port", "1"]) == 2
    assert "no prefill URL" in capsys.readouterr().err
    assert main(["router", "--prefill", "nope", "--decode", "http://d:1", "--port", "1"]) == 2
    assert "'nope' is not a URL" in capsys.readouterr().err
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"safetyMarginSeconds": "ten"}))
    assert main(["--config", str(bad), "--prefill", "http://p:1", "--decode", "http://d:1",
                 "--port", "1"]) == 2
    assert "safetyMarginSeconds: value 'ten'" in capsys.readouterr().err
    assert main(["--prefill", "http://p:1"]) == 2  # --port is required


async def test_main_serves_as_a_process():
    p, d = FakeEngine("prefill"), FakeEngine("decode")
    await p.start()
    await d.start()
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from bidirkv.router.server.app import main; "
         "sys.exit(main(sys.argv[1:]))", "router", "--prefill", p.url, "--decode", d.url,
         "--port", "0", "--host", "127.0.0.1"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                                "BIDIRKV_HANDLE_KEY": "k"},
    )
    try:
        url = None
        loop = asyncio.get_running_loop()
        for _ in range(100):
            line = await loop.run_in_executor(None, proc.stderr.readline)
            if "router listening on" in line:
                url = line.rsplit(" ", 1)[-1].strip()
                break
        assert url
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions", json={
                    "model": "m", "messages": U1, "stream": True}) as r:
                assert r.status == 200 and sse_events(await r.read())[-1] == "[DONE]"
        proc.send_signal(signal.SIGTERM)
        assert await loop.run_in_executor(None, proc.wait, 10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await p.stop()
        await d.stop()
