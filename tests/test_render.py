import copy
import json

import pytest

from bidirkv.operator.api.spec import SpecError, parse_spec
from bidirkv.operator.render.children import render_resource
from bidirkv.roleconfig import build_role_config, kv_fingerprint
from bidirkv.router.config import RouterConfig
from kubeapi.schemas import KUBE_VERSIONS, schema_errors


def by_kind_name(objs):
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def container(objs, name):
    return by_kind_name(objs)[("StatefulSet", name)]["spec"]["template"]["spec"]["containers"][0]


def kv_config(c):
    args = c["args"]
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def env(c):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_child_is_valid_for_strict_schemas(example, minimal, version):
    for doc in (example, minimal):
        for obj in render_resource(doc):
            assert schema_errors(obj, version) == []


def test_children_and_owner_references(minimal):
    objs = render_resource(minimal)
    assert sorted(by_kind_name(objs)) == [
        ("ConfigMap", "tiny-router"),
        ("Deployment", "tiny-router"),
        ("NetworkPolicy", "tiny-engines"),
        ("NetworkPolicy", "tiny-router"),
        ("PodDisruptionBudget", "tiny-decode"),
        ("PodDisruptionBudget", "tiny-prefill"),
        ("Service", "tiny-decode"),
        ("Service", "tiny-prefill"),
        ("Service", "tiny-router"),
        ("StatefulSet", "tiny-decode"),
        ("StatefulSet", "tiny-prefill"),
    ]
    for obj in objs:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref["uid"] == "u-1" and ref["controller"] is True
        assert obj["metadata"]["namespace"] == "ns1"
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == "tiny"
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "bidir-kv-operator"


