"""Start, watch and stop local server processes (by pid, never by name)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


class StartError(RuntimeError):
    """A process exited or never answered its health check; the message has its log tail."""


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: pathlib.Path
    health_url: str | None = None
    popen: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    @property
    def started_at(self) -> int | None:
        """The kernel's start time of the process (for pid-reuse checks in state files)."""
        return process_start_time(self.pid) if self.pid else None

    def start(self, cwd: str | None = None) -> Proc:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            # A session of its own: stop() signals the whole group (vLLM spawns engine
            # processes) without touching anything else.
            self.popen = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True,
            )
        finally:
            log.close()
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def wait_healthy(self, timeout: float, interval: float = 0.5) -> None:
        """Poll health_url until 200; raise StartError with the log tail otherwise."""
        wait_all_healthy([self], timeout, interval=interval)

    def stop(self, grace: float = 15.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        pgid = self.popen.pid  # start_new_session: the group id is the child's pid
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            try:
                self.popen.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # Children of the group that outlived the leader.
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_all_healthy(
    procs: Sequence[Proc],
    timeout: float,
    on_ready: Callable[[Proc], None] | None = None,
    interval: float = 0.5,
    on_tick: Callable[[list[Proc]], None] | None = None,
) -> None:
    """Poll every process at once (they start in parallel); the first to exit or the
    deadline raises StartError with that process's log tail."""
    pending = list(procs)
    deadline = time.monotonic() + timeout
    while pending:
        for proc in list(pending):
            if not proc.alive():
                code = proc.popen.returncode if proc.popen else None
                raise StartError(f"{proc.name} exited with {code} while starting; last log "
                                 f"lines ({proc.log_path}):\n{proc.log_tail()}")
            if proc.health_url is None or http_ok(proc.health_url):
                pending.remove(proc)
                if on_ready is not None:
                    on_ready(proc)
        if not pending:
            return
        if on_tick is not None:
            on_tick(pending)
        if time.monotonic() > deadline:
            proc = pending[0]
            raise StartError(f"{proc.name} not healthy after {timeout:.0f} s; last log lines "
                             f"({proc.log_path}):\n{proc.log_tail()}")
        time.sleep(interval)


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks since boot); None if gone, a zombie, or
    not Linux."""
    fields = _stat_fields(pid)
    if not fields or fields[0] == "Z":
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def same_process(pid: int, started_at: int | None) -> bool:
    """True when pid still names the process recorded with that start time (no reuse)."""
    now = process_start_time(pid)
    if now is None:
        return False
    return started_at is None or now == started_at


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def stop_all(procs: Sequence[Proc]) -> None:
    for proc in reversed(list(procs)):
        proc.stop()


def kill_pid_group(pid: int, grace: float = 15.0) -> bool:
    """Stop a process group recorded in a state file (for `bidir-kv local down`)."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return False
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not group_alive(pid):
            return True
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


def _stat_fields(pid: int | str) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state first); None if gone or not Linux."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return stat[stat.rindex(")") + 2:].split()


def group_alive(pgid: int) -> bool:
    """Any process of the group still running (zombies, dead but not reaped, do not count)."""
    proc = pathlib.Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(entry.name)
        if fields and len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def merged_env(extra: Mapping[str, str], base: Mapping[str, str] | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(extra)
    return env
