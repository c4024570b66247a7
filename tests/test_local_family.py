"""What a killed local server leaves running is stopped by `local down` and by the next
`local up`; a stranger that got a recorded pid (or its group id) is never touched.

The stand-in server does what vLLM's API server does, with real processes: it starts an
"engine" (same group and session) that starts a "worker" leaving both (setsid) and
holding a port, all before /health answers.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from bidirkv.cli import main as cli_main
from bidirkv.local.family import cpu_seconds, signal_exact
from bidirkv.local.plan import ServerPlan, StackPlan
from bidirkv.local.ports import PortInUse, free_ports, port_free
from bidirkv.local.procs import process_start_time, same_process
from bidirkv.local.stack import LocalStack, stop_recorded
from bidirkv.local.state import StackState, read_state, write_state

FAKE_SERVER = textwrap.dedent("""
    import http.server, os, socket, subprocess, sys, time
    role, pids, hold = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if role == "worker":
        spin = time.process_time() + 0.4  # CPU time a stack's account must include
        while time.process_time() < spin:
            pass
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", hold))
        s.listen()
    with open(pids, "a") as f:
        f.write(f"{role} {os.getpid()}\\n")
    if role == "server":
        subprocess.Popen([sys.executable, __file__, "engine", pids, str(hold)])
        deadline = time.monotonic() + 30
        while len(open(pids).read().splitlines()) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        http.server.HTTPServer(("127.0.0.1", int(sys.argv[4])),
                               http.server.SimpleHTTPRequestHandler).serve_forever()
    elif role == "engine":
        subprocess.Popen([sys.executable, __file__, "worker", pids, str(hold)],
                         start_new_session=True)
    time.sleep(120)
""")

Pid = tuple[int, int]  # pid, start time


def wait_for(check, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


class Fake:
    """One stack of a fake server and an http.server router; every process it saw is
    killed at the end, by pid and start time."""

    def __init__(self, tmp_path: pathlib.Path) -> None:
        self.dir = tmp_path / "state"
        self.script = tmp_path / "fake_server.py"
        self.script.write_text(FAKE_SERVER)
        self.router_port, self.http_port, self.hold_port = free_ports(3)
        self.seen: list[Pid] = []
        self.runs = 0

    def plan(self) -> StackPlan:
        self.runs += 1
        self.pids_file = self.dir / f"pids-{self.runs}"
        argv = [sys.executable, str(self.script), "server", str(self.pids_file),
                str(self.hold_port), str(self.http_port)]
        server = ServerPlan("prefill-0", "prefill", argv, {}, self.http_port,
                            nixl_port=self.hold_port, health_path="/")
        router = ServerPlan("router", "router", [
            sys.executable, "-m", "http.server", str(self.router_port), "--bind", "127.0.0.1",
        ], {}, self.router_port, health_path="/")
        ports = {"router http": self.router_port, "prefill-0 http": self.http_port,
                 "prefill-0 nixl side channel": self.hold_port}
        return StackPlan([server], router, {}, self.dir / "router.json", ports)

    def start(self) -> tuple[LocalStack, dict[str, Pid]]:
        stack = LocalStack(self.plan(), self.dir)
        try:
            stack.start(timeout=60, progress=False)
        finally:
            self.seen += [(p.pid, p.started_at) for p in stack.procs]
        pids = {}
        for line in self.pids_file.read_text().splitlines():
            role, pid = line.split()
            pids[role] = (int(pid), process_start_time(int(pid)))
        self.seen += pids.values()
        assert all(t is not None for _, t in pids.values()), pids
        return stack, pids

    def cleanup(self) -> None:
        for pid, started_at in self.seen:
            if started_at is not None:
                signal_exact(pid, started_at, signal.SIGKILL)


@pytest.fixture
def fake(tmp_path):
    f = Fake(tmp_path)
    yield f
    f.cleanup()


def kill9(stack: LocalStack, *names: str) -> None:
    for proc in stack.procs:
        if proc.name in (names or ["prefill-0"]):
            proc.popen.kill()
            # Reaped, as by init once `up` has exited: the pid is no proof any more.
            proc.popen.wait()


def alive(pids) -> list[Pid]:
    return [p for p in pids if same_process(*p)]


def test_down_stops_what_a_killed_server_left_running(fake, capsys):
    stack, pids = fake.start()
    state = read_state(fake.dir)
    assert sorted(state.record("prefill-0").descendants) == sorted(
        [pids["engine"], pids["worker"]])
    assert state.token and not port_free(fake.hold_port)
    kill9(stack)
    assert alive([pids["engine"], pids["worker"]]) == [pids["engine"], pids["worker"]]
    assert cli_main(["local", "down", "--state-dir", str(fake.dir)]) == 0
    out = capsys.readouterr().out
    assert (f"prefill-0: pid {pids['server'][0]} already gone; stopped what it left running"
            in out)
    assert wait_for(lambda: not alive(pids.values())), alive(pids.values())
    assert port_free(fake.hold_port)
    assert read_state(fake.dir) is None


def test_a_stacks_cpu_time_counts_what_its_servers_started(fake):
    stack, pids = fake.start()
    worker = cpu_seconds(pids["worker"][0])
    assert worker >= 0.4  # it spun before it slept
    # The worker left the server's session (as vLLM's may): still the server's.
    assert stack.cpu_seconds(("prefill",)) >= worker + cpu_seconds(pids["server"][0])
    assert stack.cpu_seconds(("router",)) < worker  # an idle http.server
    assert stack.cpu_seconds(("decode",)) == 0.0  # no such server
    stack.stop()
    assert stack.cpu_seconds(("prefill",)) == 0.0  # nothing of it is left to count
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert cpu_seconds(gone.pid) == 0.0


def test_a_leftover_group_is_proven_by_the_token_without_recorded_descendants(fake):
    stack, pids = fake.start()
    kill9(stack)
    state = read_state(fake.dir)
    # As if `up` had died before recording anything: the group (leader gone) is known by
    # the token in its environment, the worker by its living parent.
    state.procs = [dataclasses.replace(p, descendants=()) for p in state.procs]
    write_state(fake.dir, state)
    stop_recorded(fake.dir)
    assert wait_for(lambda: not alive(pids.values())), alive(pids.values())


def test_a_detached_worker_whose_parents_died_is_found_by_its_recorded_pid(fake):
    stack, pids = fake.start()
    kill9(stack)
    os.kill(pids["engine"][0], signal.SIGKILL)
    assert wait_for(lambda: not alive([pids["engine"]]))
    assert alive([pids["worker"]])  # its own session, its parents dead: only recorded
    stop_recorded(fake.dir)
    assert wait_for(lambda: not alive([pids["worker"]]))


def test_stop_in_process_after_the_server_died_stops_its_family(fake):
    stack, pids = fake.start()
    next(p for p in stack.procs if p.name == "prefill-0").popen.send_signal(signal.SIGKILL)
    stack.stop()
    assert wait_for(lambda: not alive(pids.values())), alive(pids.values())
    assert read_state(fake.dir) is None


def test_up_over_leftovers_stops_them_first_then_starts(fake):
    stack, old = fake.start()
    kill9(stack, "prefill-0", "router")  # a live one would be "already running"
    again, new = fake.start()  # the worker still holds a port of the plan
    try:
        assert not alive(old.values())
        assert any("already gone; stopped what it left running" in line
                   for line in again.cleaned), again.cleaned
        assert read_state(fake.dir).record("prefill-0").pid == new["server"][0]
    finally:
        again.stop()
    assert wait_for(lambda: not alive(new.values()))


def test_a_port_held_by_a_stranger_fails_naming_its_pid(fake):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import socket, sys, time
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", {fake.hold_port})); s.listen()
        print("ready", flush=True); time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(PortInUse, match=rf"port {fake.hold_port} \(prefill-0 nixl side "
                           rf"channel\) is in use on 127.0.0.1 by pid {holder.pid} "):
            LocalStack(fake.plan(), fake.dir).start(timeout=10, progress=False)
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()


STRANGER = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(child.pid, flush=True)
    time.sleep(60)
""")