@pytest.mark.parametrize(("status", "secret"), [
    (None, "tiny-handle-key-u-1"),  # before the first pass: the first name tried
    ({"handleKey": {"name": "tiny-handle-key-u-1-x7k2p", "uid": "s-1"}},
     "tiny-handle-key-u-1-x7k2p"),  # the one the status records
])
def test_engines_and_router_read_the_key_from_the_secret_and_mount_no_token(minimal, status,
                                                                            secret):
    if status is not None:
        minimal["status"] = status
    objs = by_kind_name(render_resource(minimal))
    ref = {"secretKeyRef": {"name": secret, "key": "current"}}
    for kind, name in (("StatefulSet", "tiny-prefill"), ("StatefulSet", "tiny-decode"),
                       ("Deployment", "tiny-router")):
        pod = objs[(kind, name)]["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        e = env(pod["containers"][0])
        assert e["BIDIRKV_HANDLE_KEY"] == ref
        assert e["BIDIRKV_HANDLE_KEY_PREVIOUS"]["secretKeyRef"] == {
            "name": secret, "key": "previous", "optional": True}
    # Rendering references the Secret; the operator creates it (never rendered).
    assert not any(k[0] == "Secret" for k in objs)


def test_network_policies_isolate_the_engines(minimal):
    minimal["spec"]["networkPolicy"] = {
        "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
        "routerFrom": [{"podSelector": {"matchLabels": {"role": "agent"}}}]}
    objs = by_kind_name(render_resource(minimal))
    eng = objs[("NetworkPolicy", "tiny-engines")]["spec"]
    assert eng["podSelector"]["matchExpressions"] == [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["prefill", "decode"]}]
    peers, http = eng["ingress"]
    assert "ports" not in peers  # engines reach each other on any port (UCX picks them)
    assert peers["from"] == [{"podSelector": eng["podSelector"]}]
    assert http["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert http["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == \
        "router"
    assert http["from"][1] == {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}
    # The operator reads a draining decode's /metrics: its pods by the chart's labels
    # (tests/test_chart.py holds the chart to them); not told its namespace, in the
    # resource's own only (tests/test_netpol.py: from the operator's namespace).
    assert http["from"][2] == {"podSelector": {"matchLabels": {
        "app.kubernetes.io/part-of": "bidir-kv", "app.kubernetes.io/component": "operator"}}}
    for version in KUBE_VERSIONS:
        for name in ("tiny-engines", "tiny-router"):
            assert schema_errors(objs[("NetworkPolicy", name)], version) == []
    router = objs[("NetworkPolicy", "tiny-router")]["spec"]["ingress"]
    assert router == [{"ports": [{"protocol": "TCP", "port": 8000}],
                       "from": [{"podSelector": {"matchLabels": {"role": "agent"}}}]},
                      {"ports": [{"protocol": "TCP", "port": 9090}],
                       "from": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]}]
    c = objs[("Deployment", "tiny-router")]["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][c["args"].index("--metrics-port") + 1] == "9090"
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in c["ports"]
    minimal["spec"]["networkPolicy"] = {"enabled": False}
    assert not any(k[0] == "NetworkPolicy" for k in by_kind_name(render_resource(minimal)))


def test_defaults_reach_the_vllm_config(minimal):
    objs = render_resource(minimal)
    for role in ("prefill", "decode"):
        c = container(objs, f"tiny-{role}")
        cfg = kv_config(c)
        assert cfg["kv_connector"] == "NixlConnector"
        extra = cfg["kv_connector_extra_config"]
        assert extra == {"backends": ["UCX"], "bidirectional_kv_xfer": True,
                         "decoder_kv_blocks_ttl": 480, "kv_recompute_threshold": 64}
        assert env(c)["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {
            "fieldRef": {"fieldPath": "status.podIP"}}
        assert env(c)["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
        assert not any(k.startswith("FI_") for k in env(c))
        assert c["command"] == ["bidir-kv", "serve", "--role", role, "--"]
    headless = by_kind_name(objs)[("Service", "tiny-decode")]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True


def test_residency_knobs_reach_router_and_both_roles(minimal):
    minimal["spec"]["kvTransfer"] = {"retentionWatermark": 0.3, "ownerLeaseSeconds": 45}
    objs = render_resource(minimal)
    for role in ("prefill", "decode"):
        e = env(container(objs, f"tiny-{role}"))
        assert e["BIDIRKV_RETENTION_WATERMARK"] == "0.3"
        assert e["BIDIRKV_OWNER_LEASE_SECONDS"] == "45"
        assert e["VLLM_PLUGINS"] == "bidirkv"  # loads the /bidirkv/residency route
    cfg = json.loads(by_kind_name(objs)[("ConfigMap", "tiny-router")]["data"]["router.json"])
    assert cfg["retentionWatermark"] == 0.3 and cfg["ownerLeaseSeconds"] == 45


def test_tenant_caps_reach_the_router(minimal):
    cfg = json.loads(by_kind_name(render_resource(minimal))[("ConfigMap", "tiny-router")]
                     ["data"]["router.json"])
    assert cfg["tenantRetentionShare"] == 1.0 and "maxConversationsPerTenant" not in cfg
    minimal["spec"]["router"] = {"maxConversationsPerTenant": 500,
                                 "tenantRetentionShare": 0.25}
    cfg = json.loads(by_kind_name(render_resource(minimal))[("ConfigMap", "tiny-router")]
                     ["data"]["router.json"])
    assert cfg["maxConversationsPerTenant"] == 500 and cfg["tenantRetentionShare"] == 0.25
    RouterConfig.model_validate(cfg)  # what the router reads, it accepts


def test_shared_handle_store_reaches_the_router(minimal):
    minimal["spec"]["router"] = {"replicas": 2, "handleStore": {
        "url": "redis://valkey:6379/0", "passwordSecretRef": {"name": "vk", "key": "pw"}}}
    objs = by_kind_name(render_resource(minimal))
    cfg = json.loads(objs[("ConfigMap", "tiny-router")]["data"]["router.json"])
    assert cfg["handleStore"] == "redis://valkey:6379/0"
    router = objs[("Deployment", "tiny-router")]["spec"]["template"]["spec"]["containers"][0]
    assert env(router)["BIDIRKV_HANDLE_STORE_PASSWORD"] == {
        "secretKeyRef": {"name": "vk", "key": "pw"}}
    from bidirkv.router.config import parse_config

    assert parse_config(cfg).handle_store == cfg["handleStore"]  # the router accepts it


def test_bidirectional_off_on_both_roles(minimal):
    minimal["spec"]["kvTransfer"] = {"bidirectional": False}
    objs = render_resource(minimal)
    roles = {kv_config(container(objs, f"tiny-{r}"))["kv_role"] for r in ("prefill", "decode")}
    assert roles == {"kv_producer", "kv_consumer"}
    for r in ("prefill", "decode"):
        extra = kv_config(container(objs, f"tiny-{r}"))["kv_connector_extra_config"]
        assert extra["bidirectional_kv_xfer"] is False and "decoder_kv_blocks_ttl" not in extra
    cfg = json.loads(by_kind_name(objs)[("ConfigMap", "tiny-router")]["data"]["router.json"])
    assert cfg["bidirectional"] is False


def test_efa_profile(example):
    objs = render_resource(example)
    for role in ("prefill", "decode"):
        sts = by_kind_name(objs)[("StatefulSet", f"qwen3-32b-{role}")]
        pod = sts["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert env(c)["FI_PROVIDER"] == "efa"
        assert env(c)["FI_EFA_USE_DEVICE_RDMA"] == "1"
        assert env(c)["FI_EFA_USE_HUGE_PAGE"] == "1"
        assert kv_config(c)["kv_connector_extra_config"]["backends"] == ["LIBFABRIC"]
        assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == 16
        assert c["resources"]["requests"]["hugepages-2Mi"] == "5Gi"
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {
            "drop": ["ALL"], "add": ["IPC_LOCK"]}}
        assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
        assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in pod[
            "volumes"]
        other = "decode" if role == "prefill" else "prefill"
        (term,) = pod["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == other
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert "--tensor-parallel-size" in c["args"] and "8" in c["args"]


def test_user_affinity_is_kept_beside_the_efa_anti_affinity(example):
    node_aff = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "node.kubernetes.io/instance-type", "operator": "In",
             "values": ["p5en.48xlarge"]}]}]}}}
    example["spec"]["decode"]["affinity"] = copy.deepcopy(node_aff)
    pod = by_kind_name(render_resource(example))[("StatefulSet", "qwen3-32b-decode")][
        "spec"]["template"]["spec"]
    assert pod["affinity"]["nodeAffinity"] == node_aff["nodeAffinity"]
    assert "podAntiAffinity" in pod["affinity"]
    assert example["spec"]["decode"]["affinity"] == node_aff  # input not mutated


