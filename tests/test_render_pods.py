"""Deployable models: model cache, env from Secrets, volumes and pod-level settings; and
quantities as Kubernetes reads them."""

import copy

import pytest

from bidirkv.operator.api.spec import SpecError, parse_spec
from bidirkv.operator.render.children import render_resource
from kubeapi.crdschema import validate_custom_resource
from kubeapi.schemas import KUBE_VERSIONS, schema_errors


def sts(objs, role):
    return next(o for o in objs if o["kind"] == "StatefulSet"
                and o["metadata"]["name"].endswith(role))


def pod(objs, role):
    return sts(objs, role)["spec"]["template"]


def with_spec(doc, **engine):
    doc = copy.deepcopy(doc)
    doc["spec"].setdefault("engine", {}).update(engine)
    return doc


CACHES = [
    ({"persistentVolumeClaim": {"claimName": "models"}},
     {"persistentVolumeClaim": {"claimName": "models"}}),
    ({"hostPath": {"path": "/opt/dlami/nvme/hf"}},
     {"hostPath": {"path": "/opt/dlami/nvme/hf", "type": "DirectoryOrCreate"}}),
    ({"emptyDir": {"sizeLimit": "200Gi"}, "mountPath": "/cache"},
     {"emptyDir": {"sizeLimit": "200Gi"}}),
]


@pytest.mark.parametrize(("cache", "volume"), CACHES)
def test_the_model_cache_is_mounted_where_vllm_downloads(minimal, cache, volume):
    objs = render_resource(with_spec(minimal, modelCache=cache))
    for role in ("prefill", "decode"):
        spec = pod(objs, role)["spec"]
        (vol,) = [v for v in spec["volumes"] if v["name"] == "model-cache"]
        assert {k: v for k, v in vol.items() if k != "name"} == volume
        c = spec["containers"][0]
        path = cache.get("mountPath", "/root/.cache/huggingface")
        assert {"name": "model-cache", "mountPath": path} in c["volumeMounts"]
        assert {"name": "HF_HOME", "value": path} in c["env"]
    for version in KUBE_VERSIONS:
        for obj in objs:
            assert schema_errors(obj, version) == []


def test_a_role_cache_replaces_the_shared_one(minimal):
    doc = with_spec(minimal, modelCache={"persistentVolumeClaim": {"claimName": "shared"}})
    doc["spec"]["decode"] = {"modelCache": {"hostPath": {"path": "/nvme"}}}
    objs = render_resource(doc)
    volumes = {r: {v["name"]: v for v in pod(objs, r)["spec"]["volumes"]}
               for r in ("prefill", "decode")}
    assert volumes["prefill"]["model-cache"]["persistentVolumeClaim"]["claimName"] == "shared"
    assert volumes["decode"]["model-cache"]["hostPath"]["path"] == "/nvme"


