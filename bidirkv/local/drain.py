"""`bidir-kv local drain NAME`: what Kubernetes does to a pod it deletes, done to one
server of the local stack: SIGTERM to its launcher (`bidir-kv serve`, the process the
state file records), which drains before vLLM stops (bidirkv/connector/supervise.py).

Only the launcher is signalled, never its process group: vLLM must hear of it from the
launcher, after the drain, as in a pod. Progress is read from the server's residency
report while it still answers.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from bidirkv.local.procs import same_process
from bidirkv.local.state import read_state
from bidirkv.wire import RESIDENCY_PATH, RESIDENCY_VERSION_FIELD, VERSION

ENGINE_ROLES = ("prefill", "decode")
DEFAULT_WAIT_S = 900.0


def residency_report(url: str, timeout: float = 2.0) -> dict[str, Any] | None:
    """The server's residency report, asking for nothing (no lease, no release)."""
    body = json.dumps({RESIDENCY_VERSION_FIELD: VERSION}).encode()
    req = urllib.request.Request(url + RESIDENCY_PATH, data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            report = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def describe(report: dict[str, Any] | None) -> str:
    if report is None:
        return "not answering (stopping)"
    state = "draining" if report.get("draining") else "not draining yet"
    return (f"{state}, {report.get('retainedRequests', 0)} conversations held, "
            f"{report.get('activeRequests', 0)} requests in flight")


def drain_server(state_dir: str | os.PathLike[str], name: str,
                 wait_s: float = DEFAULT_WAIT_S, poll_s: float = 1.0,
                 say: Callable[[str], None] = print) -> bool:
    """SIGTERM the named engine's launcher and wait for it to exit; True once it did,
    False when it still runs after `wait_s` (it keeps draining: nothing is killed)."""
    state = read_state(state_dir)
    if state is None:
        raise ValueError(f"no stack recorded in {pathlib.Path(state_dir)}")
    rec = state.record(name)
    engines = [p.name for p in state.procs if p.role in ENGINE_ROLES]
    if rec is None or rec.role not in ENGINE_ROLES:
        raise ValueError(f"{name!r} is not an engine of this stack; engines: "
                         f"{', '.join(engines) or 'none'}")
    if not same_process(rec.pid, rec.started_at):
        say(f"{name}: pid {rec.pid} is not running")
        return True
    t0 = time.monotonic()
    say(f"{name}: SIGTERM to pid {rec.pid} (bidir-kv serve); it drains, then vLLM stops")
    os.kill(rec.pid, signal.SIGTERM)
    last = ""
    while same_process(rec.pid, rec.started_at):
        elapsed = time.monotonic() - t0
        if elapsed > wait_s:
            say(f"{name}: still running after {elapsed:.0f} s; left draining")
            return False
        line = describe(residency_report(rec.url))
        if line != last:
            say(f"{name}: {elapsed:5.1f} s  {line}")
            last = line
        time.sleep(poll_s)
    say(f"{name}: exited after {time.monotonic() - t0:.1f} s")
    return True
