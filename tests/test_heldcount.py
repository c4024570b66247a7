"""The operator's reads of a draining decode pod's gauge (bidirkv/operator/reconcile/
heldcount.py) against engines that do not behave, on 127.0.0.1: one that trickles its
answer (a byte every 0.5 s) neither holds a thread of the executor every Kubernetes API
call runs in nor outlives the read's deadline; a redirect is not followed; a pod is read
once at a time; a count out of range is clamped."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.server
import logging
import socketserver
import threading

import kubernetes
from test_drainwatch import _with_port, at, pod

from bidirkv.operator.kube import KubeClient
from bidirkv.operator.reconcile.diff import controlled_by
from bidirkv.operator.reconcile.heldcount import (
    MAX_HELD,
    READ_DEADLINE_S,
    RETAINED_REQUESTS_METRIC,
    HeldReads,
    retained_in,
)

TICK_S = 0.5  # the trickle: one byte this often
TRICKLE_BYTES = 120  # at most a minute of it; the test stops it sooner
# An answer that would be a good one, had it come at once.
GOOD = (f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n"
        f"{RETAINED_REQUESTS_METRIC} 3\n").encode()


class _Trickle(socketserver.BaseRequestHandler):
    def handle(self):
        server = self.server
        with server.lock:
            server.opened += 1
        self.request.recv(4096)
        reply = (GOOD * (TRICKLE_BYTES // len(GOOD) + 1))[:TRICKLE_BYTES]
        for i in range(TRICKLE_BYTES):
            if server.stop.wait(TICK_S):
                break
            try:
                self.request.sendall(reply[i:i + 1])
            except OSError:  # the reader closed: its read ended
                with server.lock:
                    server.cut += 1
                break


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    request_queue_size = 64  # every reader connects at once


@contextlib.contextmanager
def trickling_engine():
    """An engine port on 127.0.0.1 that answers one byte every TICK_S; on exit it stops
    trickling, so every connection it holds ends."""
    server = _Server(("127.0.0.1", 0), _Trickle)
    server.lock, server.stop, server.opened, server.cut = threading.Lock(), \
        threading.Event(), 0, 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


class _ApiExecutor(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor, where KubeClient runs every API call: counted."""

    submitted = 0

    def submit(self, *args, **kwargs):
        self.submitted += 1
        return super().submit(*args, **kwargs)


class _StandInClient(KubeClient):
    """KubeClient whose API server answers at once: its call's wait is the executor's."""

    def _call(self, method, path, body=None, content_type=None):
        return {}


async def _until(check, seconds: float = 5.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)


async def test_a_trickling_engine_holds_no_api_thread_and_its_read_ends_at_the_deadline():
    loop = asyncio.get_running_loop()
    api = _ApiExecutor(max_workers=4)  # few: 8 reads in it would take every thread
    loop.set_default_executor(api)
    client = _StandInClient(kubernetes.client.Configuration())
    try:
        with trickling_engine() as engine:
            pods = [_with_port(pod(f"tiny-decode-{i}"), ip="127.0.0.1",
                               port=engine.server_address[1]) for i in range(8)]
            start = loop.time()
            reads = asyncio.create_task(HeldReads().read(pods, at(10)))
            await _until(lambda: engine.opened >= 4)
            assert api.submitted == 0, "a read went through the API executor"
            # A Kubernetes API call while the pods trickle: the executor is free.
            t0 = loop.time()
            assert await asyncio.wait_for(client.get("Pod", "ns1", "x"), 10 * READ_DEADLINE_S) \
                == {}
            waited = loop.time() - t0
            assert await reads == {}
            took = loop.time() - start
            # Every connection is closed by its reader (not left to trickle on): the
            # engine's next byte after the close fails.
            await _until(lambda: engine.cut == 8, 10 * TICK_S)
            assert (engine.opened, engine.cut) == (8, 8)
    finally:
        client.close()
        api.shutdown(wait=False, cancel_futures=True)
    assert waited < READ_DEADLINE_S / 2, f"the API call waited {waited:.2f} s"
    # The whole read ends at its deadline, though each byte came well within it.
    assert READ_DEADLINE_S * 0.9 <= took < READ_DEADLINE_S * 3, took


