"""Start and stop a planned local stack: engines in parallel, then the router.

Whatever goes wrong while starting (a server exits, a port is taken, Ctrl-C, SIGTERM),
every process started so far is stopped, with its family (family.py: what it started,
by recorded pids, groups and start times), before the error surfaces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping

from bidirkv.local.family import TOKEN_VAR, cpu_seconds, family, snapshot, stop_family
from bidirkv.local.plan import ServerPlan, StackPlan, cpu_line, process_env
from bidirkv.local.ports import PortInUse, check_ports
from bidirkv.local.procs import Proc, StartError, same_process, wait_all_healthy
from bidirkv.local.state import ProcRecord, StackState, read_state, remove_state, write_state
from bidirkv.operator.render.handlekey import ENV_CURRENT

# Cold start of a CPU vLLM server on 2 busy cores was seen at ~60 s; leave ample room.
DEFAULT_START_TIMEOUT = 420.0


class StackRunning(RuntimeError):
    """A live stack is already recorded in the state directory."""


class _Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP, raised where Ctrl-C would be so the same cleanup runs."""


@contextlib.contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into KeyboardInterrupt for the duration (main thread only)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupt(signum: int, _frame: object) -> None:
        raise _Terminated(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, raise_interrupt) for sig in (signal.SIGTERM,
                                                                    signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def live_procs(state: StackState) -> list[ProcRecord]:
    return [p for p in state.procs if same_process(p.pid, p.started_at)]


class LocalStack:
    """The processes of one StackPlan. A context manager: leaving it stops everything."""

    def __init__(self, plan: StackPlan, state_dir: str | os.PathLike[str], spec_file: str = "",
                 base_env: Mapping[str, str] | None = None) -> None:
        self.plan = plan
        self.state_dir = pathlib.Path(state_dir).resolve()
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.procs: list[Proc] = []
        self.state = StackState(spec_file=spec_file, router_url=plan.router.url,
                                ports=dict(plan.ports))
        # What start() stopped of a previous stack from the same state directory.
        self.cleaned: list[str] = []
        # The dtype the stack runs with and why (cli.with_local_dtype), when it was chosen.
        self.dtype_choice = None
        # The validated spec it was planned from (cli.prepare_stack sets it).
        self.spec = None

    @property
    def retention_s(self) -> float | None:
        """Decode's retention cap (decoderKvBlocksTtlSeconds) when reuse is on."""
        kv = self.spec.kv_transfer if self.spec is not None else None
        return kv.decoder_kv_blocks_ttl_seconds if kv is not None and kv.bidirectional \
            else None

    def cpu_line(self) -> str:
        return cpu_line(self.plan)

    @property
    def router_url(self) -> str:
        return self.plan.router.url

    def url(self, name: str) -> str:
        return next(s.url for s in self.plan.servers if s.name == name)

    def urls(self, role: str) -> list[str]:
        return [s.url for s in self.plan.servers if s.role == role]

    def handle_key(self) -> bytes | None:
        """The stack's handle key (fresh per stack, in every engine's environment): what a
        client of the engines' residency route signs with."""
        engines = [s for s in self.plan.servers if s.role != "router"]
        key = engines[0].env.get(ENV_CURRENT, "").strip() if engines else ""
        return key.encode() or None

    def cpu_seconds(self, roles: tuple[str, ...]) -> float:
        """CPU time used so far by the servers of these roles and everything they started
        (API servers, engine cores, workers): a benchmark's cost per request, which on a
        machine with few cores bounds its throughput."""
        table = snapshot()
        total = 0.0
        for rec in self.state.procs:
            if rec.role in roles:
                found, _ = family([(rec.pid, rec.started_at), *rec.descendants],
                                  self.state.token, table)
                total += sum(cpu_seconds(pid) for pid in found)
        return total

    def log_path(self, name: str) -> pathlib.Path:
        return self.state_dir / "logs" / f"{name}.log"

    # -- start -----------------------------------------------------------------------
    def _proc(self, server: ServerPlan) -> Proc:
        log = self.log_path(server.name)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.unlink(missing_ok=True)  # the tail shown on failure is this run's only
        env = process_env(server.env, self.base_env)
        if self.state.token:
            env[TOKEN_VAR] = self.state.token
        return Proc(server.name, server.argv, env, log, server.health_url, cpus=server.cpus)

    def _launch(self, server: ServerPlan) -> Proc:
        # cwd: the state directory, never the project root (see plan.py).
        proc = self._proc(server).start(cwd=str(self.state_dir))
        self.procs.append(proc)
        assert proc.pid is not None
        self.state.procs.append(ProcRecord(
            server.name, server.role, proc.pid, proc.started_at, server.url,
            str(proc.log_path), server.nixl_port,
        ))
        write_state(self.state_dir, self.state)
        return proc

    def _record_descendants(self) -> None:
        """Put what each server has started so far into the state file: `down` finds it
        there even once its parents are dead."""
        table = snapshot()
        records = []
        for rec in self.state.procs:
            found, _ = family([(rec.pid, rec.started_at), *rec.descendants],
                              self.state.token, table)
            kids = tuple(sorted((pid, t) for pid, t in found.items() if pid != rec.pid))
            records.append(dataclasses.replace(rec, descendants=kids))
        if records != self.state.procs:
            self.state.procs = records
            write_state(self.state_dir, self.state)

    def start(self, timeout: float = DEFAULT_START_TIMEOUT, progress: bool = True,
              echo: Callable[[str], None] | None = None) -> LocalStack:
        """Return once every server answers its health check; on any failure (or
        interrupt) stop what was started, then raise."""
        existing = read_state(self.state_dir)
        if existing is not None and live_procs(existing):
            raise StackRunning(
                f"a local stack is already running from {self.state_dir} (router "
                f"{existing.router_url}): run `bidir-kv local down --state-dir "
                f"{self.state_dir}` first")
        if existing is not None:
            # Its servers are gone, but not necessarily what they started (a `kill -9`
            # of a server leaves EngineCore with its memory and ports).
            self.cleaned = [line for line in stop_recorded(self.state_dir)
                            if "stopped" in line]
            for line in self.cleaned if echo else ():
                echo(f"previous stack: {line}")
        check_ports(self.plan.ports)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.plan.router_config_path.write_text(
            json.dumps(self.plan.router_config, indent=2, sort_keys=True) + "\n")
        t0 = time.monotonic()
        try:
            with interrupt_on_signals(), _progress(len(self.plan.servers), progress) as bar:
                engines = [self._launch(s) for s in self.plan.engines]

                def ready(proc: Proc) -> None:
                    bar.update(1)
                    if echo:
                        echo(f"{proc.name} healthy after {time.monotonic() - t0:.0f} s")

                def tick(pending: list[Proc]) -> None:
                    bar.set_postfix_str("waiting for " + ", ".join(p.name for p in pending))
                    self._record_descendants()

                wait_all_healthy(engines, timeout, ready, on_tick=tick)
                router = self._launch(self.plan.router)
                wait_all_healthy([router], max(30.0, timeout - (time.monotonic() - t0)),
                                 ready, on_tick=tick)
                bar.set_postfix_str("all healthy")
                self._record_descendants()
        except BaseException:
            self.stop()
            raise
        self.state.phase = "up"
        write_state(self.state_dir, self.state)
        return self

    def exited(self) -> list[str]:
        """One message (with the log tail) per server that is no longer running."""
        return [f"{p.name} exited with {p.popen.returncode if p.popen else None}; last log "
                f"lines ({p.log_path}):\n{p.log_tail()}" for p in self.procs if not p.alive()]

    # -- stop ------------------------------------------------------------------------
    def stop(self) -> None:
        # A second Ctrl-C while stopping must not leave half the servers running.
        with _signals_ignored():
            for proc in reversed(self.procs):
                rec = self.state.record(proc.name)
                proc.stop(token=self.state.token, known=rec.descendants if rec else ())
            self.procs.clear()
            remove_state(self.state_dir)

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[object]:
    from tqdm import tqdm

    bar = tqdm(total=total, desc="starting servers", unit="server", disable=not enabled,
               file=sys.stderr, bar_format="{desc}: {n}/{total} |{bar}| {elapsed}{postfix}")
    try:
        yield bar
    finally:
        bar.close()


def stop_state(state: StackState, grace: float = 15.0) -> list[str]:
    """Stop every recorded server with its family, last started first; what was done."""
    done = []
    for rec in reversed(state.procs):
        found = stop_family([(rec.pid, rec.started_at), *rec.descendants], state.token,
                            grace)
        others = ", ".join(str(pid) for pid in found if pid != rec.pid)
        if rec.pid in found:
            line = f"{rec.name}: stopped pid {rec.pid}"
            line += f" and what it started ({others})" if others else ""
        else:
            line = f"{rec.name}: pid {rec.pid} already gone"
            line += f"; stopped what it left running ({others})" if others else ""
        done.append(line)
    return done


def stop_recorded(state_dir: str | os.PathLike[str]) -> list[str]:
    """Stop every process a state file records, with its family; what was done."""
    state = read_state(state_dir)
    if state is None:
        return []
    with _signals_ignored():
        done = stop_state(state)
        remove_state(state_dir)
    return done


__all__ = [
    "DEFAULT_START_TIMEOUT", "LocalStack", "PortInUse", "StackRunning", "StartError",
    "interrupt_on_signals", "live_procs", "stop_recorded", "stop_state",
]
