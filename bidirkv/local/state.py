"""The state file of a local stack: what `local down` (or another shell) needs to find it.

Written after every process start, not only once all are healthy, so a stack whose `up`
was killed half-way can still be stopped by its recorded pids. Each pid comes with the
kernel's start time of that process: a recycled pid is never signalled. Each server's
process group and session ids are its pid (a session of its own); what it started is
recorded too, with the stack's token, so that `down` finds its leftovers (family.py).
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
from dataclasses import asdict, dataclass, field
from typing import Any

STATE_FILE = "stack.json"
DEFAULT_STATE_DIR = pathlib.Path("out/local")


@dataclass(frozen=True)
class ProcRecord:
    name: str
    role: str
    pid: int
    started_at: int | None  # /proc/PID/stat start time, for pid-reuse checks
    url: str
    log: str
    nixl_port: int | None = None
    # (pid, start time) of what the server had started when last looked at: found again
    # after the server and their parents died (family.py).
    descendants: tuple[tuple[int, int], ...] = ()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProcRecord:
        if not isinstance(data, dict):
            raise TypeError(f"a process record must be a mapping, not {data!r}")
        kids = tuple((int(pid), int(t)) for pid, t in data.get("descendants", ()))
        return cls(**{**data, "descendants": kids})


@dataclass
class StackState:
    spec_file: str
    router_url: str
    phase: str = "starting"  # starting | up
    procs: list[ProcRecord] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)
    owner_pid: int = field(default_factory=os.getpid)
    # In every server's environment (family.TOKEN_VAR): proves a leftover process group
    # ours once its leader is gone; None in state files written before it existed.
    token: str | None = field(default_factory=lambda: secrets.token_hex(16))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StackState:
        try:
            procs = [ProcRecord.from_json(p) for p in data.get("procs", [])]
            return cls(
                spec_file=str(data["spec_file"]),
                router_url=str(data["router_url"]),
                phase=str(data.get("phase", "starting")),
                procs=procs,
                ports={str(k): int(v) for k, v in (data.get("ports") or {}).items()},
                owner_pid=int(data.get("owner_pid", 0)),
                token=str(data["token"]) if data.get("token") else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a local stack state file ({exc})") from None

    def urls(self, role: str) -> list[str]:
        return [p.url for p in self.procs if p.role == role]

    def record(self, name: str) -> ProcRecord | None:
        return next((p for p in self.procs if p.name == name), None)


def state_path(state_dir: str | os.PathLike[str]) -> pathlib.Path:
    return pathlib.Path(state_dir) / STATE_FILE


def write_state(state_dir: str | os.PathLike[str], state: StackState) -> pathlib.Path:
    """Atomic (write + rename): a reader never sees half a file."""
    path = state_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state.to_json(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_state(state_dir: str | os.PathLike[str]) -> StackState | None:
    """The recorded stack, or None when there is no state file."""
    path = state_path(state_dir)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        return StackState.from_json(json.loads(text))
    except (json.JSONDecodeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def remove_state(state_dir: str | os.PathLike[str]) -> None:
    state_path(state_dir).unlink(missing_ok=True)
