"""`bidir-kv serve` as the parent of the vLLM server: the drain between SIGTERM and vLLM.

In a pod the launcher is PID 1, so every signal the kubelet sends reaches it first. The
first SIGTERM starts the drain (bidirkv/connector/drain.py decides when it ends); a
second SIGTERM, or SIGINT, is passed on at once: whoever sends it wants the server gone
now. The launcher then waits for vLLM to exit and exits with its code (128 + the signal
when a signal ended it, as a shell reports it).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from bidirkv.connector.drain import FORWARD, decide, readable_blocks
from bidirkv.connector.settings import Settings
from bidirkv.proof import residency_headers, residency_target
from bidirkv.wire import RESIDENCY_PATH, RESIDENCY_VERSION_FIELD, VERSION

POLL_S = 0.5
CALL_TIMEOUT_S = 2.0
DEFAULT_PORT = 8000  # vLLM's
# Bind addresses the launcher cannot call; it calls the server on loopback instead.
ANY_ADDRESS = {"", "0.0.0.0", "::", "[::]"}
# The launcher calls its own server, never through a proxy the environment names
# (HTTP_PROXY without a NO_PROXY for loopback would send the drain to the proxy).
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# (the engine's report or None, why there is none): what one drain call got.
Answer = tuple[dict[str, Any] | None, str]


def _arg(args: Sequence[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def engine_url(vllm_args: Sequence[str]) -> str:
    """Where the launcher reaches its own server: vLLM's --host and --port."""
    host = _arg(vllm_args, "--host") or ""
    port = _arg(vllm_args, "--port") or str(DEFAULT_PORT)
    if host in ANY_ADDRESS:
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def drain_target(url: str, hostname: str | None = None) -> str:
    """The engine the drain call names in its signature: this host's name (a pod's name
    in Kubernetes) and the server's port, so the call is good at this engine only
    (bidirkv/connector/identity.py), whichever address it goes to."""
    host = (hostname or socket.gethostname()).lower()
    port = residency_target(url).rpartition(":")[2]
    return f"{host}:{port}" if host and ":" not in host else residency_target(url)


def _refusal(exc: urllib.error.HTTPError) -> str:
    try:
        message = json.loads(exc.read())["error"]["message"]
    except (OSError, ValueError, KeyError, TypeError):
        message = exc.reason
    return f"HTTP {exc.code}: {str(message)[:300]}"


def ask_drain(url: str, timeout: float = CALL_TIMEOUT_S) -> Answer:
    """Tell the engine it is draining: (its residency report, "") or (None, why not)."""
    body = json.dumps({"drain": True, RESIDENCY_VERSION_FIELD: VERSION}).encode()
    headers = {"Content-Type": "application/json"}
    # The route answers only holders of the handle key (connector/endpoint.py), which
    # the launcher has: it is the engine's own environment.
    if key := Settings.from_env(os.environ).handle_key:
        headers.update(residency_headers(key, drain_target(url), RESIDENCY_PATH, body))
    req = urllib.request.Request(url + RESIDENCY_PATH, data=body, method="POST",
                                 headers=headers)
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            report = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return None, _refusal(exc)
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", None) or exc
        return None, f"{type(reason).__name__}: {reason}"
    except ValueError as exc:
        return None, f"the answer is not JSON ({exc})"
    if not isinstance(report, dict):
        return None, "the answer is not a JSON object"
    return report, ""


def exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def progress(report: Mapping[str, Any] | None, reason: str, left_s: float,
             error: str = "") -> str:
    if report is None:
        return (f"draining: the engine does not answer ({reason}: {error or 'no report'}), "
                f"{left_s:.0f} s left")
    return (f"draining: {report.get('retainedRequests', 0)} conversations held "
            f"({readable_blocks(report)} blocks readable), "
            f"{report.get('activeRequests', 0)} requests in flight, {left_s:.0f} s left")


class Supervisor:
    """The signal state of one child; the handlers only record, the loop acts."""

    def __init__(self) -> None:
        self.drain_requested = False
        self.forward_now: list[int] = []

    def on_signal(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGTERM and not self.drain_requested:
            self.drain_requested = True
        else:
            self.forward_now.append(signum)


def supervise(cmd: Sequence[str], url: str, drain_s: float, poll_s: float = POLL_S,
              ask: Callable[[str], Answer] = ask_drain,
              clock: Callable[[], float] = time.monotonic,
              out: TextIO | None = None) -> int:
    """Run `cmd` as a child until it exits; drain it on the first SIGTERM."""
    out = out or sys.stderr
    state = Supervisor()
    previous = {s: signal.signal(s, state.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def say(line: str) -> None:
        print(f"bidir-kv serve: {line}", file=out, flush=True)

    try:
        child = subprocess.Popen(list(cmd))
        deadline: float | None = None
        forwarded = False
        failures = 0
        last_line = ""
        while True:
            try:
                return exit_code(child.wait(timeout=poll_s))
            except subprocess.TimeoutExpired:
                pass
            while state.forward_now:
                signum = state.forward_now.pop(0)
                say(f"{signal.Signals(signum).name}: passed on to vLLM now")
                child.send_signal(signum)
                forwarded = True
            if not state.drain_requested or forwarded:
                continue
            if deadline is None:
                deadline = clock() + drain_s
                say(f"SIGTERM: draining for at most {drain_s:.0f} s before vLLM stops")
            report, error = ask(url)
            failures = 0 if report is not None else failures + 1
            now = clock()
            step = decide(report, failures, now, deadline)
            if step.action == FORWARD:
                why = f"{step.reason}: {error}" if report is None and error else step.reason
                say(f"drain ended ({why}); passing SIGTERM on to vLLM")
                child.send_signal(signal.SIGTERM)
                forwarded = True
                continue
            line = progress(report, step.reason, deadline - now, error)
            # One line per change, not per poll: the counts are the news.
            key = line.rsplit(",", 1)[0]
            if key != last_line:
                say(line)
                last_line = key
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
