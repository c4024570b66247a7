"""The router's residency client against the engines' check of it: every call is signed
with the handle key, and a router holding another key (or none) is refused and keeps its
releases. The engine side is bidirkv/connector/endpoint.py's `answer`, served by aiohttp
in place of vLLM's FastAPI app (tests/test_connector_endpoint.py covers that mounting)."""

import pathlib
import socket
import threading
import urllib.request

import aiohttp
import pytest
from aiohttp import web

from bidirkv.connector.endpoint import Credentials, answer
from bidirkv.connector.identity import Here
from bidirkv.proof import RESIDENCY_AUTH_HEADER, RESIDENCY_TARGET_HEADER
from bidirkv.router.pool.residency import ResidencyClient
from bidirkv.wire import RESIDENCY_PATH

pytestmark = pytest.mark.timeout(30)

KEY = b"k" * 32


class Decode:
    def __init__(self) -> None:
        self.done: list[dict] = []
        self.statuses: list[int] = []
        self.url = ""

    async def utility(self, body: dict) -> dict:
        self.done.append(body)
        return {"enabled": True, "numBlocks": 64, "releasedBlocks": len(body["release"])}

    async def route(self, request: web.Request) -> web.Response:
        creds = Credentials(request.headers.get(RESIDENCY_AUTH_HEADER),
                            request.headers.get(RESIDENCY_TARGET_HEADER),
                            Here.of(request.transport.get_extra_info("sockname"),
                                    socket.gethostname()))
        status, out = await answer(creds, await request.read(), (KEY,), self.utility)
        self.statuses.append(status)
        return web.json_response(out, status=status)


@pytest.fixture
async def decode():
    d = Decode()
    app = web.Application()
    app.router.add_post(RESIDENCY_PATH, d.route)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    d.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    yield d
    await runner.cleanup()


async def call(client: ResidencyClient, url: str) -> bool:
    async with aiohttp.ClientSession() as session:
        return await client.call(session, url)


async def test_a_router_with_the_key_renews_and_releases(decode):
    client = ResidencyClient(30, aiohttp.ClientTimeout(total=5), handle_key=KEY)
    client.release_ids(decode.url, ["r1", "r2"])
    assert await call(client, decode.url)
    assert decode.statuses == [200]
    assert decode.done == [{"owner": client.owner, "leaseSeconds": 30,
                            "release": ["r1", "r2"]}]
    assert client.capacity(decode.url) == 64


@pytest.mark.parametrize("key", [None, b"another key, another resource"])
async def test_a_router_without_the_key_is_refused_and_keeps_its_releases(decode, key):
    seen = []
    client = ResidencyClient(30, aiohttp.ClientTimeout(total=5), handle_key=key,
                             on_result=lambda url, result, n: seen.append((result, n)))
    client.release_ids(decode.url, ["r1"])
    assert not await call(client, decode.url)
    assert decode.statuses == [401] and decode.done == []
    assert seen == [("refused", 1)]
    assert client.replicas[decode.url].pending == ["r1"]  # sent again next round


@pytest.fixture
def checking_server():
    """A stand-in engine route that checks the signature as decode does (sync callers):
    for this engine, as the connection reaches it."""
    import http.server
    import json

    from bidirkv.proof import residency_auth_problem

    problems: list = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            target = self.headers.get(RESIDENCY_TARGET_HEADER)
            problem = residency_auth_problem(self.headers.get(RESIDENCY_AUTH_HEADER),
                                             target, (KEY,), self.path, raw) or Here.of(
                self.connection.getsockname(), socket.gethostname()).target_problem(target)
            problems.append(problem)
            out = json.dumps({"draining": True, "refusals": {}} if problem is None
                             else {}).encode()
            self.send_response(200 if problem is None else 401)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", problems
    finally:
        server.shutdown()
        server.server_close()


