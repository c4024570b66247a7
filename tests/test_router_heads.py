"""Silent request heads: connections that send a POST head and nothing more, reconnecting
after every answer, must not shut out complete requests from another address.

The router is `bidir-kv router` in a process of its own (tests/router_process.py) in front
of fake engines in this process; the silent heads come from 127.0.0.2, the small chats
from 127.0.0.1. A request takes an in-flight slot only once its body is here, and one
address holds at most maxReadingRequestsPerSource requests whose body is still arriving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time

import aiohttp
import pytest
from fake_engine import Cluster, FakeEngine
from router_process import RouterProcess

pytestmark = pytest.mark.timeout(120)

ATTACKER = "127.0.0.2"
HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
U1 = CHAT["messages"]


async def silent_heads(port: int, stop: asyncio.Event, tally: dict[str, int],
                       source: str = ATTACKER) -> None:
    """One connection at a time from `source`: a request head, no body, then whatever the
    router answers (or its close) and a new connection."""
    deadline = time.monotonic() + 60
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=(source, 0))
        except OSError:
            await asyncio.sleep(0.05)
            continue
        try:
            writer.write(HEAD)
            await writer.drain()
            waiting = asyncio.ensure_future(reader.readline())
            await asyncio.wait([waiting, asyncio.ensure_future(stop.wait())],
                               timeout=10, return_when=asyncio.FIRST_COMPLETED)
            if waiting.done() and not waiting.exception():
                status = waiting.result().split(b" ")[1:2]
                key = status[0].decode() if status else "closed"
                tally[key] = tally.get(key, 0) + 1
            waiting.cancel()
        except OSError:
            tally["closed"] = tally.get("closed", 0) + 1
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def small_chats(url: str, n: int, every: float, within: float) -> list[int]:
    """`n` small chats, one every `every` seconds: each one's status, 0 when it took
    longer than `within` (or failed)."""
    out: list[int] = []
    timeout = aiohttp.ClientTimeout(total=within)

    async def one() -> int:
        try:
            async with aiohttp.ClientSession(timeout=timeout) as s, s.post(
                    url + "/v1/chat/completions", json=CHAT) as r:
                await r.read()
                return r.status
        except (aiohttp.ClientError, TimeoutError):
            return 0

    tasks = []
    for _ in range(n):
        tasks.append(asyncio.ensure_future(one()))
        await asyncio.sleep(every)
    out = list(await asyncio.gather(*tasks))
    return out


@pytest.fixture
async def engines():
    p, d = FakeEngine("prefill", nixl_host="10.0.1.1"), FakeEngine("decode", nixl_host="10.0.2.2")
    await p.start()
    await d.start()
    try:
        yield p, d
    finally:
        await p.stop()
        await d.stop()


async def test_silent_heads_from_one_address_leave_the_slots_to_complete_requests(
        engines, tmp_path):
    p, d = engines
    slots, attackers = 16, 24
    cfg = tmp_path / "router.json"
    cfg.write_text(json.dumps({"prefill": [p.url], "decode": [d.url],
                               "maxInflightRequests": slots}))
    router = RouterProcess(cfg, None, tmp_path / "router.log",
                           env={"BIDIRKV_LOG_LEVEL": "WARNING"})
    stop, tally = asyncio.Event(), {}
    heads: list[asyncio.Future] = []
    try:
        await router.start()
        heads = [asyncio.ensure_future(silent_heads(router.port, stop, tally))
                 for _ in range(attackers)]
        await asyncio.sleep(0.5)  # every one of them has sent its head
        # 4 s: every silent head is answered (after the 2 s grace) and comes back once.
        statuses = await small_chats(router.url, 40, 0.1, within=2.0)
    finally:
        stop.set()
        await asyncio.gather(*heads, return_exceptions=True)
        router.stop(signal.SIGKILL)
    served = statuses.count(200) / len(statuses)
    assert served >= 0.9, (f"{statuses.count(200)} of {len(statuses)} small chats served "
                           f"within 2 s: {statuses}; silent heads answered {tally}")
    assert sum(tally.values()) >= attackers, tally  # they did come back


async def _held_heads(url: str, n: int, source: str) -> list[tuple]:
    port = int(url.rsplit(":", 1)[1])
    held = []
    for _ in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port,
                                                       local_addr=(source, 0))
        writer.write(HEAD)
        await writer.drain()
        held.append((reader, writer))
    return held


async def _trickled(url: str, source: str) -> bytes:
    """A small chat whose head goes first and its body 0.1 s later: the status line."""
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps(CHAT).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % len(body))
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(body)
        with contextlib.suppress(OSError):
            await writer.drain()
        return await asyncio.wait_for(reader.readline(), 5)
    finally:
        writer.close()


async def _whole(url: str, source: str) -> bytes:
    """A small chat sent in one write, head and body: the status line."""
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps(CHAT).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), 5)
    finally:
        writer.close()


async def test_one_address_past_its_share_of_bodies_arriving_is_refused_at_once():
    async with Cluster(config={"maxReadingRequestsPerSource": 2}) as c:
        held = await _held_heads(c.url, 2, ATTACKER)
        try:
            await asyncio.sleep(0.2)
            assert c.router.intake.readers.of(ATTACKER) == 2
            third = await _held_heads(c.url, 1, ATTACKER)
            held += third
            status = await asyncio.wait_for(third[0][0].readuntil(b"\r\n\r\n"), 5)
            assert b" 429 " in status.split(b"\r\n", 1)[0], status
            assert b"Retry-After: 1" in status  # a 429 at once, not the 408 after the grace
            rest = await asyncio.wait_for(third[0][0].read(), 5)
            assert b"maxReadingRequestsPerSource" in rest
            # Another address's body that arrives after its head is still read.
            assert b" 200 " in await _trickled(c.url, "127.0.0.1")
            assert (await c.chat(U1))["status"] == 200
        finally:
            for _, w in held:
                w.close()


async def test_bodies_arriving_are_bounded_in_all_and_a_body_here_whole_passes():
    async with Cluster(config={"maxReadingRequests": 3, "maxInflightRequests": 1}) as c:
        held = (await _held_heads(c.url, 2, ATTACKER)
                + await _held_heads(c.url, 1, "127.0.0.3"))
        try:
            await asyncio.sleep(0.2)
            assert c.router.intake.readers.total == 3
            # Silent heads hold no in-flight slot: the one slot is free for this chat.
            assert c.router.intake.inflight == 0
            assert b" 200 " in await _whole(c.url, "127.0.0.4")
            line = await _trickled(c.url, "127.0.0.4")
            assert b" 429 " in line, line
        finally:
            for _, w in held:
                w.close()
        for _ in range(100):  # bounded: until the router saw the closes
            if c.router.intake.readers.total == 0:
                break
            await asyncio.sleep(0.02)
        assert c.router.intake.readers.total == 0 and not c.router.intake.readers.by_source
