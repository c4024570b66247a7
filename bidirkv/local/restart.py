"""`bidir-kv local restart NAME` and a server leaving the local stack: what a rollout or
a scale-down does to one pod, done to one server.

A restart stops the server the way a deleted pod stops (SIGTERM, so an engine drains
first: bidirkv/local/drain.py; the router stops serving), or with `drop` as a crash or a
node loss does (SIGKILL to the server and everything it started), then starts it again
with the command, environment and working directory it was running with, read from
/proc before it stopped: the same ports, the same handle key, the same spec patches as
the stack it belongs to, whoever started it. The state file then records the new process.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from bidirkv.local.drain import ENGINE_ROLES, drain_server
from bidirkv.local.family import family, snapshot, stop_family
from bidirkv.local.procs import Proc, same_process, wait_all_healthy
from bidirkv.local.state import ProcRecord, StackState, read_state, write_state

# Where each role answers once it serves (plan.py: the router is ready only with a
# healthy prefill and decode behind it).
HEALTH_PATHS = {"prefill": "/health", "decode": "/health", "router": "/ready"}
ROUTER_STOP_S = 30.0
DEFAULT_START_S = 420.0


@dataclass(frozen=True)
class Command:
    """How a running server was started: enough to start it again the same way."""
    argv: list[str]
    env: dict[str, str]
    cwd: str
    cpus: frozenset[int] | None = None  # the cores it ran on (`local up` may pin it)


@dataclass(frozen=True)
class Stopped:
    how: str  # "drain" (SIGTERM, waited for) or "drop" (SIGKILL)
    seconds: float  # from the signal to the last process of its family gone
    exited: bool  # False: still draining when the wait ran out (nothing was killed)


def split_nul(raw: bytes) -> list[str]:
    """/proc's NUL-separated fields (cmdline, environ) as strings."""
    return [part.decode(errors="surrogateescape") for part in raw.split(b"\0") if part]


def parse_environ(raw: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in split_nul(raw):
        key, sep, value = item.partition("=")
        if sep:
            out[key] = value
    return out


def read_command(pid: int) -> Command:
    """The argv, environment, working directory and cores of a live process (Linux)."""
    base = pathlib.Path("/proc", str(pid))
    try:
        return Command(split_nul((base / "cmdline").read_bytes()),
                       parse_environ((base / "environ").read_bytes()),
                       os.readlink(base / "cwd"), frozenset(os.sched_getaffinity(pid)))
    except OSError as exc:
        raise ValueError(f"cannot read how pid {pid} was started ({exc.strerror})") from None


def _record(state: StackState | None, state_dir: str | os.PathLike[str], name: str
            ) -> ProcRecord:
    if state is None:
        raise ValueError(f"no stack recorded in {pathlib.Path(state_dir)}")
    rec = state.record(name)
    if rec is None:
        raise ValueError(f"{name!r} is not a server of this stack; servers: "
                         f"{', '.join(p.name for p in state.procs) or 'none'}")
    return rec


def stop_server(state_dir: str | os.PathLike[str], name: str, drop: bool = False,
                wait_s: float = 900.0, say: Callable[[str], None] = print) -> Stopped:
    """Stop one server: an engine drains (SIGTERM to its launcher), the router gets
    SIGTERM, and with `drop` the server and its family get SIGKILL. Whatever it started
    and left behind is stopped too, so its ports are free for its successor."""
    state = read_state(state_dir)
    rec = _record(state, state_dir, name)
    roots = [(rec.pid, rec.started_at), *rec.descendants]
    t0 = time.monotonic()
    if drop:
        say(f"{name}: SIGKILL to pid {rec.pid} and what it started")
        stop_family(roots, state.token, grace=0.0)
        return Stopped("drop", time.monotonic() - t0, True)
    if rec.role in ENGINE_ROLES:
        exited = drain_server(state_dir, name, wait_s, say=say)
    else:
        exited = _stop_router(rec, min(wait_s, ROUTER_STOP_S), say)
    if exited:
        # vLLM's engine core outlives its API server by a moment; a leftover holds ports.
        stop_family(roots, state.token, grace=5.0)
    return Stopped("drain", time.monotonic() - t0, exited)


def _stop_router(rec: ProcRecord, wait_s: float, say: Callable[[str], None]) -> bool:
    if not same_process(rec.pid, rec.started_at):
        say(f"{rec.name}: pid {rec.pid} is not running")
        return True
    say(f"{rec.name}: SIGTERM to pid {rec.pid}")
    os.kill(rec.pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while same_process(rec.pid, rec.started_at):
        if time.monotonic() > deadline:
            say(f"{rec.name}: still running after {wait_s:.0f} s")
            return False
        time.sleep(0.1)
    return True


def start_again(state_dir: str | os.PathLike[str], name: str, command: Command,
                timeout: float = DEFAULT_START_S) -> ProcRecord:
    """Start a stopped server with its recorded command, wait until it serves, and record
    the new process (and what it started) in the state file."""
    state = read_state(state_dir)
    rec = _record(state, state_dir, name)
    if same_process(rec.pid, rec.started_at):
        raise ValueError(f"{name} (pid {rec.pid}) is still running")
    proc = Proc(name, command.argv, command.env, pathlib.Path(rec.log),
                rec.url + HEALTH_PATHS.get(rec.role, "/health"),
                cpus=command.cpus).start(cwd=command.cwd)
    assert proc.pid is not None
    new = dataclasses.replace(rec, pid=proc.pid, started_at=proc.started_at, descendants=())
    _replace(state_dir, name, new)
    try:
        wait_all_healthy([proc], timeout)
    except BaseException:
        proc.stop(token=state.token)
        raise
    found, _ = family([(new.pid, new.started_at)], state.token, snapshot())
    kids = tuple(sorted((pid, t) for pid, t in found.items() if pid != new.pid))
    new = dataclasses.replace(new, descendants=kids)
    _replace(state_dir, name, new)
    return new


def _replace(state_dir: str | os.PathLike[str], name: str, rec: ProcRecord) -> None:
    # Read again: another server may have been restarted meanwhile.
    state = read_state(state_dir)
    if state is None:
        raise ValueError(f"the stack in {pathlib.Path(state_dir)} was stopped meanwhile")
    state.procs = [rec if p.name == name else p for p in state.procs]
    write_state(state_dir, state)


@dataclass(frozen=True)
class Restarted:
    stopped: Stopped
    start_s: float
    record: ProcRecord | None  # None: it did not stop within the wait, so not restarted


def restart_server(state_dir: str | os.PathLike[str], name: str, drop: bool = False,
                   wait_s: float = 900.0, start_timeout: float = DEFAULT_START_S,
                   say: Callable[[str], None] = print) -> Restarted:
    """Stop one server (stop_server) and start it again with the same command."""
    rec = _record(read_state(state_dir), state_dir, name)
    if not same_process(rec.pid, rec.started_at):
        raise ValueError(f"{name} (pid {rec.pid}) is not running: its command cannot be "
                         "read; restart the stack")
    command = read_command(rec.pid)
    stopped = stop_server(state_dir, name, drop, wait_s, say)
    if not stopped.exited:
        return Restarted(stopped, 0.0, None)
    t0 = time.monotonic()
    say(f"{name}: starting again ({stopped.how} took {stopped.seconds:.1f} s)")
    new = start_again(state_dir, name, command, start_timeout)
    start_s = time.monotonic() - t0
    say(f"{name}: serving again after {start_s:.0f} s, pid {new.pid}")
    return Restarted(stopped, start_s, new)