def test_the_launchers_drain_call_is_signed_with_the_engines_key(monkeypatch, checking_server):
    """`bidir-kv serve` marks its engine draining on the same route: with the key of
    the engine's environment, or the drain would never see the engine's report; a
    refusal is said with its reason."""
    from bidirkv.connector.supervise import ask_drain

    url, problems = checking_server
    monkeypatch.setenv("BIDIRKV_HANDLE_KEY", KEY.decode())
    report, error = ask_drain(url)
    assert report["draining"] is True and error == "" and problems == [None]
    monkeypatch.setenv("BIDIRKV_HANDLE_KEY", "another key")
    report, error = ask_drain(url)
    assert report is None and "does not match" in problems[-1]
    assert error.startswith("HTTP 401: ")


def test_the_drain_names_its_own_engine(monkeypatch):
    """Its host name (the pod's) and the server's port: a drain seen on the way fits no
    other engine of the resource, whichever address it is sent to."""
    from bidirkv.connector.supervise import drain_target

    assert drain_target("http://127.0.0.1:8000", "decode-0") == "decode-0:8000"
    assert drain_target("http://[fd00::7]:8100", "Decode-1") == "decode-1:8100"
    assert drain_target("http://127.0.0.1:8000") == f"{socket.gethostname().lower()}:8000"


@pytest.fixture
def recording_proxy():
    """A listening socket where the environment's proxy would be: it records each
    connection made to it and answers none."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.05)
    seen: list = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, addr = server.accept()
            except TimeoutError:
                continue
            seen.append(addr)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", seen
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()


def test_the_drain_call_goes_to_the_engine_never_to_a_proxy(monkeypatch, checking_server,
                                                             recording_proxy):
    """A pod with HTTP_PROXY and no NO_PROXY for loopback sent its drain to the proxy: the
    drain was skipped, and the signed call shown to whoever runs the proxy."""
    from bidirkv.connector.supervise import ask_drain

    url, problems = checking_server
    proxy, seen = recording_proxy
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY",
                 "all_proxy"):
        monkeypatch.setenv(name, proxy)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    # As in a launcher, whose environment names the proxy from the start: urllib reads
    # it when it builds its shared opener, which an earlier test may have built already.
    monkeypatch.setattr(urllib.request, "_opener", None)
    monkeypatch.setenv("BIDIRKV_HANDLE_KEY", KEY.decode())
    answered = ask_drain(url)
    assert seen == [], "the drain call went to the proxy"
    assert problems == [None] and answered[0]["draining"] is True


def test_the_benchmarks_residency_report_is_signed_when_it_has_the_key(monkeypatch,
                                                                       checking_server):
    from bidirkv.bench.runner import BenchConfig, Runner

    url, problems = checking_server
    runner = Runner(BenchConfig(url="http://127.0.0.1:1", decode_residency=url + RESIDENCY_PATH),
                    progress=False)
    monkeypatch.setenv("BIDIRKV_HANDLE_KEY", KEY.decode())
    assert runner._residency() == {"draining": True, "refusals": {}} and problems == [None]
    monkeypatch.delenv("BIDIRKV_HANDLE_KEY")
    assert runner._residency() is None and "missing" in problems[-1]


def test_the_demos_benchmark_signs_with_the_stacks_key(monkeypatch, checking_server):
    """`make demo` runs the benchmark against a local stack whose key is fresh per stack
    and in no environment of the demo's: the config carries it."""
    from bidirkv.bench.runner import BenchConfig, Runner

    url, problems = checking_server
    monkeypatch.delenv("BIDIRKV_HANDLE_KEY", raising=False)
    runner = Runner(BenchConfig(url="http://127.0.0.1:1", decode_residency=url + RESIDENCY_PATH,
                                handle_key=KEY), progress=False)
    assert runner._residency() == {"draining": True, "refusals": {}} and problems == [None]


def test_a_local_stack_names_its_handle_key(tmp_path):
    from bidirkv.local.cli import prepare_stack

    (tmp_path / "out" / "models" / "tiny-llama").mkdir(parents=True)  # the spec's model
    stack = prepare_stack(pathlib.Path(__file__).parent.parent / "examples" / "local.yaml",
                          tmp_path / "stack", cwd=tmp_path)
    key = stack.handle_key()
    assert key and all(key == s.env["BIDIRKV_HANDLE_KEY"].encode()
                       for s in stack.plan.servers if s.role != "router")