def test_secrets_volumes_and_pod_settings_reach_the_engine_pods(example):
    doc = with_spec(
        example,
        envFrom=[{"configMapRef": {"name": "vllm-tuning"}}],
        imagePullSecrets=[{"name": "ecr"}],
        serviceAccountName="vllm",
        priorityClassName="inference-high",
        podLabels={"team": "ml"},
        podAnnotations={"prometheus.io/scrape": "true"},
        extraVolumes=[{"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx-claim"}}],
        extraVolumeMounts=[{"name": "fsx", "mountPath": "/fsx", "readOnly": True}],
    )
    objs = render_resource(doc)
    template = pod(objs, "decode")
    spec, c = template["spec"], template["spec"]["containers"][0]
    hf = next(e for e in c["env"] if e["name"] == "HF_TOKEN")
    assert hf == {"name": "HF_TOKEN",
                  "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
    assert c["envFrom"] == [{"configMapRef": {"name": "vllm-tuning"}}]
    assert spec["imagePullSecrets"] == [{"name": "ecr"}]
    assert spec["serviceAccountName"] == "vllm" and spec["automountServiceAccountToken"] is False
    assert spec["priorityClassName"] == "inference-high"
    # The drain (decode's drainSeconds, 120 by default), then vLLM's own stop.
    assert spec["terminationGracePeriodSeconds"] == 120 + 120
    assert spec["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    assert "topologySpreadConstraints" not in pod(objs, "prefill")["spec"]
    assert template["metadata"]["labels"]["team"] == "ml"
    assert template["metadata"]["labels"]["app.kubernetes.io/component"] == "decode"
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert {"name": "fsx", "mountPath": "/fsx", "readOnly": True} in c["volumeMounts"]
    for version in KUBE_VERSIONS:
        for obj in objs:
            assert schema_errors(obj, version) == []


def test_existing_children_do_not_roll_when_the_new_fields_are_unset(minimal):
    # The config hash of a spec without the new fields is what earlier versions wrote.
    objs = render_resource(minimal)
    ann = pod(objs, "decode")["metadata"]["annotations"]
    assert list(ann) == ["bidirkv.io/config-hash"]
    assert [v["name"] for v in pod(objs, "decode")["spec"]["volumes"]] == ["shm"]


BAD = [
    ({"modelCache": {"hostPath": {"path": "/a"}, "emptyDir": {}}},
     "spec.engine.modelCache", "exactly one of persistentVolumeClaim, hostPath, emptyDir"),
    ({"modelCache": {}}, "spec.engine.modelCache", "exactly one"),
    ({"modelCache": {"hostPath": {"path": "relative"}}}, "spec.engine.modelCache.hostPath.path",
     "pattern"),
    ({"extraEnv": [{"name": "HF_TOKEN", "value": "x",
                    "valueFrom": {"secretKeyRef": {"name": "a", "key": "b"}}}]},
     "spec.engine.extraEnv.0", "not both"),
    ({"extraEnv": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"nam": "a"}}}]},
     "spec.engine.extraEnv.0.valueFrom", "not a valid EnvVarSource"),
    ({"envFrom": [{"secretRef": {"name": "a"}, "bogus": 1}]}, "spec.engine.envFrom.0",
     "bogus"),
    ({"extraVolumes": [{"name": "shm", "emptyDir": {}}]}, "spec.engine",
     "'shm' is a volume name the operator uses"),
    ({"extraVolumes": [{"name": "a", "emptyDir": {}}],
      "extraVolumeMounts": [{"name": "b", "mountPath": "/b"}]}, "spec.engine",
     "'b' is not in extraVolumes"),
    ({"extraVolumes": [{"hostPath": {"path": "/x"}}]}, "spec.engine.extraVolumes.0",
     "name: Field required"),
    ({"podLabels": {"app.kubernetes.io/component": "x"}}, "spec.engine.podLabels",
     "managed by the operator"),
    ({"podLabels": {"team": "bad value!"}}, "spec.engine.podLabels", "not a valid label value"),
    ({"imagePullSecrets": [{"name": "Not_DNS"}]}, "spec.engine.imagePullSecrets.0.name",
     "pattern"),
    ({"terminationGracePeriodSeconds": -1}, "spec.engine.terminationGracePeriodSeconds",
     "greater than or equal to 0"),
]


@pytest.mark.parametrize(("engine", "field", "message"), BAD)
def test_bad_pod_settings_name_the_field(minimal, engine, field, message):
    with pytest.raises(SpecError) as err:
        parse_spec(with_spec(minimal, **engine)["spec"])
    assert field in str(err.value) and message in str(err.value)


def test_hf_home_beside_a_model_cache_is_refused(minimal):
    doc = with_spec(minimal, modelCache={"emptyDir": {}},
                    extraEnv=[{"name": "HF_HOME", "value": "/x"}])
    with pytest.raises(SpecError, match=r"spec.engine.extraEnv\[0\].name: 'HF_HOME'"):
        render_resource(doc)


def test_a_mount_over_the_model_cache_is_refused(minimal):
    doc = with_spec(minimal, modelCache={"emptyDir": {}, "mountPath": "/m"},
                    extraVolumes=[{"name": "x", "emptyDir": {}}],
                    extraVolumeMounts=[{"name": "x", "mountPath": "/m/"}])
    with pytest.raises(SpecError, match="'/m' is mounted twice"):
        render_resource(doc)


@pytest.mark.parametrize("amount", ["1e3", ".5Gi", "100n", "+1", "0.5", "1024Mi", "5.",
                                    "1.5E3", "2k", 8])
