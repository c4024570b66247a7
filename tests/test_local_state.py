"""State file and port checks of the local stack."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from bidirkv.local.ports import (
    PortInUse,
    check_ports,
    duplicates,
    ephemeral_range,
    free_ports,
    port_free,
    sequential_ports,
)
from bidirkv.local.procs import process_start_time, same_process
from bidirkv.local.stack import stop_recorded
from bidirkv.local.state import ProcRecord, StackState, read_state, state_path, write_state


def record(name: str, pid: int, started_at: int | None) -> ProcRecord:
    return ProcRecord(name, "prefill", pid, started_at, "http://127.0.0.1:1", "/tmp/x.log", 5)


def test_state_round_trip(tmp_path):
    state = StackState("spec.yaml", "http://127.0.0.1:8000", "up",
                       [record("prefill-0", 123, 456)], {"router http": 8000})
    path = write_state(tmp_path, state)
    assert path == state_path(tmp_path)
    back = read_state(tmp_path)
    assert back == state
    assert back.urls("prefill") == ["http://127.0.0.1:1"]
    assert back.record("prefill-0").pid == 123
    assert not list(tmp_path.glob("*.tmp"))  # written via rename


def test_missing_and_corrupt_state(tmp_path):
    assert read_state(tmp_path) is None
    state_path(tmp_path).write_text("{not json")
    with pytest.raises(ValueError, match="stack.json"):
        read_state(tmp_path)
    state_path(tmp_path).write_text('{"procs": []}')
    with pytest.raises(ValueError, match="not a local stack state file"):
        read_state(tmp_path)


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)


def test_process_identity_survives_only_for_the_same_process():
    proc = sleeper()
    try:
        started = process_start_time(proc.pid)
        assert started is not None
        assert same_process(proc.pid, started)
        assert not same_process(proc.pid, started + 1)  # a recycled pid
    finally:
        proc.kill()
        proc.wait()
    assert not same_process(proc.pid, started)


def test_down_stops_recorded_groups_and_skips_recycled_pids(tmp_path):
    ours, stranger = sleeper(), sleeper()
    try:
        write_state(tmp_path, StackState("s.yaml", "http://127.0.0.1:1", "up", [
            record("prefill-0", ours.pid, process_start_time(ours.pid)),
            # Same pid number as a live process, another start time: never signalled.
            record("decode-0", stranger.pid, (process_start_time(stranger.pid) or 0) + 7),
            record("router", 2**22 + 12345, 1),
        ]))
        done = stop_recorded(tmp_path)
        assert ours.wait(timeout=20) is not None
        assert stranger.poll() is None
        assert done == [f"router: pid {2**22 + 12345} already gone",
                        f"decode-0: pid {stranger.pid} already gone",
                        f"prefill-0: stopped pid {ours.pid}"]
        assert read_state(tmp_path) is None
    finally:
        for p in (ours, stranger):
            p.kill()
            p.wait()


def test_ports():
    a, b, c = free_ports(3)
    assert len({a, b, c}) == 3
    # Below the kernel's ephemeral range, where vLLM's own port-0 sockets never land.
    assert max(a, b, c) < ephemeral_range()[0]
    assert sequential_ports(20000, 3) == [20000, 20001, 20002]
    with pytest.raises(ValueError, match="--port-base 80"):
        sequential_ports(80, 3)
    assert duplicates([1, 2, 2, 3, 3]) == {2, 3}


def test_port_in_use_names_the_port_and_its_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not port_free(port)
        with pytest.raises(PortInUse, match=rf"port {port} \(decode-0 http\) is in use"):
            check_ports({"router http": free_ports(1)[0], "decode-0 http": port})
    assert port_free(port)


def test_pid_of_this_process_has_a_start_time():
    assert process_start_time(os.getpid()) is not None