async def test_a_pod_is_read_once_at_a_time():
    with trickling_engine() as engine:
        p = _with_port(pod("tiny-decode-1"), ip="127.0.0.1", port=engine.server_address[1])
        p["metadata"]["uid"] = "u-1"
        reads = HeldReads()
        first = asyncio.create_task(reads.read([p], at(10)))
        await _until(lambda: engine.opened == 1)
        # Another pass while the first read is outstanding: no second read of the pod.
        assert await reads.read([p], at(10)) == {}
        assert await first == {}
        assert engine.opened == 1
        # Once it ended, the pod is read again.
        assert await reads.read([p], at(10)) == {}
        assert engine.opened == 2


class _Recorded(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []
    redirect_to = ""

    def do_GET(self):  # noqa: N802 - the handler's name
        if self.redirect_to:
            self.send_response(302)
            self.send_header("Location", self.redirect_to)
            self.end_headers()
            return
        type(self).hits.append(self.path)
        body = f"{RETAINED_REQUESTS_METRIC} 5\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def http_server(redirect_to: str = ""):
    handler = type("Handler", (_Recorded,), {"hits": [], "redirect_to": redirect_to})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


async def test_a_redirect_is_a_failed_read_not_followed_and_logged_once(caplog):
    with http_server() as target:
        elsewhere = f"http://127.0.0.1:{target.server_address[1]}/metrics"
        with http_server(redirect_to=elsewhere) as engine:
            p = _with_port(pod("tiny-decode-1"), ip="127.0.0.1", port=engine.server_address[1])
            reads = HeldReads()
            with caplog.at_level(logging.WARNING, logger="bidirkv.operator"):
                assert await reads.read([p], at(10)) == {}
                assert await reads.read([p], at(10)) == {}
        # The target answers a direct read (it is up): only the redirect was not followed.
        direct = _with_port(pod("tiny-decode-2"), ip="127.0.0.1",
                            port=target.server_address[1])
        assert await reads.read([direct], at(10)) == {"tiny-decode-2": 5}
        assert len(target.RequestHandlerClass.hits) == 1
    redirects = [r for r in caplog.records if "redirect" in r.getMessage()]
    assert len(redirects) == 1 and "tiny-decode-1" in redirects[0].getMessage()


NAME = RETAINED_REQUESTS_METRIC


def test_a_count_out_of_range_is_clamped_or_unknown():
    assert retained_in(f"{NAME} 1e30\n") == MAX_HELD
    assert retained_in(f"{NAME} {2**63}\n") == MAX_HELD
    # Each sample in range, their sum not.
    assert retained_in(f'{NAME}{{engine="0"}} {MAX_HELD - 1}\n'
                       f'{NAME}{{engine="1"}} {MAX_HELD - 1}\n') == MAX_HELD
    assert retained_in(f"{NAME} {MAX_HELD}\n") == MAX_HELD
    # Not a count at all: unknown (the status keeps the last reading), never 0.
    for bad in ("-1", "-1e30", "NaN", "+Inf", "2.5"):
        assert retained_in(f"{NAME} {bad}\n") is None, bad


async def test_a_huge_gauge_read_from_an_engine_is_clamped():
    with http_server() as engine:
        engine.RequestHandlerClass.do_GET = _huge
        p = _with_port(pod("tiny-decode-1"), ip="127.0.0.1", port=engine.server_address[1])
        assert await HeldReads().read([p], at(10)) == {"tiny-decode-1": MAX_HELD}


def _huge(self):
    body = f"{NAME} 1e300\n".encode()
    self.send_response(200)
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)


def test_only_a_pod_its_statefulset_controls_is_its():
    def pod_with(*refs):
        return {"metadata": {"name": "tiny-decode-1", "ownerReferences": list(refs)}}

    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "tiny-decode", "uid": "s1"}
    assert controlled_by(pod_with({**sts, "controller": True}), "s1")
    assert not controlled_by(pod_with(), "s1")  # matching labels, no owner
    assert not controlled_by(pod_with({**sts, "uid": "s2", "controller": True}), "s1")
    assert not controlled_by(pod_with(sts), "s1")  # an owner, not its controller
    assert not controlled_by({"metadata": {"ownerReferences": None}}, "s1")

