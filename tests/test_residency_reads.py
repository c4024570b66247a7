"""What a residency call costs the engine before it is known to come from a holder of the
handle key: no body read at all, and bodies read a few at a time within a deadline
(bidirkv/connector/endpoint.py, bidirkv/connector/bodyread.py). The route runs in
uvicorn, as vLLM serves it, and the callers are raw sockets that send a request's head
and as much of its body as the test says."""

import json
import socket
import threading
import time

import pytest

from bidirkv.connector.bodyread import ReadSlots
from bidirkv.connector.endpoint import ResidencyEndpoint
from bidirkv.proof import residency_headers
from bidirkv.wire import RESIDENCY_PATH, RESIDENCY_VERSION_FIELD, VERSION

pytestmark = pytest.mark.timeout(60)

KEY = b"k" * 32
SLOTS = 3
READ_S = 1.0
# A reply that comes at once comes well within this; one that waits for a body never does.
PROMPT_S = 5.0
BODY = json.dumps({"owner": "router-a", "leaseSeconds": 30, "release": ["r1"],
                   RESIDENCY_VERSION_FIELD: VERSION}).encode()


class Served:
    def __init__(self, port: int, plugin: ResidencyEndpoint) -> None:
        self.port, self.plugin = port, plugin
        self.target = f"127.0.0.1:{port}"
        self.calls: list[dict] = []
        self.sockets: list[socket.socket] = []

    def send(self, headers: dict[str, str], length: int, body: bytes = b"") -> socket.socket:
        """A call's head declaring `length` bytes of body, then `body` (maybe less)."""
        s = socket.create_connection(("127.0.0.1", self.port), timeout=PROMPT_S)
        self.sockets.append(s)
        head = "".join(f"{k}: {v}\r\n" for k, v in {
            "Host": self.target, "Content-Type": "application/json",
            "Content-Length": str(length), **headers}.items())
        s.sendall(f"POST {RESIDENCY_PATH} HTTP/1.1\r\n{head}\r\n".encode() + body)
        return s

    def reading(self) -> int:
        return self.plugin.slots.busy


def status(s: socket.socket, within_s: float = PROMPT_S) -> int | None:
    """The reply's status, or None when none came within `within_s`."""
    s.settimeout(within_s)
    try:
        data = s.recv(65536)
    except TimeoutError:
        return None
    return int(data.split()[1]) if data else None


@pytest.fixture
def served(monkeypatch):
    fastapi = pytest.importorskip("fastapi")
    uvicorn = pytest.importorskip("uvicorn")
    monkeypatch.setenv("BIDIRKV_HANDLE_KEY", KEY.decode())
    monkeypatch.delenv("BIDIRKV_HANDLE_KEY_PREVIOUS", raising=False)
    app = fastapi.FastAPI()
    plugin = ResidencyEndpoint(slots=ReadSlots(SLOTS), read_s=READ_S)
    plugin.attach_router(app)
    calls: list[dict] = []

    async def utility(name, body):
        calls.append(body)
        return {"enabled": True, "numBlocks": 64}

    app.state.bidirkv_engine = type("Client", (), {"engine_core": type(
        "Core", (), {"call_utility_async": staticmethod(utility)})()})()
    # log_config None: uvicorn's loggers reach pytest's (caplog).
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off",
                                           log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    s = Served(server.servers[0].sockets[0].getsockname()[1], plugin)
    s.calls = calls
    try:
        yield s
    finally:
        for sock in s.sockets:
            sock.close()
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.parametrize("length", [1000, 10**12])
def test_a_call_without_the_key_is_refused_before_its_body_is_read(served, length):
    """A fresh, well-formed header with a MAC of another key: once, the route read the
    body (up to 22 MB) before it could tell; the header now carries the body's length and
    digest, so the MAC is checked first. Nothing of the body is ever sent here."""
    headers = residency_headers(b"not the key", served.target, RESIDENCY_PATH, b"x" * 1000)
    assert status(served.send(headers, length)) == 401
    assert served.calls == []


def test_a_call_for_another_engine_is_refused_before_its_body_is_read(served):
    headers = residency_headers(KEY, "127.0.0.1:1", RESIDENCY_PATH, BODY)
    assert status(served.send(headers, len(BODY))) == 401


def test_the_body_must_be_the_length_signed(served):
    headers = residency_headers(KEY, served.target, RESIDENCY_PATH, BODY)
    assert status(served.send(headers, len(BODY) + 1, BODY + b" ")) == 400
    # The signed length, other bytes: read, then refused.
    other = BODY.replace(b"r1", b"r2")
    assert status(served.send(headers, len(other), other)) == 401
    assert served.calls == []
    assert status(served.send(headers, len(BODY), BODY)) == 200
    assert len(served.calls) == 1


def test_slow_bodies_are_read_a_few_at_once_and_within_a_deadline(served):
    """A replayed header (good for 60 s) sent many times, each body trickling in: once,
    every one of them was read at once, as long as they took. Now SLOTS are read at once,
    the next caller is answered 503 without waiting, and a body that has not arrived
    within the deadline is answered 408."""
    headers = residency_headers(KEY, served.target, RESIDENCY_PATH, BODY)
    slow = [served.send(headers, len(BODY), BODY[:10]) for _ in range(SLOTS)]
    deadline = time.monotonic() + 10
    while served.reading() < SLOTS and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.reading() == SLOTS
    one_more = served.send(headers, len(BODY), BODY[:10])
    assert status(one_more) == 503
    # The slow ones run out of time; their slots are free again.
    assert [status(s, READ_S + 10) for s in slow] == [408] * SLOTS
    assert served.reading() == 0 and served.calls == []
    assert status(served.send(headers, len(BODY), BODY)) == 200
    assert len(served.calls) == 1


def test_a_caller_that_leaves_mid_body_frees_its_slot_quietly(served, caplog):
    headers = residency_headers(KEY, served.target, RESIDENCY_PATH, BODY)
    leaving = served.send(headers, len(BODY), BODY[:10])
    deadline = time.monotonic() + 10
    while served.reading() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.reading() == 1
    leaving.close()
    while served.reading() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.reading() == 0
    assert "Exception in ASGI application" not in caplog.text
