import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bidirkv.connector.launcher import main, preflight_errors
from bidirkv.connector.supervise import engine_url, exit_code
from bidirkv.operator.api.spec import parse_spec
from bidirkv.roleconfig import build_role_config
from bidirkv.wire import VERSION


def rendered(spec_dict, role):
    rc = build_role_config(parse_spec(spec_dict), role)
    env = {e["name"]: e.get("value", "10.0.0.7") for e in rc.env}
    env["BIDIRKV_HANDLE_KEY"] = "k" * 64  # from the resource's Secret in a pod
    return rc.args, env


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_rendered_config_passes(minimal, role):
    args, env = rendered(minimal["spec"], role)
    assert preflight_errors(role, args, env) == []


def test_efa_needs_devices_and_libfabric(example):
    args, env = rendered(example["spec"], "decode")
    assert preflight_errors("decode", args, env, ["/dev/infiniband/uverbs0"]) == []
    (err,) = preflight_errors("decode", args, env, [])
    assert "no EFA device under /dev/infiniband" in err
    ucx = [a.replace('"LIBFABRIC"', '"UCX"') for a in args]
    errs = preflight_errors("decode", ucx, env, ["/dev/infiniband/uverbs0"])
    assert any("UCX over EFA falls back to TCP" in e for e in errs)


@pytest.mark.parametrize("host", ["", "0.0.0.0", "::"])
def test_unroutable_side_channel_host(minimal, host):
    args, env = rendered(minimal["spec"], "prefill")
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
    (err,) = preflight_errors("prefill", args, env)
    assert err.startswith(f"VLLM_NIXL_SIDE_CHANNEL_HOST={host!r} is not an address")


def test_kv_config_problems(minimal):
    args, env = rendered(minimal["spec"], "prefill")
    i = args.index("--kv-transfer-config") + 1
    assert "is missing" in preflight_errors("prefill", args[: i - 1], env)[0]
    bad = list(args)
    bad[i] = "{not json"
    assert "not valid JSON" in preflight_errors("prefill", bad, env)[0]
    cfg = json.loads(args[i])
    cfg["kv_role"] = "kv_consumer"
    bad[i] = json.dumps(cfg)
    errs = preflight_errors("prefill", bad, env)
    assert any("kv_role='kv_consumer' does not fit role prefill" in e for e in errs)
    # vLLM's own NIXL connector (no module path) would reuse KV on trust.
    for path in (None, "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector"):
        cfg = json.loads(args[i])
        cfg["kv_connector_module_path"] = path
        bad[i] = json.dumps(cfg)
        (err,) = preflight_errors("prefill", bad, env)
        assert err.startswith(f"kv_connector_module_path={path!r}: bidir-kv needs "
                              "'bidirkv.connector.nixl.connector'")


