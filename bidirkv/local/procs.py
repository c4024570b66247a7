"""Start, watch and stop local server processes (by pid, never by name)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from bidirkv.local.cpuset import pinned_thread

# Re-exported: callers check recorded pids through this module.
from bidirkv.local.family import process_start_time, stop_family
from bidirkv.local.family import same_process as same_process


class StartError(RuntimeError):
    """A process exited or never answered its health check; the message has its log tail."""


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: pathlib.Path
    health_url: str | None = None
    cpus: frozenset[int] | None = None  # the cores it starts on (cpuset.py); None: any
    popen: subprocess.Popen | None = field(default=None, repr=False)
    # Read at start: once the process is gone (or a zombie) /proc no longer has it.
    _started_at: int | None = field(default=None, init=False, repr=False)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    @property
    def started_at(self) -> int | None:
        """The kernel's start time of the process (for pid-reuse checks in state files)."""
        return self._started_at

    def start(self, cwd: str | None = None) -> Proc:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            # A session (and group) of its own, with ids equal to its pid: stop() finds
            # what it started (vLLM's EngineCore and workers) by those ids, even after
            # the server itself died, without touching anything else.
            with pinned_thread(self.cpus):
                self.popen = subprocess.Popen(
                    self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True,
                )
        finally:
            log.close()
        self._started_at = process_start_time(self.popen.pid)
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

    def stop(self, grace: float = 15.0, token: str | None = None,
             known: Iterable[tuple[int, int]] = ()) -> None:
        """Stop the process and its family (family.py): also when it already exited,
        since what it started may not have. `known`: descendants recorded earlier."""
        if self.popen is None:
            return
        stop_family([(self.popen.pid, self._started_at), *known], token, grace)
        try:
            self.popen.wait(timeout=5.0)  # reap it: a zombie keeps its pid taken
        except subprocess.TimeoutExpired:
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


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def stop_all(procs: Sequence[Proc]) -> None:
    for proc in reversed(list(procs)):
        proc.stop()


def merged_env(extra: Mapping[str, str], base: Mapping[str, str] | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(extra)
    return env