def templates(objs):
    return {k: o["spec"]["template"] for k, o in by_kind_name(objs).items()
            if o["kind"] in ("StatefulSet", "Deployment")}


def test_ttl_knob_rolls_engines_not_router(minimal):
    before = render_resource(minimal)
    minimal["spec"]["kvTransfer"] = {"decoderKvBlocksTtlSeconds": 900}
    after = render_resource(minimal)
    tb, ta = templates(before), templates(after)
    assert tb[("Deployment", "tiny-router")] == ta[("Deployment", "tiny-router")]
    for role in ("prefill", "decode"):
        key = ("StatefulSet", f"tiny-{role}")
        assert tb[key] != ta[key]
        assert (tb[key]["metadata"]["annotations"] != ta[key]["metadata"]["annotations"])
    cfg = json.loads(by_kind_name(after)[("ConfigMap", "tiny-router")]["data"]["router.json"])
    assert cfg["decoderKvBlocksTtlSeconds"] == 900


def test_router_ttl_changes_only_the_router_config(minimal):
    before = by_kind_name(render_resource(minimal))
    minimal["spec"]["router"] = {"conversationTtlSeconds": 100}
    after = by_kind_name(render_resource(minimal))
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {("ConfigMap", "tiny-router")}


def test_scale_changes_replicas_and_endpoints_only(minimal):
    before = by_kind_name(render_resource(minimal))
    minimal["spec"]["decode"] = {"replicas": 3}
    after = by_kind_name(render_resource(minimal))
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {("StatefulSet", "tiny-decode"), ("ConfigMap", "tiny-router")}
    sts_b, sts_a = before[("StatefulSet", "tiny-decode")], after[("StatefulSet", "tiny-decode")]
    assert sts_a["spec"]["replicas"] == 3
    assert sts_b["spec"]["template"] == sts_a["spec"]["template"]
    cfg = json.loads(after[("ConfigMap", "tiny-router")]["data"]["router.json"])
    assert cfg["decode"] == [
        f"http://tiny-decode-{i}.tiny-decode.ns1.svc:8000" for i in range(3)]


