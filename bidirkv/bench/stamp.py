"""What a run of the demo records of itself in its JSON: the commit it ran, the date, and
how long it took, phase by phase.

A figure in the docs names the run it comes from (bidirkv/bench/headline.py writes
README's headline from this record), so the run has to say where and when it ran, not
the console it printed to. `make demo` also passes the time `make` started
(MAKE_STARTED_ENV, whole seconds since the epoch), so the time spent before the demo
itself, installing where it had to, is measured too.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

MAKE_STARTED_ENV = "BIDIRKV_MAKE_STARTED"


def make_started(environ: Mapping[str, str]) -> float | None:
    """When `make` started, from the environment the Makefile gives the demo; None when
    the demo runs without it."""
    value = environ.get(MAKE_STARTED_ENV)
    if value is None or value == "":
        return None
    try:
        started = float(value)
    except ValueError:
        started = -1.0
    if started < 0:
        raise ValueError(f"{MAKE_STARTED_ENV}={value!r}: not a time in seconds since the "
                         "epoch (the Makefile sets it with `date +%s`); unset it to run "
                         "without")
    return started


@dataclass
class Clock:
    """The demo's start and its phases' wall times, as they finish."""
    started: float = field(default_factory=time.time)  # seconds since the epoch
    started_mono: float = field(default_factory=time.monotonic)
    make_started: float | None = None
    phases: list[tuple[str, float]] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.monotonic() - self.started_mono

    def timed(self, title: str, fn: Callable[[], Any], announce: Callable[[str], None]
              ) -> Any:
        """`fn()`, announced by its title, its wall time kept as the phase the title
        names (up to its first colon), however it ends."""
        announce(title)
        t = time.monotonic()
        try:
            return fn()
        finally:
            self.phases.append((title.split(":")[0], time.monotonic() - t))

    def done(self) -> str:
        """The whole run's wall time and each phase's, for its last line."""
        return f"done in {self.elapsed():.0f} s: " + ", ".join(
            f"{name} {secs:.0f} s" for name, secs in self.phases)


def git_commit(root: str | os.PathLike[str]) -> tuple[str | None, bool | None]:
    """(short commit, whether tracked files differ from it) of the checkout at `root`;
    (None, None) outside a git checkout or without git."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "--short=7", "HEAD")
    if commit is None:
        return None, None
    changes = git("status", "--porcelain", "--untracked-files=no")
    return commit, None if changes is None else changes != ""


def run_stamp(clock: Clock, commit: str | None, uncommitted: bool | None) -> dict[str, Any]:
    """The record: `wall_s` is the demo's own time so far, `before_demo_s` the time from
    `make` starting to the demo starting (None without make)."""
    started = datetime.datetime.fromtimestamp(clock.started, datetime.UTC)
    before = (None if clock.make_started is None
              else round(max(0.0, clock.started - clock.make_started), 1))
    return {
        "commit": commit,
        "uncommitted_changes": uncommitted,
        "date": started.date().isoformat(),
        "started": started.isoformat(timespec="seconds"),
        "wall_s": round(clock.elapsed(), 1),
        "before_demo_s": before,
        "phases": [{"phase": name, "wall_s": round(secs, 1)} for name, secs in clock.phases],
    }


def restamp(path: pathlib.Path, stamp: Mapping[str, Any]) -> None:
    """The JSON at `path` with its run record replaced (the demo's whole time, once every
    phase after the one that wrote it has run)."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    doc["run"] = dict(stamp)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
