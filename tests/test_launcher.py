import json

import pytest

from bidirkv.connector.launcher import main, preflight_errors
from bidirkv.connector.roleconfig import build_role_config
from bidirkv.operator.spec import parse_spec


def rendered(spec_dict, role):
    rc = build_role_config(parse_spec(spec_dict), role)
    env = {e["name"]: e.get("value", "10.0.0.7") for e in rc.env}
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


def test_serve_exits_nonzero_with_one_line_per_problem(minimal, capsys, monkeypatch):
    args, env = rendered(minimal["spec"], "decode")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "0.0.0.0")
    assert main(["--role", "decode", "--", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bidir-kv serve: VLLM_NIXL_SIDE_CHANNEL_HOST")