def test_serve_exits_nonzero_with_one_line_per_problem(minimal, capsys, monkeypatch):
    args, env = rendered(minimal["spec"], "decode")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "0.0.0.0")
    monkeypatch.setenv("BIDIRKV_HANDLE_KEY", env["BIDIRKV_HANDLE_KEY"])
    assert main(["--role", "decode", "--", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bidir-kv serve: VLLM_NIXL_SIDE_CHANNEL_HOST")


def test_no_handle_key_refuses_to_start(minimal):
    args, env = rendered(minimal["spec"], "decode")
    del env["BIDIRKV_HANDLE_KEY"]
    (err,) = preflight_errors("decode", args, env)
    assert err.startswith("BIDIRKV_HANDLE_KEY is not set")


def test_a_missing_patch_target_refuses_to_start(minimal, capsys, monkeypatch):
    """A vLLM whose internals moved: the launcher names the version and the target."""
    pytest.importorskip("vllm")
    from bidirkv.connector import launcher, plugin
    from bidirkv.connector.targets import PatchSite

    monkeypatch.setattr(plugin, "REQUIRED_TARGETS", [
        *plugin.REQUIRED_TARGETS,
        PatchSite("vllm.v1.core.sched.scheduler", "Scheduler.gone_in_this_release"),
        PatchSite("vllm.v1.core.sched.scheduler", "Scheduler.schedule", ("self", "other")),
    ])
    errs = launcher.patch_errors()
    assert len(errs) == 2, errs
    assert "Scheduler.gone_in_this_release not found" in errs[0]
    assert errs[0].startswith("vLLM 0.32") and "parameters (self, throttle_prefills)" in errs[1]
    args, env = rendered(minimal["spec"], "decode")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert launcher.main(["--role", "decode", "--skip-nixl-check", "--", *args]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(ln.startswith("bidir-kv serve: vLLM 0.32") for ln in lines)


# -- the launcher as the parent of the server: the drain on SIGTERM -------------------------
CHILD = Path(__file__).with_name("drain_child.py")
HOLDING = {"retainedRequests": 1, "retainedBlocks": 16, "releasingBlocks": 0,
           "activeRequests": 0, "draining": True}
EMPTY = {"retainedRequests": 0, "retainedBlocks": 0, "activeRequests": 0, "draining": True}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(cond, what, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Launched:
    """`supervise` in a process of its own (signal handlers live in a main thread) over
    tests/drain_child.py."""

    def __init__(self, tmp_path, report, drain_s, child_exit=0, call_port=None):
        self.report = tmp_path / "report.json"
        self.log = tmp_path / "child.log"
        self.set_report(report)
        port = _free_port()
        # `call_port`: where the launcher calls its server instead (nothing there).
        self.url = f"http://127.0.0.1:{call_port or port}"
        child = [sys.executable, str(CHILD), str(self.report), str(self.log), str(port),
                 str(child_exit)]
        code = ("import sys; from bidirkv.connector.supervise import supervise; "
                f"sys.exit(supervise({child!r}, {self.url!r}, {drain_s}, poll_s=0.05))")
        # The launcher's own lines, as a server's log holds them (bidirkv/local/drain.py
        # follows them there).
        self.launcher_log = tmp_path / "launcher.log"
        with open(self.launcher_log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", code], stderr=err)
        _wait_for(lambda: "ready" in self.lines_text(), "the child to start")

    def set_report(self, report):
        tmp = self.report.with_suffix(".tmp")
        tmp.write_text(json.dumps(report))
        tmp.replace(self.report)

    def lines_text(self):
        return self.log.read_text() if self.log.exists() else ""

    def lines(self):
        return self.lines_text().splitlines()

    def calls(self):
        return [json.loads(ln[5:]) for ln in self.lines() if ln.startswith("call ")]

    def signals(self):
        return [ln.split()[1] for ln in self.lines() if ln.startswith("signal ")]

    def finish(self):
        self.proc.wait(timeout=30)
        return self.proc.returncode, self.launcher_log.read_text()


def test_sigterm_drains_until_nothing_is_held_then_forwards(tmp_path):
    run = Launched(tmp_path, HOLDING, drain_s=600, child_exit=3)
    run.proc.send_signal(signal.SIGTERM)
    _wait_for(lambda: len(run.calls()) >= 3, "the drain to poll")
    # Still held: the server has not been told to stop.
    assert run.signals() == [] and run.proc.poll() is None
    assert all(c == {"drain": True, "wire": VERSION} for c in run.calls())
    polls_before = len(run.calls())
    run.set_report(EMPTY)  # the last conversation came back and was read
    code, err = run.finish()
    assert code == 3  # vLLM's exit code, passed through
    assert run.signals() == ["SIGTERM"]
    assert len(run.calls()) > polls_before
    assert "drain ended (drained)" in err
    assert "1 conversations held (16 blocks readable)" in err


def test_a_server_holding_nothing_stops_at_once(tmp_path):
    run = Launched(tmp_path, EMPTY, drain_s=600)
    run.proc.send_signal(signal.SIGTERM)
    code, err = run.finish()
    assert code == 0 and run.signals() == ["SIGTERM"]
    assert len(run.calls()) == 1 and "drain ended (drained)" in err


def test_the_deadline_ends_a_drain_that_still_holds(tmp_path):
    run = Launched(tmp_path, HOLDING, drain_s=0.5)
    run.proc.send_signal(signal.SIGTERM)
    code, err = run.finish()
    assert code == 0 and run.signals() == ["SIGTERM"]
    assert "drain ended (deadline)" in err


def test_a_drain_that_reaches_no_engine_says_why(tmp_path):
    """The log said only "unreachable": now it names the error of the last call."""
    run = Launched(tmp_path, HOLDING, drain_s=600, call_port=_free_port())
    run.proc.send_signal(signal.SIGTERM)
    code, err = run.finish()
    assert code == 0 and run.signals() == ["SIGTERM"] and run.calls() == []
    assert "the engine does not answer (no_answer: ConnectionRefusedError: " in err
    assert "drain ended (unreachable: ConnectionRefusedError: " in err


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_forwards_at_once(tmp_path, second):
    run = Launched(tmp_path, HOLDING, drain_s=600)
    run.proc.send_signal(signal.SIGTERM)
    _wait_for(lambda: len(run.calls()) >= 1, "the drain to start")
    run.proc.send_signal(second)
    code, err = run.finish()
    assert run.signals() == [second.name]
    assert f"{second.name}: passed on to vLLM now" in err
    assert "drain ended" not in err


def test_sigint_first_forwards_without_draining(tmp_path):
    run = Launched(tmp_path, HOLDING, drain_s=600)
    run.proc.send_signal(signal.SIGINT)
    code, _ = run.finish()
    assert run.signals() == ["SIGINT"] and run.calls() == []


def test_a_server_killed_by_a_signal_exits_as_a_shell_reports_it():
    assert exit_code(-signal.SIGKILL) == 128 + 9
    assert exit_code(0) == 0 and exit_code(1) == 1


@pytest.mark.parametrize("args, url", [
    ([], "http://127.0.0.1:8000"),
    (["--host", "0.0.0.0", "--port", "8100"], "http://127.0.0.1:8100"),
    (["--host=10.1.2.3", "--port=9000"], "http://10.1.2.3:9000"),
    (["--host", "::", "--port", "8200"], "http://127.0.0.1:8200"),
    (["--host", "fd00::7"], "http://[fd00::7]:8000"),
])
def test_engine_url_from_vllm_args(args, url):
    assert engine_url(args) == url


def test_a_bad_drain_cap_refuses_to_start(minimal):
    args, env = rendered(minimal["spec"], "decode")
    env["BIDIRKV_DRAIN_SECONDS"] = "-5"
    (err,) = preflight_errors("decode", args, env)
    assert err.startswith("BIDIRKV_DRAIN_SECONDS='-5': must be a number of seconds")
