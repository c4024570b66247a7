"""The legs' HTTP/1.1 client (bidirkv/router/engine/http.py, connection.py)
against real servers on 127.0.0.1: aiohttp's server, and a raw asyncio server that
answers with exact bytes."""

import asyncio
import contextlib
from types import SimpleNamespace

import pytest
from aiohttp import web

from bidirkv.router.engine import http as enginehttp
from bidirkv.router.engine.connection import (
    HEAD_LIMIT,
    HIGH_WATER,
    LINE_LIMIT,
    ConnectError,
    Connection,
    Disconnected,
    ProtocolError,
)
from bidirkv.router.engine.failures import classify, stale_connection
from bidirkv.router.engine.http import EngineHTTP

pytestmark = pytest.mark.timeout(30)

T = SimpleNamespace(sock_connect=5.0, total=None, sock_read=None)
H = {"Content-Type": "application/json", "X-Request-Id": "rid-1"}


@contextlib.asynccontextmanager
async def aiohttp_engine(handler):
    app = web.Application()
    app.router.add_post("/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def raw_engine(*replies):
    """Answers the n-th request on a connection with replies[n] (bytes, or a coroutine
    function taking the writer); past the last one it closes the connection."""
    seen = []

    async def serve(reader, writer):
        try:
            for reply in replies:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                seen.append((head, await reader.readexactly(length)))
                if callable(reply):
                    await reply(writer)
                else:
                    writer.write(reply)
                    await writer.drain()
            await reader.read(1)  # the next request, if any, is not answered
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.close()


async def echo(request):
    return web.Response(body=await request.read(), headers={"X-Peer": str(
        request.transport.get_extra_info("peername")[1])})


async def settle(client, open_connections):
    for _ in range(100):
        if client.open_connections == open_connections:
            return
        await asyncio.sleep(0.01)
    assert client.open_connections == open_connections


async def test_a_kept_alive_connection_carries_the_second_request():
    async with aiohttp_engine(echo) as url:
        client = EngineHTTP()
        async with await client.post(url, "/v1/x", b'{"a": 1}', H, T) as r1:
            assert r1.status == 200 and await r1.read() == b'{"a": 1}' and not r1.reused
        async with await client.post(url, "/v1/x", b"two", H, T) as r2:
            assert r2.reused and await r2.read() == b"two"
        assert client.open_connections == 1
        client.close()
        await settle(client, 0)


async def test_content_length_chunked_and_close_delimited_bodies():
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n")
    length = b"HTTP/1.1 201 Created\r\nContent-Length: 3\r\n\r\nabc"

    async def until_close(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nto the end")
        writer.close()

    async with raw_engine(chunked, length, until_close) as (url, seen):
        client = EngineHTTP()
        r = await client.post(url, "/a", b"{}", H, T)
        assert r.status == 200 and await r.read() == b"hello world"
        r.close()
        r = await client.post(url, "/b", b"[]", H, T)
        assert r.reused and r.status == 201 and await r.read() == b"abc"
        r.close()
        r = await client.post(url, "/c", b"", H, T)
        assert r.reused and await r.read() == b"to the end"
        r.close()
        await settle(client, 0)  # read until close: not pooled
        assert [s[0].split(b" ")[1] for s in seen] == [b"/a", b"/b", b"/c"]
        assert b"host: 127.0.0.1:" in seen[0][0].lower() and seen[1][1] == b"[]"


async def test_a_head_over_the_bound_is_a_protocol_failure():
    big = b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * HEAD_LIMIT + b"\r\n\r\n"
    async with raw_engine(big) as (url, _):
        client = EngineHTTP()
        with pytest.raises(ProtocolError) as e:
            await client.post(url, "/", b"{}", H, T)
        assert classify(e.value)[0] == "protocol"
        await settle(client, 0)


@pytest.mark.parametrize("size", [b"1_0", b"+5", b"-5", b"0x5", b"", b"5 5"])
async def test_a_chunk_size_that_is_not_hex_digits_is_a_protocol_failure(size):
    reply = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + size
             + b"\r\nhello\r\n0\r\n\r\n")
    async with raw_engine(reply) as (url, _):
        client = EngineHTTP()
        with pytest.raises(ProtocolError):  # at the head or the body: one packet here
            async with await client.post(url, "/", b"{}", H, T) as resp:
                await resp.read()
        await settle(client, 0)


async def test_a_reused_connection_lost_before_the_head_is_stale_a_new_one_is_not():
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    async with raw_engine(ok) as (url, _):
        client = EngineHTTP()
        async with await client.post(url, "/", b"{}", H, T) as r:
            assert await r.read() == b"ok"
        with pytest.raises(Disconnected) as e:
            await client.post(url, "/", b"{}", H, T)  # the engine closes it unanswered
        assert e.value.reused and stale_connection(e.value)
    async with raw_engine() as (url, _):  # closes every connection unanswered
        with pytest.raises(Disconnected) as e:
            await client.post(url, "/", b"{}", H, T)
        assert not e.value.reused and not stale_connection(e.value)
        assert classify(e.value)[0] == "connect"


async def test_connect_refused_is_a_connect_failure_never_stale():
    async with raw_engine() as (url, _):
        pass  # closed: nothing listens on its port now
    with pytest.raises(ConnectError) as e:
        await EngineHTTP().post(url, "/", b"{}", H, T)
    assert classify(e.value) == ("connect", "ConnectionRefusedError")
    assert not stale_connection(e.value)


async def test_a_read_timeout_is_a_timeout_and_closes_the_connection():
    async def head_then_nothing(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await asyncio.sleep(30)

    async with raw_engine(head_then_nothing) as (url, _):
        client = EngineHTTP()
        r = await client.post(url, "/", b"{}", H, SimpleNamespace(
            sock_connect=5.0, total=None, sock_read=0.05))
        assert await r.readany() == b"abc"
        with pytest.raises(TimeoutError) as e:
            await r.readany()
        assert classify(e.value)[0] == "timeout"
        r.close()
        await settle(client, 0)


async def test_a_cancelled_read_closes_its_connection():
    async def one_event_then_wait(request):
        out = web.StreamResponse()
        await out.prepare(request)
        await out.write(b"data: 1\n\n")
        await asyncio.sleep(30)
        return out

    async with aiohttp_engine(one_event_then_wait) as url:
        client = EngineHTTP()
        r = await client.post(url, "/", b"{}", H, T)
        assert await r.readany() == b"data: 1\n\n"
        reading = asyncio.ensure_future(r.readany())
        await asyncio.sleep(0.05)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        r.close()
        await settle(client, 0)  # closed, not pooled half-read
        r = await client.post(url, "/", b"{}", H, T)
        assert not r.reused
        r.close()
        await settle(client, 0)


async def test_a_header_with_cr_or_lf_is_refused_before_anything_is_sent():
    client = EngineHTTP()
    for bad in ({"Authorization": "Bearer x\r\nX-Evil: 1"}, {"X-A\nB": "v"}):
        with pytest.raises(ValueError, match="CR or LF"):
            await client.post("http://127.0.0.1:9", "/", b"{}", {**H, **bad}, T)
    assert client.open_connections == 0


async def test_reading_pauses_while_the_unread_body_is_over_the_high_water_mark():
    size = 8 * HIGH_WATER

    async def big(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        writer.write(b"x" * size)
        await writer.drain()

    async with raw_engine(big) as (url, _):
        client = EngineHTTP()
        r = await client.post(url, "/", b"{}", H, T)
        conn = r._conn
        for _ in range(100):
            if conn.paused:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert conn.paused and HIGH_WATER < conn.buffered < size
        body = await r.read()
        assert len(body) == size and not conn.paused
        r.close()
        assert client.open_connections == 1  # read whole: pooled
        client.close()


async def test_connection_close_is_not_pooled_and_idle_ones_are_closed(monkeypatch):
    monkeypatch.setattr(enginehttp, "KEEPALIVE_S", 0.05)
    close = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
    async with raw_engine(close) as (url, _), aiohttp_engine(echo) as kept:
        client = EngineHTTP()
        async with await client.post(url, "/", b"{}", H, T) as r:
            assert await r.read() == b"ok"
        await settle(client, 0)
        async with await client.post(kept, "/", b"{}", H, T) as r:
            assert await r.read() == b"{}"
        assert client.open_connections == 1  # pooled, then closed once idle too long
        await settle(client, 0)


class _Transport(asyncio.Transport):
    """Where a connection under test writes: nothing is sent, an abort is counted."""

    def __init__(self):
        super().__init__()
        self.aborted = False

    def write(self, data):
        pass

    def abort(self):
        self.aborted = True


def _answer_in(pieces):
    """The body a connection reads from `pieces` (one data_received each), and whether
    it may carry another request then."""
    conn = Connection(asyncio.get_running_loop(), [], lambda c: None)
    conn.connection_made(_Transport())
    conn.send(b"POST / HTTP/1.1\r\n\r\n", None, None)
    for piece in pieces:
        conn.data_received(piece)
    assert conn.error is None, conn.error
    return conn.take(), conn.reusable()


async def test_a_chunked_answer_reads_the_same_however_its_bytes_are_split():
    answer = (b"HTTP/1.1 100 Continue\r\n\r\n"
              b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
              b"5;ext=1\r\nhello\r\nB \r\n world, and\r\n1\r\n!\r\n"
              b"0\r\nX-Trailer: t\r\n\r\n")
    body = b"hello world, and!"
    assert _answer_in([answer]) == (body, True)
    assert _answer_in([answer[i:i + 1] for i in range(len(answer))]) == (body, True)
    for cut in range(1, len(answer)):
        assert _answer_in([answer[:cut], answer[cut:]]) == (body, True), cut
    # Bytes after the answer: read, but the connection is not used again.
    assert _answer_in([answer + b"HTTP/1.1 200 OK\r\n"]) == (body, False)


@pytest.mark.parametrize("framing", [b"5\r\nhelloXY0\r\n\r\n",
                                     b"5\r\nhello\r\n" + b"1" * (LINE_LIMIT + 1)])
async def test_a_chunk_without_its_crlf_or_an_endless_size_line_is_a_protocol_failure(
        framing):
    conn = Connection(asyncio.get_running_loop(), [], lambda c: None)
    conn.connection_made(_Transport())
    conn.send(b"POST / HTTP/1.1\r\n\r\n", None, None)
    conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + framing)
    assert isinstance(conn.error, ProtocolError) and conn.transport.aborted
    assert conn.take() == b"hello" and not conn.reusable()


async def test_bytes_that_keep_coming_within_the_read_timeout_never_time_out():
    async def trickle(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n")
        for _ in range(20):  # 20 x 0.05 s: twice the read timeout, each gap well inside
            await asyncio.sleep(0.05)
            writer.write(b"x")
            await writer.drain()

    async with raw_engine(trickle) as (url, _):
        client = EngineHTTP()
        async with await client.post(url, "/", b"{}", H, SimpleNamespace(
                sock_connect=5.0, total=None, sock_read=0.5)) as r:
            assert await r.read() == b"x" * 20
        assert client.open_connections == 1  # read whole: pooled
        client.close()


async def test_the_total_timeout_ends_an_answer_whose_bytes_keep_coming():
    async def endless(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        for _ in range(100):
            await asyncio.sleep(0.02)
            writer.write(b"x")
            await writer.drain()

    async with raw_engine(endless) as (url, _):
        client = EngineHTTP()
        r = await client.post(url, "/", b"{}", H, SimpleNamespace(
            sock_connect=5.0, total=0.3, sock_read=0.5))
        with pytest.raises(TimeoutError):
            await r.read()
        r.close()
        await settle(client, 0)


def _soon(s):
    return asyncio.get_running_loop().time() + s


@pytest.mark.parametrize("sends", [b"", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"])
async def test_no_first_body_bytes_by_the_first_byte_deadline_is_a_timeout(sends):
    """Nothing, or a head without body bytes, by `first_byte_at`: TimeoutError (a leg's
    timeout) at the head or at the first read, and the connection is closed."""
    async def then_nothing(writer):
        writer.write(sends)
        await asyncio.sleep(30)

    async with raw_engine(then_nothing) as (url, _):
        client = EngineHTTP()
        with pytest.raises(TimeoutError) as e:
            async with await client.post(url, "/", b"{}", H, T,
                                         first_byte_at=_soon(0.1)) as r:
                assert sends and r.status == 200  # the head came: the body read times out
                await r.readany()
        assert classify(e.value) == ("timeout", "timed out")
        await settle(client, 0)


@pytest.mark.parametrize("status", [200, 500])
async def test_the_first_byte_deadline_ends_at_a_200s_first_body_bytes(status):
    """A 200's body may go on past the deadline once its first bytes came; an error
    answer is read whole under it."""
    async def first_then_the_rest(writer):
        writer.write(b"HTTP/1.1 %d X\r\nContent-Length: 6\r\n\r\nabc" % status)
        await writer.drain()
        await asyncio.sleep(0.4)  # past the deadline
        writer.write(b"def")

    async with raw_engine(first_then_the_rest) as (url, _):
        client = EngineHTTP()
        r = await client.post(url, "/", b"{}", H, T, first_byte_at=_soon(0.1))
        if status == 200:
            assert await r.read() == b"abcdef"
        else:
            with pytest.raises(TimeoutError):
                await r.read()
        r.close()
        await settle(client, 1 if status == 200 else 0)
        client.close()


@pytest.mark.parametrize("first", [True, False])
async def test_a_connect_past_the_first_byte_deadline_is_a_timeout_not_a_connect_failure(
        first, monkeypatch):
    """Whichever of the connect timeout and the first-byte deadline comes first decides
    what a hung connect is: a first-byte timeout, or a connect failure."""
    loop = asyncio.get_running_loop()

    async def never(*args, **kwargs):
        await asyncio.sleep(30)

    monkeypatch.setattr(loop, "create_connection", never)
    client = EngineHTTP()
    with pytest.raises(TimeoutError if first else ConnectError) as e:
        await client.post("http://127.0.0.1:9", "/", b"{}", H, SimpleNamespace(
            sock_connect=0.3 if first else 0.05, total=None, sock_read=None),
            first_byte_at=_soon(0.05 if first else 0.3))
    assert classify(e.value)[0] == ("timeout" if first else "connect")


async def test_an_engine_that_speaks_before_the_request_fails_the_connect(monkeypatch):
    """Bytes before any request close the connection at once (it cannot carry one); a
    request must not then be written to it and wait for an answer that never comes."""
    loop = asyncio.get_running_loop()

    class Transport:
        aborted = False

        def abort(self):
            self.aborted = True

        def write(self, data):
            raise AssertionError("a request was written to a closed connection")

    async def speaks_first(factory, *args, **kwargs):
        transport, protocol = Transport(), factory()
        protocol.connection_made(transport)
        protocol.data_received(b"HTTP/1.1 200 OK\r\n\r\n")
        return transport, protocol

    monkeypatch.setattr(loop, "create_connection", speaks_first)
    client = EngineHTTP()
    with pytest.raises(ConnectError, match="closed as it connected") as e:
        await asyncio.wait_for(client.post("http://127.0.0.1:9", "/", b"{}", H, T), 10)
    assert classify(e.value)[0] == "connect"
    assert client.open_connections == 0
