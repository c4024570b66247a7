"""`bidir-kv router` as a process of its own (as a pod is), for tests and benchmarks:
started on 127.0.0.1, ready once `/ready` answers, stopped by its pid."""

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
from collections.abc import Callable

import aiohttp

KEY = "0123456789abcdef" * 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RouterProcess:
    """`bidir-kv router` as its own process; stopped by its pid."""

    def __init__(self, config: pathlib.Path, store_url: str | None, log: pathlib.Path,
                 key: str = KEY, env: dict[str, str] | None = None,
                 preexec: Callable[[], None] | None = None) -> None:
        self.config, self.store_url, self.log, self.key = config, store_url, log, key
        self.env, self.preexec = env or {}, preexec
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, timeout: float = 30.0) -> RouterProcess:
        exe = pathlib.Path(sys.executable).with_name("bidir-kv")
        env = {**os.environ, "BIDIRKV_HANDLE_KEY": self.key, **self.env}
        store = ["--handle-store", self.store_url] if self.store_url else []
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [str(exe), "router", "--config", str(self.config), "--host", "127.0.0.1",
                 "--port", str(self.port), *store],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=self.preexec)
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

    async def ended(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        """`stop`, with the event loop running while the router stops (engines in this
        process answer what it sends on its way out); its exit code (None: killed)."""
        assert self.proc is not None
        self.proc.send_signal(sig)
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
            return None
        return self.proc.returncode

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


