"""Bodies of long histories at the router's default limits: a 200k-token agent history
(~1 MB of JSON, a tool call every few messages) passes them whole; a 50 MB body gets its
413 before any of it is read, and small turns go on while it is drained."""

import asyncio
import json
import statistics
import sys
import time
import urllib.parse

import pytest
from fake_engine import Cluster

from bidirkv.bench.histories import containers, history
from bidirkv.knobs import RouterKnobs

pytestmark = pytest.mark.timeout(60)

U1 = [{"role": "user", "content": "hi"}]
DEFAULTS = RouterKnobs()


async def test_a_200k_token_agent_history_passes_the_default_limits():
    doc = {"model": "fake-model", **history(200_000, tool_every=3), "stream": True,
           "conversation_id": "agent"}
    raw = json.dumps(doc).encode()
    # What such a history is: ~1 MB of JSON and a few thousand objects and arrays (the
    # bounds' headroom is in docs/router.md#long-contexts).
    assert 900_000 < len(raw) < DEFAULTS.max_body_bytes
    assert 3000 < containers(doc) < DEFAULTS.max_json_containers
    cluster = Cluster()  # every limit at its default
    # Decode with room for the conversation (~15k blocks here), so its handle is kept.
    cluster.d[0].behaviour.num_blocks = 100_000
    async with cluster as c:
        cfg = c.router.ctx.cfg
        assert (cfg.max_body_bytes, cfg.max_json_containers) == (
            DEFAULTS.max_body_bytes, DEFAULTS.max_json_containers)
        for _ in range(2):  # the second takes the first's handle
            status = (await c.post("/v1/chat/completions", raw))[0]
            assert status == 200
        p = c.p[0].generations()
        assert len(p) == 2 and p[1].body["messages"] == doc["messages"]
        assert p[1].body["tools"] == doc["tools"] and p[1].has_handle


SENDER = """
import socket, sys
host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.create_connection((host, port))
s.sendall(b"POST /v1/chat/completions HTTP/1.1\\r\\nHost: x\\r\\n"
          b"Content-Type: application/json\\r\\nContent-Length: %d\\r\\n\\r\\n" % size)
print(s.recv(4096).split(b"\\r\\n")[0].decode(), flush=True)  # before any body byte
chunk, sent = b"x" * (1 << 20), 0
try:
    while sent < size:
        sent += s.send(chunk[:size - sent])
except OSError:
    pass
print(sent, flush=True)
"""


async def _small_turn(c: Cluster) -> tuple[int, float]:
    t = time.perf_counter()
    status = (await c.chat(U1))["status"]
    return status, time.perf_counter() - t


async def test_a_50_mb_body_is_a_413_before_it_is_read_and_small_turns_go_on_while_it_drains():
    size = 50_000_000
    async with Cluster() as c:  # the default maxBodyBytes: 4 MiB
        before = [await _small_turn(c) for _ in range(5)]
        u = urllib.parse.urlsplit(c.url)
        # Another process sends it, so this loop (the router's) only serves and drains.
        sender = await asyncio.create_subprocess_exec(
            sys.executable, "-c", SENDER, u.hostname, str(u.port), str(size),
            stdout=asyncio.subprocess.PIPE)
        try:
            status = await asyncio.wait_for(sender.stdout.readline(), 10)
            assert b" 413 " in status, status
            assert c.router.intake.inflight_bytes == 0  # charged nothing
            during = []
            deadline = time.monotonic() + 20
            while sender.returncode is None and time.monotonic() < deadline:
                during.append(await _small_turn(c))
                await asyncio.sleep(0)
            sent = int(await asyncio.wait_for(sender.stdout.readline(), 20))
        finally:
            if sender.returncode is None:
                sender.kill()
            await sender.wait()
    assert sent == size  # read to its end at the refusals' pace, not cut off
    # Served while the 50 MB arrived (it takes ~0.8 s at the refusals' shared pace), at
    # about the pace they had alone: it is never parsed, nor read faster than that pace.
    assert len(during) >= 3 and {s for s, _ in during} == {200}
    assert statistics.median(t for _, t in during) < 10 * statistics.median(
        t for _, t in before)
    assert len(c.p[0].generations()) == len(before) + len(during)
