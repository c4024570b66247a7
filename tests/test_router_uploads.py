"""Slow and silent uploads: a body is charged as it arrives, a body under the minimum
rate is cut off, and small requests keep a reserve of the in-flight bytes."""

import asyncio
import json
import time
import urllib.parse

import pytest
from fake_engine import Cluster

from bidirkv.router.datapath.admission import (
    MIN_UPLOAD_BYTES_PER_S,
    RESERVE_SHARE,
    UPLOAD_GRACE_S,
    body_room,
    upload_deadline,
)

pytestmark = pytest.mark.timeout(60)

U1 = [{"role": "user", "content": "hi"}]
MIB = 1024 * 1024


async def _open_upload(url: str, declared: int, first: bytes = b"") -> tuple:
    """A connection that sent its request head declaring `declared` body bytes, and
    `first` of them."""
    u = urllib.parse.urlsplit(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % declared
                 + first)
    await writer.drain()
    return reader, writer


def test_the_reserve_is_for_small_bodies_and_never_shuts_out_a_whole_body():
    assert body_room(32 * MIB, 4 * MIB, small=True) == 32 * MIB
    assert body_room(32 * MIB, 4 * MIB, small=False) == 32 * MIB - 32 * MIB // RESERVE_SHARE
    # The budget holds exactly one largest body: no reserve, that body still fits.
    assert body_room(4 * MIB, 4 * MIB, small=False) == 4 * MIB
    # The rate rule: after the grace, the time the bytes so far allow.
    assert upload_deadline(10.0, 0) == 10.0 + UPLOAD_GRACE_S
    assert upload_deadline(10.0, MIN_UPLOAD_BYTES_PER_S * 3) == 13.0 + UPLOAD_GRACE_S


async def test_connections_that_declare_big_bodies_and_send_nothing_do_not_shut_out_others():
    async with Cluster() as c:  # the defaults: 4 MiB bodies, 32 MiB in flight
        held = [await _open_upload(c.url, 4 * MIB) for _ in range(8)]
        try:
            await asyncio.sleep(0.2)  # every one of them admitted
            r = await c.chat(U1)
            assert r["status"] == 200, r
            # A large body still fits beside them: they hold nothing.
            big = [{"role": "user", "content": "x" * (3 * MIB)}]
            assert (await c.chat(big))["status"] == 200
        finally:
            for _, w in held:
                w.close()


async def test_a_body_under_the_minimum_rate_is_a_408_after_the_grace():
    async with Cluster() as c:  # bodyReadSeconds is 30 s: the rate rule ends it first
        reader, writer = await _open_upload(c.url, 4 * MIB, b"{")
        t = time.monotonic()
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 15)
            waited = time.monotonic() - t
            length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n")[0])
            body = await asyncio.wait_for(reader.readexactly(length), 5)
        finally:
            writer.close()
        assert b" 408 " in head.split(b"\r\n", 1)[0]
        assert b"connection: close" in head.lower()  # the rest is not waited for
        assert waited < 10  # the grace, not timeouts.bodyReadSeconds
        msg = json.loads(body)["error"]["message"]
        assert "arriving too slowly: 1 bytes after" in msg
        assert f"at least {MIN_UPLOAD_BYTES_PER_S} bytes/s" in msg


async def test_uploads_in_progress_cannot_take_the_small_bodies_reserve():
    # 256 KiB bodies, 512 KiB in flight: bodies in progress may hold 448 KiB.
    async with Cluster(config={"maxBodyBytes": 256 * 1024,
                               "maxInflightBodyBytes": 512 * 1024}) as c:
        part = b"x" * (150 * 1024)
        held = [await _open_upload(c.url, 256 * 1024, part) for _ in range(2)]
        try:
            await asyncio.sleep(0.3)  # both have been read up to what they sent
            big = [{"role": "user", "content": "x" * (180 * 1024)}]
            r = await c.chat(big)
            assert r["status"] == 429, r  # 300 KiB held + 180 KiB is past 448 KiB
            assert (await c.chat(U1))["status"] == 200  # the reserve
        finally:
            for _, w in held:
                w.close()


async def test_a_body_refused_part_way_gives_its_bytes_back_before_the_drain():
    # 256 KiB bodies, 512 KiB in flight: bodies in progress may hold 448 KiB.
    kib = 1024
    async with Cluster(config={"maxBodyBytes": 256 * kib,
                               "maxInflightBodyBytes": 512 * kib}) as c:
        intake = c.router.intake
        held = [await _open_upload(c.url, 256 * kib, b"x" * (100 * kib)) for _ in range(2)]
        third = await _open_upload(c.url, 200 * kib, b"x" * (40 * kib))
        try:
            await asyncio.sleep(0.3)
            assert intake.inflight_bytes == 240 * kib
            for _, w in held:  # the first two reach 400 KiB
                w.write(b"x" * (100 * kib))
                await w.drain()
            await asyncio.sleep(0.3)
            third[1].write(b"x" * (60 * kib))  # past 448 KiB: refused part-way
            await third[1].drain()
            status = await asyncio.wait_for(third[0].readline(), 5)
            assert b" 429 " in status
            # Its 40 KiB are back while the router still drains what it has not sent.
            assert intake.inflight_bytes == 400 * kib
        finally:
            for _, w in held + [third]:
                w.close()


async def test_a_body_refused_part_way_frees_its_slot_while_it_is_drained():
    async with Cluster(config={"maxInflightRequests": 1, "maxBodyBytes": 4096}) as c:
        u = urllib.parse.urlsplit(c.url)
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        try:  # no declared length: refused once 4 KiB have arrived, then still sending
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n"
                         + b"%x\r\n" % 5000 + b"x" * 5000 + b"\r\n")
            await writer.drain()
            assert b" 413 " in await asyncio.wait_for(reader.readline(), 5)
            assert c.router.intake.inflight == 0 and c.router.intake.inflight_bytes == 0
            assert (await c.chat(U1))["status"] == 200  # the one slot is free
        finally:
            writer.close()


async def test_a_body_here_whole_before_it_is_read_is_charged_and_bounded_as_one_chunk():
    # Chunked (no declared length) and sent in one write with its head: the router finds
    # it complete, reads it without a deadline, and still holds it to maxBodyBytes.
    async with Cluster(config={"maxBodyBytes": 4096}) as c:
        u = urllib.parse.urlsplit(c.url)
        for content, status in (("x" * 5000, b" 413 "), ("hi", b" 200 ")):
            body = json.dumps({"messages": [{"role": "user", "content": content}]}).encode()
            reader, writer = await asyncio.open_connection(u.hostname, u.port)
            try:
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Type: application/json\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n"
                             b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
                await writer.drain()
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            finally:
                writer.close()
            assert status in head.split(b"\r\n", 1)[0], head
        assert c.router.intake.inflight_bytes == 0