def test_every_quantity_form_kubernetes_accepts_is_accepted(minimal, amount):
    doc = copy.deepcopy(minimal)
    doc["spec"]["prefill"] = {"resources": {"requests": {"cpu": amount}}}
    spec = parse_spec(doc["spec"])
    assert spec.prefill.resources.requests["cpu"] == amount
    _, errors = validate_custom_resource_for(doc)
    assert errors == []


@pytest.mark.parametrize("amount", ["1K", "abc", "-1", "1e", "1.5.5", "Infinity", "1_000",
                                    " 1", "1e1.5"])
def test_what_kubernetes_refuses_is_refused_naming_the_field(minimal, amount):
    doc = copy.deepcopy(minimal)
    doc["spec"]["prefill"] = {"resources": {"limits": {"memory": amount}}}
    with pytest.raises(SpecError) as err:
        parse_spec(doc["spec"])
    assert "spec.prefill.resources.limits.memory" in str(err.value)
    assert repr(amount) in str(err.value)


def validate_custom_resource_for(doc):
    from bidirkv.operator.crd.schema import build_crd

    return validate_custom_resource(build_crd(), doc, None)


def test_role_arguments_follow_the_engine_ones(minimal):
    doc = copy.deepcopy(minimal)
    doc["spec"]["engine"] = {"extraArgs": ["--max-num-seqs=8"]}
    doc["spec"]["prefill"] = {"extraArgs": ["--max-num-seqs=1"]}
    objs = render_resource(doc)
    p_args = pod(objs, "prefill")["spec"]["containers"][0]["args"]
    d_args = pod(objs, "decode")["spec"]["containers"][0]["args"]
    assert p_args[-2:] == ["--max-num-seqs=8", "--max-num-seqs=1"]  # vLLM takes the last
    assert d_args[-1] == "--max-num-seqs=8"


NOT_ALONE = "is not one a role may set alone"


@pytest.mark.parametrize(("args", "index", "message"), [
    # What shapes the tokens or the KV: decode would read KV computed for other tokens.
    (["--chat-template=/t/other.jinja"], 0, NOT_ALONE),
    (["--tokenizer-mode", "mistral"], 0, NOT_ALONE),
    (["--hf-overrides", '{"rope_scaling": {"factor": 4}}'], 0, NOT_ALONE),
    (["--enable-lora", "--lora-modules", "a=/l/a"], 0, NOT_ALONE),
    (["--max-num-seqs=4", "--trust-remote-code"], 1, NOT_ALONE),
    (["--calculate-kv-scales"], 0, NOT_ALONE),
    (["--block-size=16"], 0, NOT_ALONE),
    (["--kv-cache-dtype=fp8"], 0, NOT_ALONE),
    # Spellings vLLM's parser also takes (underscores, prefixes) are not the allowlist's.
    (["--chat_template=x"], 0, NOT_ALONE),
    (["--max-num-seq=4"], 0, NOT_ALONE),
    # A value first would complete engine.extraArgs' last argument on this role only, and
    # a stray value after a switch would be read as the model.
    (["x.jinja"], 0, "is a value after no option that takes one"),
    (["--enforce-eager", "other/model"], 1, "is a value after no option that takes one"),
    (["--port=9"], 0, "is managed by the operator"),
])
def test_role_arguments_that_change_tokens_or_kv_are_refused(minimal, args, index, message):
    doc = copy.deepcopy(minimal)
    doc["spec"]["decode"] = {"extraArgs": args}
    with pytest.raises(SpecError) as err:
        render_resource(doc)
    want = f"spec.decode.extraArgs[{index}]: {args[index]!r} {message}"
    assert want in str(err.value)
    assert "--max-num-seqs" in str(err.value) or message != NOT_ALONE  # what is allowed
    # The API server refuses the same (CEL on the role's extraArgs), but for a stray value
    # past the first item: which options take a value is the operator's check alone.
    stray = message.startswith("is a value") and index > 0
    assert bool(validate_custom_resource_for(doc)[1]) is not stray
    # The same arguments on both roles are the engine's: allowed, and in the fingerprint.
    doc["spec"]["decode"] = {}
    doc["spec"]["engine"] = {"extraArgs": args}
    if message == NOT_ALONE:
        objs = render_resource(doc)
        assert pod(objs, "prefill")["spec"]["containers"][0]["args"][-len(args):] == args


