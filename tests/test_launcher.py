import json

import pytest

from bidirkv.connector.launcher import main, preflight_errors
from bidirkv.operator.api.spec import parse_spec
from bidirkv.roleconfig import build_role_config


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
    from bidirkv.connector.targets import Target

    monkeypatch.setattr(plugin, "REQUIRED_TARGETS", [
        *plugin.REQUIRED_TARGETS,
        Target("vllm.v1.core.sched.scheduler", "Scheduler.gone_in_this_release"),
        Target("vllm.v1.core.sched.scheduler", "Scheduler.schedule", ("self", "other")),
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
