"""LocalStack with stand-in servers (python -m http.server): start, state file, stop, and
cleanup when a server dies, a port is taken, or the starter gets SIGTERM."""

from __future__ import annotations

import json
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from bidirkv.cli import main as cli_main
from bidirkv.local.plan import ServerPlan, StackPlan
from bidirkv.local.ports import PortInUse, free_ports
from bidirkv.local.procs import same_process
from bidirkv.local.stack import LocalStack, StackRunning, StartError
from bidirkv.local.state import read_state


def http_server(name: str, role: str, port: int) -> ServerPlan:
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    return ServerPlan(name, role, argv, {"BIDIRKV_ROLE": role}, port, health_path="/")


def crashing(name: str, port: int) -> ServerPlan:
    argv = [sys.executable, "-c", "import sys; print('model not found: /nope'); sys.exit(3)"]
    return ServerPlan(name, "decode", argv, {}, port)


def plan_of(tmp_path: pathlib.Path, engines: list[ServerPlan], router_port: int) -> StackPlan:
    router = http_server("router", "router", router_port)
    ports = {f"{s.name} http": s.http_port for s in [*engines, router]}
    return StackPlan(engines, router, {"prefill": [], "decode": []}, tmp_path / "router.json",
                     ports)


@pytest.fixture
def ports() -> list[int]:
    return free_ports(3)


def test_start_records_state_and_stop_cleans_up(tmp_path, ports):
    plan = plan_of(tmp_path, [http_server("prefill-0", "prefill", ports[1]),
                              http_server("decode-0", "decode", ports[2])], ports[0])
    stack = LocalStack(plan, tmp_path, "spec.yaml")
    with stack:
        stack.start(timeout=30, progress=False)
        state = read_state(tmp_path)
        assert state.phase == "up"
        assert state.router_url == f"http://127.0.0.1:{ports[0]}"
        assert [p.name for p in state.procs] == ["prefill-0", "decode-0", "router"]
        assert all(same_process(p.pid, p.started_at) for p in state.procs)
        assert json.loads((tmp_path / "router.json").read_text()) == plan.router_config
        assert (tmp_path / "logs" / "decode-0.log").exists()
        assert stack.urls("decode") == [f"http://127.0.0.1:{ports[2]}"]
        # A second stack from the same directory is refused while this one runs.
        with pytest.raises(StackRunning, match="local down"):
            LocalStack(plan, tmp_path).start(timeout=5, progress=False)
    assert all(not same_process(p.pid, p.started_at) for p in state.procs)
    assert read_state(tmp_path) is None


def test_a_server_that_exits_stops_the_rest_and_shows_its_log(tmp_path, ports):
    plan = plan_of(tmp_path, [http_server("prefill-0", "prefill", ports[1]),
                              crashing("decode-0", ports[2])], ports[0])
    stack = LocalStack(plan, tmp_path)
    with pytest.raises(StartError) as err:
        stack.start(timeout=30, progress=False)
    msg = str(err.value)
    assert msg.startswith("decode-0 exited with 3 while starting")
    assert "model not found: /nope" in msg
    assert str(tmp_path / "logs" / "decode-0.log") in msg
    assert stack.procs == []
    assert read_state(tmp_path) is None


def test_a_taken_port_fails_before_anything_starts(tmp_path, ports):
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[2]))
        s.listen()
        plan = plan_of(tmp_path, [http_server("prefill-0", "prefill", ports[1]),
                                  http_server("decode-0", "decode", ports[2])], ports[0])
        with pytest.raises(PortInUse, match=f"port {ports[2]} \\(decode-0 http\\) is in use"):
            LocalStack(plan, tmp_path).start(timeout=5, progress=False)
    assert not (tmp_path / "logs").exists()


def test_local_down_stops_a_stack_left_running(tmp_path, ports, capsys):
    plan = plan_of(tmp_path, [http_server("prefill-0", "prefill", ports[1])], ports[0])
    stack = LocalStack(plan, tmp_path)
    try:
        stack.start(timeout=30, progress=False)
        pids = [(p.pid, p.started_at) for p in read_state(tmp_path).procs]
        assert cli_main(["local", "down", "--state-dir", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert "router: stopped pid" in out and "prefill-0: stopped pid" in out
        assert all(not same_process(pid, t) for pid, t in pids)
        assert cli_main(["local", "down", "--state-dir", str(tmp_path)]) == 0
        assert "no stack recorded" in capsys.readouterr().err
    finally:
        stack.stop()


STARTER = textwrap.dedent("""
    import pathlib, sys
    from bidirkv.local.plan import ServerPlan, StackPlan
    from bidirkv.local.stack import LocalStack
    d = pathlib.Path(sys.argv[1]); port = int(sys.argv[2])
    # Never healthy: /health of http.server is a 404.
    s = ServerPlan("prefill-0", "prefill", [sys.executable, "-m", "http.server", str(port),
                   "--bind", "127.0.0.1"], {}, port)
    r = ServerPlan("router", "router", [sys.executable, "-c", "pass"], {}, port + 1)
    try:
        LocalStack(StackPlan([s], r, {}, d / "router.json"), d).start(timeout=60,
                                                                      progress=False)
    except KeyboardInterrupt:
        sys.exit(130)
""")


def test_sigterm_while_starting_stops_what_was_started(tmp_path):
    port = free_ports(1)[0]
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(tmp_path), str(port)])
    try:
        deadline = time.monotonic() + 20
        state = None
        while time.monotonic() < deadline:
            state = read_state(tmp_path) if (tmp_path / "stack.json").exists() else None
            if state and state.procs:
                break
            time.sleep(0.1)
        assert state and state.procs, "the starter never recorded its server"
        server = state.procs[0]
        starter.send_signal(signal.SIGTERM)
        assert starter.wait(timeout=30) == 130
        assert not same_process(server.pid, server.started_at)
        assert read_state(tmp_path) is None
    finally:
        starter.kill()
        starter.wait()


def test_exited_names_a_server_that_died_after_start(tmp_path, ports):
    plan = plan_of(tmp_path, [http_server("prefill-0", "prefill", ports[1])], ports[0])
    with LocalStack(plan, tmp_path) as stack:
        stack.start(timeout=30, progress=False)
        assert stack.exited() == []
        victim = stack.procs[0]
        victim.popen.kill()
        victim.popen.wait()
        (msg,) = stack.exited()
        assert msg.startswith("prefill-0 exited with -9; last log lines")