def test_a_stranger_with_a_recorded_pid_or_group_id_is_not_touched(tmp_path):
    # A group leader and a child in its group; the leader has a pid the state file
    # records, from an earlier process (another start time).
    leader = subprocess.Popen([sys.executable, "-c", STRANGER], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    child = (0, None)
    try:
        child_pid = int(leader.stdout.readline())
        child = (child_pid, process_start_time(child_pid))
        lead = (leader.pid, process_start_time(leader.pid))
        assert os.getpgid(child_pid) == leader.pid

        def record(descendants):
            from bidirkv.local.state import ProcRecord
            write_state(tmp_path, StackState("s.yaml", "http://127.0.0.1:1", "up", [
                ProcRecord("prefill-0", "prefill", leader.pid, lead[1] - 1, "u", "l",
                           descendants=descendants)]))

        record(((child_pid, child[1] + 1),))
        assert stop_recorded(tmp_path) == [f"prefill-0: pid {leader.pid} already gone"]
        assert alive([lead, child]) == [lead, child]
        # The leader gone, its group lives on under its id: still not ours (no token,
        # no recorded member).
        leader.kill()
        leader.wait()
        record(())
        assert stop_recorded(tmp_path) == [f"prefill-0: pid {leader.pid} already gone"]
        time.sleep(0.3)
        assert alive([child]) == [child]
    finally:
        leader.kill()
        leader.wait()
        if child[1] is not None:
            signal_exact(child[0], child[1], signal.SIGKILL)


def test_state_keeps_descendants_and_token_and_reads_older_files(tmp_path):
    from bidirkv.local.state import ProcRecord

    rec = ProcRecord("prefill-0", "prefill", 10, 99, "u", "l", 5, ((11, 100), (12, 101)))
    state = StackState("s.yaml", "http://127.0.0.1:1", "up", [rec])
    write_state(tmp_path, state)
    back = read_state(tmp_path)
    assert back == state and back.token and back.procs[0].descendants == ((11, 100), (12, 101))
    # Written before descendants and the token existed: read, with nothing to prove by.
    older = state.to_json()
    del older["token"], older["procs"][0]["descendants"]
    assert StackState.from_json(older).token is None
    assert StackState.from_json(older).procs[0].descendants == ()
