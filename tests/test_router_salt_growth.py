"""Distinct client salts do not grow the router: `bidir-kv router` in a process of its
own (tests/router_process.py) in front of fake engines, chats with a 1,000,000-character
`cache_salt` each from 127.0.0.2 and small chats from 127.0.0.1. The router kept every
distinct salt whole (an lru_cache argument): 60 of them grew it by ~60 MB, each with a
200. Now a salt is at most 128 characters (vLLM's own bound) and never kept."""

from __future__ import annotations

import asyncio
import json
import pathlib
import signal

import aiohttp
import pytest
from fake_engine import FakeEngine
from router_process import RouterProcess

pytestmark = pytest.mark.timeout(120)

ATTACKER = "127.0.0.2"
SALTS = 60


def rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def chat(session: aiohttp.ClientSession, url: str, **extra) -> tuple[int, str]:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **extra}
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        return r.status, await r.text()


async def test_distinct_large_salts_from_one_address_grow_nothing(tmp_path):
    p, d = FakeEngine("prefill"), FakeEngine("decode")
    await p.start()
    await d.start()
    cfg = tmp_path / "router.json"
    cfg.write_text(json.dumps({"prefill": [p.url], "decode": [d.url]}))
    router = RouterProcess(cfg, None, tmp_path / "router.log",
                           env={"BIDIRKV_LOG_LEVEL": "WARNING"})
    try:
        await router.start()
        attacker = aiohttp.TCPConnector(local_addr=(ATTACKER, 0))
        async with aiohttp.ClientSession(connector=attacker) as bad, \
                aiohttp.ClientSession() as good:
            assert (await chat(good, router.url))[0] == 200
            before = rss_mb(router.proc.pid)
            answers = []
            for i in range(SALTS):
                answers.append(await chat(bad, router.url,
                                          cache_salt=f"{i:03d}" + "s" * 999_997))
                if i % 10 == 0:  # the other address is served meanwhile
                    assert (await chat(good, router.url))[0] == 200
            await asyncio.sleep(0.2)
            grown = rss_mb(router.proc.pid) - before
        assert {s for s, _ in answers} == {400}, answers[0]
        assert "cache_salt" in answers[0][1] and "at most 128" in answers[0][1]
        assert grown < SALTS / 3, f"{SALTS} distinct 1 MB salts grew the router {grown:.0f} MB"
    finally:
        router.stop(signal.SIGKILL)
        await p.stop()
        await d.stop()