@pytest.mark.parametrize("args", [
    ["--max-num-seqs", "1"], ["--max-num-batched-tokens=2048", "--enforce-eager"],
    ["--gpu-memory-utilization", "0.8", "--no-enable-chunked-prefill",
     "--uvicorn-log-level=warning", "--disable-log-stats"],
])
def test_role_arguments_on_the_allowlist_pass_both_checks(minimal, args):
    doc = copy.deepcopy(minimal)
    doc["spec"]["prefill"] = {"extraArgs": args}
    assert validate_custom_resource_for(doc)[1] == []
    objs = render_resource(doc)
    assert pod(objs, "prefill")["spec"]["containers"][0]["args"][-len(args):] == args


def test_the_crd_says_which_argument_and_what_is_allowed(minimal):
    doc = copy.deepcopy(minimal)
    doc["spec"]["prefill"] = {"extraArgs": ["--max-num-seqs=2", "--chat-template=x"]}
    (error,) = validate_custom_resource_for(doc)[1]
    assert "spec.prefill.extraArgs" in str(error)
    assert "--chat-template=x is not an argument a role may set alone" in str(error)
    assert "--max-num-batched-tokens" in str(error)


ENV_NOT_ALONE = "is not one a role may set alone"


@pytest.mark.parametrize("name", [
    # Where the weights come from: another hub, another cache, ModelScope, or whatever a
    # cache holds offline can be other weights under the same model name.
    "HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "VLLM_USE_MODELSCOPE",
    # Kernels and KV layouts.
    "VLLM_ATTENTION_BACKEND",
    # Not listed: refused until it is (an allowlist).
    "SOME_NEW_VLLM_SETTING",
])
def test_role_env_that_could_change_weights_tokens_or_kv_is_refused(minimal, name):
    doc = copy.deepcopy(minimal)
    doc["spec"]["decode"] = {"extraEnv": [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "1"},
                                          {"name": name, "value": "x"}]}
    with pytest.raises(SpecError) as err:
        render_resource(doc)
    said = str(err.value)
    assert f"spec.decode.extraEnv[1].name: {name!r} {ENV_NOT_ALONE}" in said
    assert "spec.engine.extraEnv" in said and "VLLM_CPU_OMP_THREADS_BIND" in said
    # The API server refuses the same (CEL on the role's extraEnv), naming it.
    (error,) = validate_custom_resource_for(doc)[1]
    assert "spec.decode.extraEnv" in str(error)
    assert f"{name} is not an environment variable a role may set alone" in str(error)
    # On both roles it is the engine's: allowed, and in the fingerprint.
    doc["spec"]["decode"] = {}
    doc["spec"]["engine"] = {"extraEnv": [{"name": name, "value": "x"}]}
    assert validate_custom_resource_for(doc)[1] == []
    env = {e["name"]: e.get("value")
           for e in pod(render_resource(doc), "prefill")["spec"]["containers"][0]["env"]}
    assert env[name] == "x"


