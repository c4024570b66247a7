"""A server's process family: everything it started, found from recorded pids alone.

vLLM's API server spawns EngineCore (multiprocessing), which may start workers of its
own; a `kill -9` of the server leaves them running with its memory and ports. Nothing
here looks a process up by name: a family grows only from recorded (pid, start time)
pairs, through what the kernel guarantees:

- a pid whose start time matches its record is that process;
- a child of a process of ours (its parent pid, read while the parent lives) is ours;
- a process group or session id N keeps pid N reserved for as long as any member is left
  (POSIX; Linux frees a pid only once nothing uses it as pid, pgid or sid), so one id
  names one unbroken lifetime, created by whoever had pid N then. Processes join only
  groups of their own session, and sessions only by inheritance: when the creator (pid N)
  is alive and ours, or any member is ours, every member is ours;
- once the creator is dead and no member is recorded, a group or session N may be a
  stranger's: our family ended, pid N was reused, the new owner made a group of its own
  and died. Start times cannot tell the two apart (a stranger's members also started
  after our recorded server), so such a group counts as ours only when a member carries
  the stack's token: a random value in every server's environment, inherited by what it
  starts, recorded in the state file. A member that started before the group's recorded
  creator rules the group out.

Left out: a descendant that left its group and session (setsid) and whose parent died
before anything recorded it (`local up` records descendants while it waits for health).
Its token would find it, but nothing here searches processes outside recorded families.
"""

from __future__ import annotations

import os
import pathlib
import signal
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

TOKEN_VAR = "BIDIRKV_LOCAL_STACK"
Recorded = Iterable[tuple[int, int | None]]  # (pid, start time) pairs


@dataclass(frozen=True)
class Task:
    pid: int
    ppid: int
    pgid: int
    sid: int
    started_at: int
    zombie: bool


def stat_fields(pid: int | str) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state first); None if gone or not Linux."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return stat[stat.rindex(")") + 2:].split()


def read_task(pid: int) -> Task | None:
    fields = stat_fields(pid)
    try:
        return Task(pid, int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]),
                    fields[0] == "Z") if fields else None
    except (IndexError, ValueError):
        return None


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time the process has used so far; 0.0 once it is gone."""
    fields = stat_fields(pid)
    try:
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0
    except (IndexError, ValueError):
        return 0.0


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks since boot); None if gone, a zombie, or
    not Linux."""
    task = read_task(pid)
    return None if task is None or task.zombie else task.started_at


def same_process(pid: int, started_at: int | None) -> bool:
    """True when pid still names the process recorded with that start time (no reuse)."""
    now = process_start_time(pid)
    if now is None:
        return False
    return started_at is None or now == started_at


def snapshot() -> dict[int, Task]:
    """Every process in /proc, zombies included (they still prove a group's identity);
    empty without /proc (not Linux), where nothing can be proven ours."""
    out: dict[int, Task] = {}
    try:
        entries = list(pathlib.Path("/proc").iterdir())
    except OSError:
        return out
    for entry in entries:
        if entry.name.isdigit() and (task := read_task(int(entry.name))) is not None:
            out[task.pid] = task
    return out


def carries_token(pid: int, token: str | None) -> bool:
    if not token:
        return False
    try:
        env = pathlib.Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or not ours to read: not ours to stop either
        return False
    return f"{TOKEN_VAR}={token}".encode() in env.split(b"\0")


def family(recorded: Recorded, token: str | None,
           table: Mapping[int, Task]) -> tuple[dict[int, int], set[int]]:
    """The live processes provably ours (pid -> start time) and the process groups whose
    every member is ours; see the module's docstring for the rules."""
    ours: dict[int, Task] = {}
    creators: dict[int, int | None] = {}  # candidate group/session id -> its creator's start
    for pid, started_at in recorded:
        creators.setdefault(pid, started_at)
        task = table.get(pid)
        if task is not None and started_at in (None, task.started_at):
            ours[pid] = task
    members: dict[str, dict[int, list[Task]]] = {"pgid": defaultdict(list),
                                                 "sid": defaultdict(list)}
    for task in table.values():
        members["pgid"][task.pgid].append(task)
        members["sid"][task.sid].append(task)
    groups: set[int] = set()
    settled: set[tuple[str, int]] = set()
    grew = True
    while grew:
        grew = False
        for task in table.values():
            if task.pid not in ours and task.ppid in ours:
                ours[task.pid] = task
                grew = True
        ids = {**creators, **{pid: task.started_at for pid, task in ours.items()}}
        for kind, by_id in members.items():
            for ident, floor in ids.items():
                of = by_id.get(ident)
                if not of or (kind, ident) in settled:
                    continue
                if floor is not None and any(t.started_at < floor for t in of):
                    continue
                if not (ident in ours or any(t.pid in ours for t in of)
                        or any(carries_token(t.pid, token) for t in of)):
                    continue
                settled.add((kind, ident))
                groups.update([ident] if kind == "pgid" else [])
                for t in of:
                    if t.pid not in ours:
                        ours[t.pid] = t
                        grew = True
    me = os.getpid()
    alive = {pid: t.started_at for pid, t in ours.items() if not t.zombie and pid != me}
    live_groups = {t.pgid for pid, t in ours.items() if pid in alive}
    return alive, (groups & live_groups) - {os.getpgrp()}


def signal_exact(pid: int, started_at: int, sig: int) -> None:
    """Signal pid only while it is still the process that started at started_at."""
    try:
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd (old kernel): a narrower race remains
        fd = None
    try:
        # Checked once the pidfd pins the process: a pid reused since is not signalled.
        if process_start_time(pid) != started_at:
            return
        if fd is None:
            os.kill(pid, sig)
        else:
            signal.pidfd_send_signal(fd, sig)
    except (ProcessLookupError, PermissionError):
        pass
    finally:
        if fd is not None:
            os.close(fd)


def stop_family(recorded: Recorded, token: str | None, grace: float = 15.0,
                kill_wait: float = 5.0, interval: float = 0.1) -> list[int]:
    """SIGTERM the family (whole groups at once, then anyone outside them), SIGKILL what
    is left after `grace`; returns within grace + kill_wait with every pid found."""
    base = dict(recorded)
    found: dict[int, int] = {}
    sig, deadline = signal.SIGTERM, time.monotonic() + grace
    sent: set[tuple[int, int]] = set()
    sent_groups: set[int] = set()
    while True:
        table = snapshot()
        # What was found stays a root: a worker whose parent died meanwhile is still ours.
        alive, groups = family({**base, **found}.items(), token, table)
        found.update(alive)
        now = time.monotonic()
        if not alive or (now >= deadline and sig == signal.SIGKILL):
            return sorted(found)
        if now >= deadline:
            sig, deadline = signal.SIGKILL, now + kill_wait
            sent, sent_groups = set(), set()
        for pgid in groups - sent_groups:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            sent_groups.add(pgid)
            sent.update((t.pid, t.started_at) for t in table.values() if t.pgid == pgid)
        for pid, started_at in alive.items():
            if (pid, started_at) not in sent:
                signal_exact(pid, started_at, sig)
                sent.add((pid, started_at))
        time.sleep(interval)
