"""`bidir-kv local drain NAME`: SIGTERM to the recorded launcher, progress, its exit."""

from __future__ import annotations

import threading

import pytest
from test_launcher import EMPTY, HOLDING, Launched, _wait_for

from bidirkv.local.drain import drain_server
from bidirkv.local.family import process_start_time
from bidirkv.local.state import ProcRecord, StackState, write_state


def record(tmp_path, name, role, pid, url, log="log"):
    state = StackState(spec_file="x.yaml", router_url="http://127.0.0.1:1", procs=[
        ProcRecord(name, role, pid, process_start_time(pid), url, str(tmp_path / log)),
        ProcRecord("router", "router", 1, None, "http://127.0.0.1:1", "log"),
    ])
    write_state(tmp_path, state)


def test_drain_signals_the_launcher_and_waits_for_it_to_exit(tmp_path):
    run = Launched(tmp_path, HOLDING, drain_s=600)
    url = run.url
    record(tmp_path, "decode-1", "decode", run.proc.pid, url, run.launcher_log.name)

    def come_back():  # the held conversation returns once the drain has been seen
        _wait_for(lambda: len(run.calls()) >= 2, "the drain to poll")
        run.set_report(EMPTY)

    helper = threading.Thread(target=come_back)
    helper.start()
    lines: list[str] = []
    assert drain_server(tmp_path, "decode-1", poll_s=0.05, say=lines.append) is True
    helper.join()
    assert lines[0].startswith(f"decode-1: SIGTERM to pid {run.proc.pid}")
    # The launcher's own progress, from the server's log.
    assert any("s  draining: 1 conversations held (16 blocks readable)" in ln for ln in lines)
    assert any("drain ended (drained)" in ln for ln in lines)
    assert lines[-1].startswith("decode-1: exited after")
    assert run.signals() == ["SIGTERM"]  # vLLM heard of it from the launcher
    run.proc.wait(timeout=10)


def test_drain_names_what_it_cannot_drain(tmp_path):
    with pytest.raises(ValueError, match="no stack recorded"):
        drain_server(tmp_path, "decode-1")
    record(tmp_path, "decode-0", "decode", 1, "http://127.0.0.1:1")
    with pytest.raises(ValueError, match=r"'decode-7' is not an engine of this stack; "
                                         r"engines: decode-0"):
        drain_server(tmp_path, "decode-7")
    with pytest.raises(ValueError, match="'router' is not an engine"):
        drain_server(tmp_path, "router")


def test_a_server_already_gone_is_reported(tmp_path):
    record(tmp_path, "decode-0", "decode", 2 ** 22 + 7, "http://127.0.0.1:1")
    lines: list[str] = []
    assert drain_server(tmp_path, "decode-0", say=lines.append) is True
    assert lines == [f"decode-0: pid {2 ** 22 + 7} is not running"]