def test_fingerprint_covers_shared_settings_only(minimal):
    base = parse_spec(minimal["spec"])
    fp = kv_fingerprint(base)
    scaled = parse_spec({**minimal["spec"], "decode": {"replicas": 5}})
    assert kv_fingerprint(scaled) == fp
    for change in ({"model": {"name": "facebook/opt-125m", "dtype": "float32"}},
                   {"engine": {"image": "other:1"}},
                   {"kvTransfer": {"backend": "LIBFABRIC"}}):
        assert kv_fingerprint(parse_spec({**minimal["spec"], **change})) != fp
    objs = by_kind_name(render_resource(minimal))
    labels = {objs[("StatefulSet", f"tiny-{r}")]["spec"]["template"]["metadata"]["labels"][
        "bidirkv.io/kv-fingerprint"] for r in ("prefill", "decode")}
    assert labels == {fp}


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"engine": {"extraArgs": ["--block-size", "16", "--port=9000"]}},
         "spec.engine.extraArgs[2]: '--port=9000' is managed"),
        ({"engine": {"extraEnv": [{"name": "FI_PROVIDER", "value": "tcp"}]}},
         "spec.engine.extraEnv[0].name: 'FI_PROVIDER' is managed"),
        ({"router": {"conversationTtlSeconds": 475}},
         "spec.router.conversationTtlSeconds: 475 must be at most 470"),
        ({"efa": {"enabled": True}, "prefill": {"efaDevices": 1}, "decode": {"efaDevices": 1}},
         "spec.kvTransfer.backend: 'UCX' must be 'LIBFABRIC'"),
        ({"prefill": {"efaDevices": 2}}, "spec.prefill.efaDevices: 2 must be 0"),
        ({"prefill": {"replicas": 0}}, "spec.prefill.replicas: 0: Input should be greater"),
        ({"kvTransfer": {"kvRecomputeThreshold": -1}},
         "spec.kvTransfer.kvRecomputeThreshold: -1"),
        ({"prefill": {"resources": {"limits": {"memory": "lots"}}}},
         "spec.prefill.resources.limits.memory"),
        ({"model": {"name": "m", "dtype": "int3"}}, "spec.model.dtype: 'int3'"),
        ({"kvTransfr": {}}, "spec.kvTransfr: {...}: Extra inputs are not permitted"),
        ({"kvTransfer": {"ownerLeaseSeconds": 600}},
         "spec.kvTransfer.ownerLeaseSeconds: 600 must be at most"),
        ({"kvTransfer": {"retentionWatermark": 2}}, "spec.kvTransfer.retentionWatermark: 2"),
        ({"router": {"replicas": 3}}, "spec.router.replicas: 3 needs spec.router.handleStore"),
        ({"networkPolicy": {"routerFrom": [{}]}},
         "spec.networkPolicy.routerFrom[0]: needs namespaceSelector or podSelector"),
        ({"engine": {"extraEnv": [{"name": "BIDIRKV_HANDLE_KEY", "value": "x"}]}},
         "'BIDIRKV_HANDLE_KEY' is managed"),
    ],
)
def test_bad_specs_name_the_field(minimal, change, expected):
    minimal["spec"].update(change)
    with pytest.raises(SpecError) as err:
        render_resource(minimal)
    assert expected in str(err.value)