def test_role_env_on_the_allowlist_passes_both_checks_and_keeps_the_fingerprint(minimal):
    from bidirkv.roleconfig import FINGERPRINT_ENV

    doc = copy.deepcopy(minimal)
    doc["spec"]["prefill"] = {"extraEnv": [
        {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0"},
        {"name": "OMP_NUM_THREADS", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]}
    assert validate_custom_resource_for(doc)[1] == []
    objs, base = render_resource(doc), render_resource(minimal)

    def env(objs, role):
        return {e["name"]: e.get("value") for e in pod(objs, role)["spec"]["containers"][0]["env"]}
    assert env(objs, "prefill")["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env(objs, "decode")[FINGERPRINT_ENV] == env(base, "decode")[FINGERPRINT_ENV]


def test_the_fingerprint_covers_where_each_role_reads_its_weights(minimal):
    """A role's own model cache can hold another snapshot under the same name (pre-filled,
    or read offline): any cache is in the fingerprint, so a change of one rolls both roles
    and pods of two caches never reuse each other's KV."""
    from bidirkv.roleconfig import kv_fingerprint

    def fp(**roles):
        return kv_fingerprint(parse_spec({**minimal["spec"], **roles}))

    claim = {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    other = {"persistentVolumeClaim": {"claimName": "other-models", "readOnly": True}}
    base, shared = fp(), fp(engine={"modelCache": claim})
    assert shared != base
    assert fp(engine={"modelCache": claim}, decode={"modelCache": other}) not in (base, shared)
    assert fp(decode={"modelCache": claim}) not in (base, shared)
    # The same cache, named per role or once for both, is the same fingerprint.
    assert fp(prefill={"modelCache": claim}, decode={"modelCache": claim}) == shared
    assert fp(engine={"modelCache": other}, prefill={"modelCache": claim},
              decode={"modelCache": claim}) == shared


def test_the_fingerprint_covers_what_shapes_tokens_or_kv_and_reaches_the_engines(minimal):
    from bidirkv.operator.api.spec import parse_spec
    from bidirkv.roleconfig import FINGERPRINT_ENV, kv_fingerprint

    base = kv_fingerprint(parse_spec(minimal["spec"]))
    for change in ({"engine": {"extraArgs": ["--chat-template=/t/a.jinja"]}},
                   {"engine": {"extraEnv": [{"name": "VLLM_ATTENTION_BACKEND",
                                             "value": "FLASHINFER"}]}},
                   {"model": {"name": minimal["spec"]["model"]["name"], "maxModelLen": 4096}}):
        assert kv_fingerprint(parse_spec({**minimal["spec"], **change})) != base, change
    # What a role may set alone is not in it: the roles stay one pool.
    alone = {**minimal["spec"], "prefill": {"extraArgs": ["--max-num-seqs=1"]}}
    assert kv_fingerprint(parse_spec(alone)) == base
    objs = render_resource(minimal)
    for role in ("prefill", "decode"):
        env = {e["name"]: e.get("value")
               for e in pod(objs, role)["spec"]["containers"][0]["env"]}
        assert env[FINGERPRINT_ENV] == base


def test_a_leaving_pod_drains_within_its_grace_and_rolls_one_at_a_time(minimal):
    from bidirkv.connector.drain import DRAIN_ENV
    from bidirkv.operator.render.drain import DRAIN_ENV as RENDERED

    assert RENDERED == DRAIN_ENV  # what the operator sets is what the launcher reads
    doc = copy.deepcopy(minimal)
    doc["spec"]["decode"] = {**doc["spec"].get("decode", {}), "drainSeconds": 300}
    doc["spec"]["engine"] = {**doc["spec"].get("engine", {}),
                             "terminationGracePeriodSeconds": 20}
    objs = render_resource(doc)
    for role, drain in (("decode", 300), ("prefill", 120)):
        template = pod(objs, role)
        env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
        assert env[DRAIN_ENV] == str(drain)
        assert template["spec"]["terminationGracePeriodSeconds"] == drain + 20
    for obj in objs:
        if obj["kind"] == "StatefulSet":
            assert obj["spec"]["updateStrategy"] == {"type": "RollingUpdate",
                                                     "rollingUpdate": {"partition": 0}}


@pytest.mark.parametrize("drain, short", [(120, True), (479, True), (480, False), (600, False)])
def test_a_drain_shorter_than_the_retention_is_named(minimal, drain, short):
    from bidirkv.operator.render.drain import short_drain

    spec = copy.deepcopy(minimal["spec"])
    spec["decode"] = {**spec.get("decode", {}), "drainSeconds": drain}
    spec["kvTransfer"] = {**spec.get("kvTransfer", {}), "decoderKvBlocksTtlSeconds": 480}
    note = short_drain(parse_spec(spec))
    if short:
        assert note.startswith(f"spec.decode.drainSeconds {drain} is shorter than "
                               "kvTransfer.decoderKvBlocksTtlSeconds 480")
    else:
        assert note is None


def test_drain_seconds_out_of_range_is_refused_naming_the_field(minimal):
    spec = copy.deepcopy(minimal["spec"])
    spec["decode"] = {**spec.get("decode", {}), "drainSeconds": 3601}
    with pytest.raises(SpecError, match="decode.drainSeconds"):
        parse_spec(spec)
