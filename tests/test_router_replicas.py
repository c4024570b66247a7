"""Router replicas as separate processes (as pods are) sharing one real Redis server.

Each replica is `bidir-kv router` in its own process, with the resource's handle key in
its environment, in front of the same fake engines (this process). A conversation's
lookup keys are derived from that key, so whichever replica a turn lands on finds the
handle an earlier turn stored through another, or through a replica since restarted.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest
from fake_engine import FakeEngine
from redis_server import started

from bidirkv.router.identity import LookupKeys

pytestmark = pytest.mark.timeout(120)
KEY = "0123456789abcdef" * 4
U1 = [{"role": "user", "content": "hi"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RouterProcess:
    """`bidir-kv router` as its own process; stopped by its pid."""

    def __init__(self, config: pathlib.Path, store_url: str, log: pathlib.Path,
                 key: str = KEY) -> None:
        self.config, self.store_url, self.log, self.key = config, store_url, log, key
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, timeout: float = 30.0) -> RouterProcess:
        exe = pathlib.Path(sys.executable).with_name("bidir-kv")
        env = {**os.environ, "BIDIRKV_HANDLE_KEY": self.key}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [str(exe), "router", "--config", str(self.config), "--host", "127.0.0.1",
                 "--port", str(self.port), "--handle-store", self.store_url],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, self.log.read_text()[-2000:]
                try:
                    async with s.get(self.url + "/ready") as r:
                        if r.status == 200:
                            return self
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError(f"router not ready in {timeout} s:\n{self.log.read_text()[-2000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    async def chat(self, messages, conversation_id: str | None = "conv"):
        body = {"model": "fake-model", "messages": messages, "stream": True}
        if conversation_id is not None:
            body["conversation_id"] = conversation_id
        text = ""
        async with aiohttp.ClientSession() as s, s.post(
                self.url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                return r.status, await r.text()
            async for raw in r.content:
                line = raw.strip()
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    for c in json.loads(line[5:]).get("choices") or []:
                        text += (c.get("delta") or {}).get("content") or ""
        return 200, {"role": "assistant", "content": text}

    async def delete(self, conversation_id: str) -> int:
        async with aiohttp.ClientSession() as s, s.delete(
                f"{self.url}/v1/conversations/{conversation_id}") as r:
            return r.status


@pytest.fixture
async def setup(tmp_path):
    redis = started()
    p, d = FakeEngine("prefill", nixl_host="10.0.1.1"), FakeEngine("decode", nixl_host="10.0.2.2")
    await p.start()
    await d.start()
    cfg = tmp_path / "router.json"
    cfg.write_text(json.dumps({"prefill": [p.url], "decode": [d.url]}))
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
