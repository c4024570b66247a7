"""Spec -> local process plan: the rendered containers, with only pod IPs, ports, the
router's ConfigMap and a relative model path mapped."""

from __future__ import annotations

import json
import pathlib

import pytest

from bidirkv.local.engines import LOCAL_OWNER, rendered_container
from bidirkv.local.plan import (
    ENGINE_ENV_PREFIXES,
    cpu_line,
    local_spec,
    merge_patch,
    plan_stack,
    ports_needed,
    process_env,
    read_spec_file,
)
from bidirkv.operator.render.children import router_deployment

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "local.yaml"


@pytest.fixture
def raw(tmp_path) -> dict:
    spec = read_spec_file(EXAMPLE)
    (tmp_path / spec["model"]["name"]).mkdir(parents=True)  # as --tiny-model would
    return spec


@pytest.fixture
def spec(raw, tmp_path):
    return local_spec(raw, tmp_path)


def kv_config(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_example_is_a_cpu_1p1d_with_emulated_eviction(raw, spec):
    assert spec.prefill.initial_replicas() == 1 and spec.decode.initial_replicas() == 1
    assert spec.kv_transfer.kv_buffer_device == "cpu"
    assert spec.prefill.enable_prefix_caching is False
    assert spec.decode.enable_prefix_caching is True
    binds = {role: {e.name: e.value for e in getattr(spec, role).extra_env}
             for role in ("prefill", "decode")}
    assert binds["prefill"]["VLLM_CPU_OMP_THREADS_BIND"] != \
        binds["decode"]["VLLM_CPU_OMP_THREADS_BIND"]
    assert "--enforce-eager" in spec.engine.extra_args
    # Retention is a cap past an agent's tool call (minutes), not a race with the machine's
    # speed; the router below it by the margin the CRD requires.
    assert spec.kv_transfer.decoder_kv_blocks_ttl_seconds >= 300
    assert spec.router.conversation_ttl_seconds >= 120
    assert spec.router.conversation_ttl_seconds + 10 <= \
        spec.kv_transfer.decoder_kv_blocks_ttl_seconds
    # The dtype is left to the local stack, which picks it for the CPU.
    assert raw["model"]["dtype"] == "auto"


def test_local_dtype_auto_becomes_the_cpus_choice_and_an_explicit_one_stays(raw, monkeypatch):
    from bidirkv.local import cli
    from bidirkv.local.cpu import CpuInfo

    avx2 = CpuInfo("AMD EPYC", "x86_64", frozenset({"avx2"}), 2)
    monkeypatch.setattr(cli, "read_cpu", lambda: avx2)
    out, choice = cli.with_local_dtype(raw)
    assert out["model"]["dtype"] == "float32" and choice.picked
    assert raw["model"]["dtype"] == "auto"  # the input is not edited
    kept, choice = cli.with_local_dtype(merge_patch(raw, {"model": {"dtype": "bfloat16"}}))
    assert kept["model"]["dtype"] == "bfloat16" and not choice.picked


def test_relative_model_path_becomes_absolute_and_hub_ids_stay(raw, tmp_path):
    assert local_spec(raw, tmp_path).model.name == \
        str((tmp_path / raw["model"]["name"]).resolve())
    explicit = merge_patch(raw, {"model": {"name": "./m"}})
    with pytest.raises(ValueError, match=r"spec.model.name: './m': no such folder .*--tiny-model"):
        local_spec(explicit, tmp_path)
    (tmp_path / "m").mkdir()
    assert local_spec(explicit, tmp_path).model.name == str(tmp_path / "m")
    hub = merge_patch(raw, {"model": {"name": "Qwen/Qwen3-0.6B"}})
    assert local_spec(hub, tmp_path).model.name == "Qwen/Qwen3-0.6B"


def test_invalid_spec_is_a_one_line_value_error(raw, tmp_path):
    bad = merge_patch(raw, {"router": {"conversationTtlSeconds": 600}})
    with pytest.raises(ValueError, match="conversationTtlSeconds"):
        local_spec(bad, tmp_path)


def test_read_spec_file_errors(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        read_spec_file(tmp_path / "nope.yaml")
    other = tmp_path / "cm.yaml"
    other.write_text("kind: ConfigMap\nmetadata: {name: x}\n")
    with pytest.raises(ValueError, match="no document of kind DisaggregatedInference"):
        read_spec_file(other)
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        read_spec_file(broken)


def test_merge_patch():
    base = {"a": {"b": 1, "c": 2}, "d": [1]}
    assert merge_patch(base, {"a": {"b": 5, "c": None}, "d": [2]}) == {"a": {"b": 5}, "d": [2]}
    assert base == {"a": {"b": 1, "c": 2}, "d": [1]}  # not mutated


def test_ports_needed_per_replica(raw, tmp_path):
    spec = local_spec(merge_patch(raw, {"decode": {"replicas": 2}}), tmp_path)
    assert ports_needed(spec) == [
        "router http", "prefill-0 http", "prefill-0 nixl side channel",
        "decode-0 http", "decode-0 nixl side channel",
        "decode-1 http", "decode-1 nixl side channel",
    ]


def test_plan_runs_the_rendered_containers(spec, tmp_path):
    plan = plan_stack(spec, [9000, 9001, 9002, 9003, 9004], tmp_path)
    assert [s.name for s in plan.servers] == ["prefill-0", "decode-0", "router"]
    for server in plan.engines:
        c = rendered_container(spec, server.role)
        # Same command and arguments, except the two the pod's network decides.
        assert server.argv[1:len(c["command"])] == c["command"][1:]
        args = server.argv[len(c["command"]):]
        assert len(args) == len(c["args"])
        changed = {c["args"][i - 1] for i, (a, b) in enumerate(zip(args, c["args"],
                                                                     strict=True)) if a != b}
        assert changed == {"--host", "--port"}
        assert args[args.index("--host") + 1] == "127.0.0.1"
        assert args[args.index("--port") + 1] == str(server.http_port)
        # Every rendered variable, except the optional previous key (no rotation here).
        rendered_env = {e["name"] for e in c["env"]} - {"BIDIRKV_HANDLE_KEY_PREVIOUS"}
        assert set(server.env) == rendered_env
        assert server.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert server.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(server.nixl_port)
    p, d = plan.engines
    # One fresh key per stack, the same for every engine and the router.
    key = p.env["BIDIRKV_HANDLE_KEY"]
    assert len(key) == 64 and d.env["BIDIRKV_HANDLE_KEY"] == key
    assert plan.router.env["BIDIRKV_HANDLE_KEY"] == key
    assert plan_stack(spec, [9000, 9001, 9002, 9003, 9004], tmp_path).engines[0].env[
        "BIDIRKV_HANDLE_KEY"] != key
    assert (p.http_port, p.nixl_port, d.http_port, d.nixl_port) == (9001, 9002, 9003, 9004)
    assert p.health_url == "http://127.0.0.1:9001/health"
    assert kv_config(p.argv)["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True


def test_router_runs_the_rendered_deployment_with_a_local_config(spec, tmp_path):
    plan = plan_stack(spec, [9000, 9001, 9002, 9003, 9004], tmp_path)
    c = router_deployment(LOCAL_OWNER, spec)["spec"]["template"]["spec"]["containers"][0]
    argv = plan.router.argv
    assert argv[1:len(c["command"])] == c["command"][1:]
    assert argv[argv.index("--config") + 1] == str(tmp_path / "router.json")
    assert argv[argv.index("--port") + 1] == "9000"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert plan.router.health_url == "http://127.0.0.1:9000/ready"
    assert plan.router_config["prefill"] == ["http://127.0.0.1:9001"]
    assert plan.router_config["decode"] == ["http://127.0.0.1:9003"]
    assert plan.router_config["bidirectional"] is True
    assert plan.ports == {"router http": 9000, "prefill-0 http": 9001,
                          "prefill-0 nixl side channel": 9002, "decode-0 http": 9003,
                          "decode-0 nixl side channel": 9004}


def test_off_means_off_on_the_servers_and_the_router(raw, tmp_path):
    spec = local_spec(merge_patch(raw, {"kvTransfer": {"bidirectional": False}}), tmp_path)
    plan = plan_stack(spec, [9000, 9001, 9002, 9003, 9004], tmp_path)
    for server in plan.engines:
        extra = kv_config(server.argv)["kv_connector_extra_config"]
        assert extra["bidirectional_kv_xfer"] is False
    assert plan.router_config["bidirectional"] is False


def test_plan_refuses_wrong_or_repeated_ports(spec, tmp_path):
    with pytest.raises(ValueError, match="5 ports needed"):
        plan_stack(spec, [9000, 9001], tmp_path)
    with pytest.raises(ValueError, match="distinct"):
        plan_stack(spec, [9000, 9001, 9001, 9003, 9004], tmp_path)


def test_process_env_keeps_the_host_but_not_its_engine_variables():
    base = {"PATH": "/bin", "HOME": "/root", "VLLM_CPU_KVCACHE_SPACE": "40", "UCX_TLS": "rc",
            "BIDIRKV_IDLE_POLL_MS": "0", "OMP_NUM_THREADS": "8"}
    env = process_env({"UCX_TLS": "tcp,self,sm", "BIDIRKV_ROLE": "prefill"}, base)
    assert env == {"PATH": "/bin", "HOME": "/root", "UCX_TLS": "tcp,self,sm",
                   "BIDIRKV_ROLE": "prefill"}
    assert all(k.startswith(ENGINE_ENV_PREFIXES) for k in set(base) - set(env))


def test_local_addresses_come_from_render_itself(spec, tmp_path):
    """The local stack runs render's output for a local placement, unedited."""
    from bidirkv.local.engines import LocalPorts, rendered_container

    plan = plan_stack(spec, [9000, 9001, 9002, 9003, 9004], tmp_path)
    for server in plan.engines:
        c = rendered_container(spec, server.role, LocalPorts(server.http_port,
                                                             server.nixl_port))
        assert server.argv[len(c["command"]):] == c["args"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(server.nixl_port)
        assert c["ports"] == [{"name": "http", "containerPort": server.http_port,
                               "protocol": "TCP"},
                              {"name": "nixl", "containerPort": server.nixl_port,
                               "protocol": "TCP"}]


def test_the_router_is_planned_off_the_cores_decode_binds(raw, spec, tmp_path):
    ports = [9000, 9001, 9002, 9003, 9004]
    plan = plan_stack(spec, ports, tmp_path, available_cores=frozenset({0, 1}))
    assert plan.router.cpus == frozenset({0})  # examples/local.yaml binds decode to core 1
    assert [e.cpus for e in plan.engines] == [None, None]  # vLLM places its own threads
    assert cpu_line(plan) == "router on cores 0 (decode binds 1)"
    assert plan_stack(spec, ports, tmp_path).router.cpus is None  # cores unknown
    free = merge_patch(raw, {"decode": {"extraEnv": [
        {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "auto"}]}})
    plan = plan_stack(local_spec(free, tmp_path), ports, tmp_path,
                      available_cores=frozenset({0, 1}))
    assert plan.router.cpus is None
    assert cpu_line(plan) == ("router not pinned: decode-0's VLLM_CPU_OMP_THREADS_BIND is "
                              "'auto': vLLM picks the cores when it starts")
