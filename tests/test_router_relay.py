"""The answer to the client as it goes on the wire: what each send to the client holds."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import http_writer
from fake_engine import Cluster

pytestmark = pytest.mark.timeout(30)

U1 = [{"role": "user", "content": "hi"}]
# The router's streamed head says its charset; the fake engines' does not.
ROUTER_STREAM = b"text/event-stream; charset=utf-8"


@pytest.fixture
def sends(monkeypatch):
    """Every buffer aiohttp hands a transport in this process, one entry per send."""
    sent: list[bytes] = []
    write, writelines = http_writer.StreamWriter._write, http_writer.StreamWriter._writelines

    def _write(self, chunk):
        sent.append(bytes(chunk))
        write(self, chunk)

    def _writelines(self, chunks):
        chunks = list(chunks)
        sent.append(b"".join(chunks))
        writelines(self, chunks)

    monkeypatch.setattr(http_writer.StreamWriter, "_write", _write)
    monkeypatch.setattr(http_writer.StreamWriter, "_writelines", _writelines)
    return sent


async def test_a_streamed_answers_head_leaves_with_its_first_event(sends):
    async with Cluster() as c:
        sends.clear()
        r = await c.chat(U1, stream=True)
    assert r["status"] == 200 and r["events"][-1] == "[DONE]"
    ours = [s for s in sends if ROUTER_STREAM in s]
    assert len(ours) == 1
    head, _, rest = ours[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK")
    assert b"data: " in rest  # the first event, in the head's send


async def test_an_answer_d_has_ended_leaves_with_the_terminator_in_one_send(sends):
    async with Cluster() as c:
        c.d[0].behaviour.one_write = True
        sends.clear()
        r = await c.chat(U1, stream=True)
    assert r["status"] == 200 and r["message"]["content"] == "Hello from the fake."
    ours = [s for s in sends if ROUTER_STREAM in s]
    assert len(ours) == 1
    assert b"data: [DONE]\n\n\r\n0\r\n\r\n" in ours[0]  # the last event, then the end
    assert ours[0].endswith(b"0\r\n\r\n")


async def test_done_is_not_held_for_the_end_of_ds_answer():
    async with Cluster() as c:
        c.d[0].behaviour.stall_before_end = True
        async with c.session.post(c.url + "/v1/chat/completions", json={
                "model": "fake-model", "messages": U1, "stream": True}) as r:
            seen = b""
            while b"data: [DONE]" not in seen:
                seen += await asyncio.wait_for(r.content.readany(), 5)
