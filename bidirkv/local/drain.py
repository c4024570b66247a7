"""`bidir-kv local drain NAME`: what Kubernetes does to a pod it deletes, done to one
server of the local stack: SIGTERM to its launcher (`bidir-kv serve`, the process the
state file records), which drains before vLLM stops (bidirkv/connector/supervise.py).

Only the launcher is signalled, never its process group: vLLM must hear of it from the
launcher, after the drain, as in a pod. The progress shown is the launcher's own
(its `bidir-kv serve:` lines in the server's log): the residency route answers only
holders of the handle key.
"""

from __future__ import annotations

import os
import pathlib
import signal
import time
from collections.abc import Callable

from bidirkv.local.procs import same_process
from bidirkv.local.state import read_state

ENGINE_ROLES = ("prefill", "decode")
DEFAULT_WAIT_S = 900.0


LAUNCHER_PREFIX = "bidir-kv serve: "


class LogFollower:
    """The launcher's lines appended to a log since it was opened."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)
        try:
            self.offset = self.path.stat().st_size
        except OSError:
            self.offset = 0

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        # Only whole lines: a half-written one is read next time.
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [ln[len(LAUNCHER_PREFIX):] for ln in
                data[:end].decode(errors="replace").splitlines()
                if ln.startswith(LAUNCHER_PREFIX)]


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
    follow = LogFollower(rec.log)
    say(f"{name}: SIGTERM to pid {rec.pid} (bidir-kv serve); it drains, then vLLM stops")
    os.kill(rec.pid, signal.SIGTERM)
    while same_process(rec.pid, rec.started_at):
        elapsed = time.monotonic() - t0
        for line in follow.new_lines():
            say(f"{name}: {elapsed:5.1f} s  {line}")
        if elapsed > wait_s:
            say(f"{name}: still running after {elapsed:.0f} s; left draining")
            return False
        time.sleep(poll_s)
    for line in follow.new_lines():
        say(f"{name}: {time.monotonic() - t0:5.1f} s  {line}")
    say(f"{name}: exited after {time.monotonic() - t0:.1f} s")
    return True
