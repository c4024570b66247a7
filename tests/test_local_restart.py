"""`bidir-kv local restart NAME`: stop a server (SIGTERM, or SIGKILL with --drop) and
start it again with the command, environment and directory it ran with."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import textwrap
import urllib.request

import pytest

from bidirkv.local import cli
from bidirkv.local.family import process_start_time, same_process
from bidirkv.local.procs import Proc
from bidirkv.local.restart import parse_environ, read_command, restart_server, split_nul
from bidirkv.local.state import ProcRecord, StackState, read_state, write_state

# A stand-in router: /ready answers its pid and the marker from its environment; it
# exits on SIGTERM (Python's default) as the router does.
SERVER = textwrap.dedent("""
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            out = json.dumps({"pid": os.getpid(), "marker": os.environ.get("MARKER"),
                              "cwd": os.getcwd()}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass

    HTTPServer.allow_reuse_address = True
    HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


ONE_CORE = frozenset({max(os.sched_getaffinity(0))})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> dict:
    with urllib.request.urlopen(url + "/ready", timeout=5) as r:
        return json.loads(r.read())


@pytest.fixture
def router(tmp_path):
    port = free_port()
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    workdir = tmp_path / "work"
    workdir.mkdir()
    url = f"http://127.0.0.1:{port}"
    # On one core, as `local up` may pin the router (local/cpuset.py).
    proc = Proc("router", [sys.executable, str(script), str(port)],
                {**os.environ, "MARKER": "same-env"}, tmp_path / "router.log",
                url + "/ready", cpus=ONE_CORE).start(cwd=str(workdir))
    proc.wait_healthy(30)
    write_state(tmp_path, StackState(spec_file="x.yaml", router_url=url, procs=[
        ProcRecord("router", "router", proc.pid, proc.started_at, url,
                   str(tmp_path / "router.log"))]))
    yield proc, url, workdir
    state = read_state(tmp_path)
    for pid in {proc.pid, *(p.pid for p in state.procs if p.name == "router")}:
        if same_process(pid, process_start_time(pid)):
            os.kill(pid, 9)
    proc.stop()


def test_proc_fields_parse():
    assert split_nul(b"a\0b c\0\0") == ["a", "b c"]
    assert parse_environ(b"A=1\0B=x=y\0junk\0") == {"A": "1", "B": "x=y"}
    me = read_command(os.getpid())
    assert me.env.get("PATH") == os.environ.get("PATH")
    assert me.cwd == os.getcwd()
    assert me.cpus == os.sched_getaffinity(0)
    with pytest.raises(ValueError, match=r"cannot read how pid 4194311 was started"):
        read_command(2 ** 22 + 7)


@pytest.mark.parametrize("drop", [False, True])
def test_restart_starts_the_same_command_again_and_records_it(tmp_path, router, drop):
    proc, url, workdir = router
    first = get(url)
    lines: list[str] = []
    done = restart_server(tmp_path, "router", drop=drop, start_timeout=30,
                          say=lines.append)
    assert done.stopped.how == ("drop" if drop else "drain") and done.stopped.exited
    # Killed, or stopped by its SIGTERM: the exit status says which.
    assert proc.popen.wait(timeout=5) == (-9 if drop else -15)
    again = get(url)
    assert again["pid"] == done.record.pid != first["pid"]
    assert again["marker"] == "same-env" and again["cwd"] == str(workdir)
    assert os.sched_getaffinity(again["pid"]) == ONE_CORE
    rec = read_state(tmp_path).record("router")
    assert (rec.pid, rec.started_at) == (done.record.pid, process_start_time(rec.pid))
    assert lines[0].startswith("router: SIGKILL" if drop else "router: SIGTERM")
    assert lines[-1].startswith("router: serving again after")


def test_restart_names_what_it_cannot_restart(tmp_path, router):
    with pytest.raises(ValueError, match="'decode-9' is not a server of this stack; "
                                         "servers: router"):
        restart_server(tmp_path, "decode-9")
    with pytest.raises(ValueError, match="no stack recorded"):
        restart_server(tmp_path / "nothing", "router")
    state = read_state(tmp_path)
    state.procs = [ProcRecord("decode-0", "decode", 2 ** 22 + 7, None, "http://x", "log")]
    write_state(tmp_path, state)
    with pytest.raises(ValueError, match=r"decode-0 \(pid 4194311\) is not running"):
        restart_server(tmp_path, "decode-0")


def test_the_cli_verb_restarts_and_says_what_it_did(tmp_path, router, capsys):
    _, url, _ = router
    first = get(url)["pid"]
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["restart", "router", "--state-dir", str(tmp_path),
                         "--start-timeout", "30"])
    assert cli.run(args) == 0
    assert get(url)["pid"] != first
    err = capsys.readouterr().err
    assert f"bidir-kv local restart: router: SIGTERM to pid {first}" in err
    assert "bidir-kv local restart: router: serving again after" in err
    bad = p.parse_args(["restart", "decode-9", "--state-dir", str(tmp_path)])
    assert cli.run(bad) == 1
    assert "'decode-9' is not a server of this stack" in capsys.readouterr().err