def test_long_name_refused(minimal):
    minimal["metadata"]["name"] = "n" * 41
    with pytest.raises(SpecError, match="metadata.name: 'n{41}' has 41 characters; at most 40"):
        render_resource(minimal)


def test_role_config_is_shared_by_both_roles(example):
    spec = parse_spec(example["spec"])
    p, d = build_role_config(spec, "prefill"), build_role_config(spec, "decode")
    assert p.kv_transfer_config == d.kv_transfer_config
    assert "--no-enable-prefix-caching" in p.args and "--enable-prefix-caching" in d.args
    with pytest.raises(ValueError, match="role 'router': must be one of prefill, decode"):
        build_role_config(spec, "router")


def test_hugepages_need_a_cpu_or_memory_request(example):
    del example["spec"]["decode"]["resources"]["requests"]
    with pytest.raises(SpecError, match=r"spec.decode.resources: efa.hugepages2Mi needs a cpu"):
        render_resource(example)


def test_the_router_accepts_the_rendered_config(example):
    from bidirkv.router.config import parse_config

    objs = by_kind_name(render_resource(example))
    data = json.loads(objs[("ConfigMap", "qwen3-32b-router")]["data"]["router.json"])
    cfg = parse_config(data, "router.json")
    assert len(cfg.decode) == 2 and len(cfg.prefill) == 1
    assert cfg.handle_ttl_seconds == 420
    assert cfg.kv_fingerprint == data["kvFingerprint"]
    dep = objs[("Deployment", "qwen3-32b-router")]["spec"]["template"]["spec"]
    args = dep["containers"][0]["args"]
    mount = dep["containers"][0]["volumeMounts"][0]["mountPath"]
    assert args[args.index("--config") + 1] == f"{mount}/router.json"


def test_role_env_follows_engine_env_and_buffer_device(minimal):
    b = "OMP_NUM_THREADS"  # one a role may set alone
    minimal["spec"]["engine"] = {"extraEnv": [{"name": "A", "value": "1"},
                                              {"name": b, "value": "x"}]}
    minimal["spec"]["decode"] = {"extraEnv": [{"name": b, "value": "decode"}]}
    minimal["spec"]["kvTransfer"] = {"kvBufferDevice": "cpu"}
    objs = render_resource(minimal)
    assert env(container(objs, "tiny-prefill"))[b] == "x"
    dec = container(objs, "tiny-decode")
    assert env(dec)[b] == "decode" and env(dec)["A"] == "1"
    assert [e["name"] for e in dec["env"]].count(b) == 1
    assert kv_config(dec)["kv_buffer_device"] == "cpu"
    assert "kv_buffer_device" not in kv_config(container(render_resource(
        {**minimal, "spec": {"model": {"name": "m"}}}), "tiny-decode"))


def test_role_env_managed_names_refused(minimal):
    minimal["spec"]["prefill"] = {"extraEnv": [{"name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
                                                "value": "0.0.0.0"}]}
    with pytest.raises(SpecError, match=r"spec.prefill.extraEnv\[0\].name"):
        render_resource(minimal)


def test_engines_without_efa_keep_no_capability_and_cannot_escalate(minimal):
    for obj in render_resource(minimal):
        if obj["kind"] != "StatefulSet":
            continue
        pod = obj["spec"]["template"]["spec"]
        assert pod["containers"][0]["securityContext"] == {
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
