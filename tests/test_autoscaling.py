"""Autoscaling of prefill and decode: the spec (CRD and models alike), the rendered
HorizontalPodAutoscalers and KEDA ScaledObjects (against tables and the schemas), and the
operator leaving an autoscaled role's replicas to the autoscaler."""

from __future__ import annotations

import copy
import json
import pathlib

import pytest
import yaml

from bidirkv.operator.api.spec import SpecError, parse_spec
from bidirkv.operator.crd.schema import build_crd
from bidirkv.operator.kube import ApiError
from bidirkv.operator.reconcile import diff
from bidirkv.operator.reconcile.status import compute_status
from bidirkv.operator.render import autoscaling
from bidirkv.operator.render.children import (
    Owner,
    optional_children,
    render,
    render_resource,
    router_config,
)
from bidirkv.roleconfig import ENGINE_PORT
from kubeapi.crdschema import validate_custom_resource
from kubeapi.schemas import KUBE_VERSIONS, schema_errors

KEDA_CRD = yaml.safe_load(
    (pathlib.Path(__file__).parent / "schemas" / "keda.sh_scaledobjects.yaml").read_text())
OWNER = Owner("tiny", "ns1", "u-1")
PROM = "http://prometheus-operated.monitoring:9090"


def spec_with(**roles):
    return {"model": {"name": "m"}, **roles}


def _crd_validate(spec):
    obj = {"apiVersion": "bidirkv.io/v1alpha1", "kind": "DisaggregatedInference",
           "metadata": {"name": "x", "namespace": "default"}, "spec": spec}
    return validate_custom_resource(build_crd(), obj, strict_cel=True)


# -- the spec: what the API server and the operator accept and refuse -------------------

GOOD = [
    spec_with(decode={"autoscaling": {"maxReplicas": 4}}),
    spec_with(decode={"autoscaling": {"minReplicas": 2, "maxReplicas": 2}},
              prefill={"replicas": 3}),
    spec_with(prefill={"autoscaling": {"minReplicas": 1, "maxReplicas": 8, "metric": "ttft",
                                       "averageValue": "500m", "metricName": "prefill_ttft"}},
              decode={"autoscaling": {"engine": "keda", "maxReplicas": 16,
                                      "keda": {"serverAddress": PROM, "pollingInterval": 15}}}),
    spec_with(decode={"autoscaling": {"maxReplicas": 1024, "averageValue": "0.85"}}),
]


@pytest.mark.parametrize("spec", GOOD)
def test_crd_and_models_accept_autoscaling_alike_with_equal_defaults(spec):
    obj, errors = _crd_validate(spec)
    assert [str(e) for e in errors] == []
    model = parse_spec(spec).model_dump(by_alias=True, mode="json", exclude_none=True)
    for role in ("prefill", "decode"):
        assert obj["spec"].get(role, {}).get("autoscaling") == \
            model[role].get("autoscaling")
        assert obj["spec"].get(role, {}).get("replicas") == model[role].get("replicas")


# (role spec, where the API server says it is, what the operator's message names)
BAD = [
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
     "spec.decode.autoscaling.minReplicas", "minReplicas: 5 must be at most maxReplicas (2)"),
    ({"replicas": 3, "autoscaling": {"maxReplicas": 4}},
     "spec.decode.replicas", "replicas: 3 is a fixed count"),
    # Even the count the default would give is a fixed count.
    ({"replicas": 1, "autoscaling": {"maxReplicas": 4}},
     "spec.decode.replicas", "replicas: 1 is a fixed count"),
    ({"autoscaling": {"minReplicas": 0, "maxReplicas": 4}},
     "spec.decode.autoscaling.minReplicas", "spec.decode.autoscaling.minReplicas: 0"),
    ({"autoscaling": {"maxReplicas": 1025}},
     "spec.decode.autoscaling.maxReplicas", "spec.decode.autoscaling.maxReplicas: 1025"),
    ({"autoscaling": {"minReplicas": 1}},
     "spec.decode.autoscaling.maxReplicas", "spec.decode.autoscaling.maxReplicas"),
    ({"autoscaling": {"maxReplicas": 4, "engine": "keda"}},
     "spec.decode.autoscaling.keda", "keda: missing; engine keda needs keda.serverAddress"),
    ({"autoscaling": {"maxReplicas": 4, "keda": {"serverAddress": PROM}}},
     "spec.decode.autoscaling.keda", "keda: set, but engine is 'hpa'"),
    ({"autoscaling": {"maxReplicas": 4, "engine": "keda", "metricName": "x",
                      "keda": {"serverAddress": PROM}}},
     "spec.decode.autoscaling.metricName", "metricName: 'x' is for engine hpa"),
    ({"autoscaling": {"maxReplicas": 4, "engine": "keda",
                      "keda": {"serverAddress": "prometheus:9090"}}},
     "spec.decode.autoscaling.keda.serverAddress",
     "spec.decode.autoscaling.keda.serverAddress: 'prometheus:9090'"),
    ({"autoscaling": {"maxReplicas": 4, "averageValue": "0m"}},
     "spec.decode.autoscaling.averageValue", "averageValue: '0m' must be greater than zero"),
    ({"autoscaling": {"maxReplicas": 4, "averageValue": ".0"}},
     "spec.decode.autoscaling.averageValue", "averageValue: '.0' must be greater than zero"),
    ({"autoscaling": {"maxReplicas": 4, "averageValue": "-1"}},
     "spec.decode.autoscaling.averageValue", "spec.decode.autoscaling.averageValue: '-1'"),
    ({"autoscaling": {"maxReplicas": 4, "averageValue": "lots"}},
     "spec.decode.autoscaling.averageValue", "spec.decode.autoscaling.averageValue: 'lots'"),
    ({"autoscaling": {"maxReplicas": 4, "metric": "gpu"}},
     "spec.decode.autoscaling.metric", "spec.decode.autoscaling.metric: 'gpu'"),
    ({"autoscaling": {"maxReplicas": 4, "metricName": "a/b"}},
     "spec.decode.autoscaling.metricName", "spec.decode.autoscaling.metricName: 'a/b'"),
]


@pytest.mark.parametrize(("decode", "field", "message"), BAD)
def test_crd_and_models_refuse_alike_naming_the_field(decode, field, message):
    _, errors = _crd_validate(spec_with(decode=decode))
    assert errors, f"CRD accepted {decode}"
    assert any(str(e).startswith(field) for e in errors), [str(e) for e in errors]
    with pytest.raises(SpecError) as exc:
        parse_spec(spec_with(decode=decode))
    assert message in str(exc.value)


def test_zero_spellings_are_refused_and_small_values_are_not():
    for zero in ("0", "0.0", "000", "0m", "0Gi", "0e3", "+0"):
        _, errors = _crd_validate(spec_with(decode={"autoscaling": {
            "maxReplicas": 2, "averageValue": zero}}))
        assert errors, zero
    for positive in ("1m", "0.5", "10", "1e-3", "0.001"):
        spec = spec_with(decode={"autoscaling": {"maxReplicas": 2, "averageValue": positive}})
        assert _crd_validate(spec)[1] == [], positive
        parse_spec(spec)


def test_a_fixed_role_keeps_its_default_of_one():
    spec = parse_spec(spec_with())
    assert spec.decode.replicas is None
    assert spec.decode.fixed_replicas() == 1 and spec.decode.initial_replicas() == 1
    auto = parse_spec(spec_with(decode={"autoscaling": {"minReplicas": 3, "maxReplicas": 5}}))
    assert auto.decode.fixed_replicas() is None and auto.decode.initial_replicas() == 3


# -- rendering against tables ------------------------------------------------------------

# (role, autoscaling, HPA metric name, HPA averageValue)
HPA_TABLE = [
    ("decode", {"maxReplicas": 4}, "vllm:bidirkv_kv_working_set_ratio", "700m"),
    ("decode", {"maxReplicas": 4, "averageValue": "0.9"},
     "vllm:bidirkv_kv_working_set_ratio", "0.9"),
    ("prefill", {"maxReplicas": 4}, "vllm:num_requests_waiting", "4"),
    ("prefill", {"maxReplicas": 4, "metric": "ttft"}, "vllm:time_to_first_token_seconds", "1"),
    ("prefill", {"maxReplicas": 4, "metric": "ttft", "metricName": "ttft_mean",
                 "averageValue": "250m"}, "ttft_mean", "250m"),
    ("decode", {"maxReplicas": 4, "metric": "queue"}, "vllm:num_requests_waiting", "4"),
]


@pytest.mark.parametrize(("role", "auto", "metric", "target"), HPA_TABLE)
def test_hpa_per_role_against_the_table(role, auto, metric, target):
    spec = parse_spec(spec_with(**{role: {"autoscaling": {"minReplicas": 2, **auto}}}))
    (hpa,) = autoscaling.autoscalers(OWNER, spec, ("prefill", "decode"))
    assert (hpa["apiVersion"], hpa["kind"]) == ("autoscaling/v2", "HorizontalPodAutoscaler")
    assert hpa["metadata"]["name"] == f"tiny-{role}"
    assert hpa["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                             "name": f"tiny-{role}"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 4)
    assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": metric}, "target": {"type": "AverageValue", "averageValue": target}}}]
    for version in KUBE_VERSIONS:
        assert schema_errors(hpa, version) == []


# (decode's drain, vLLM's stop, decode's scale-down period: one pod per grace period, the
# two together, within the HPA's bounds on a policy's period; its stabilisation window:
# the grace period, at least the HPA's default 300 s, at most its bound 3600 s)
BEHAVIOR = [(120, 60, 180, 300), (0, 0, 60, 300), (0, 30, 60, 300), (480, 60, 540, 540),
            (3600, 60, 1800, 3600), (3600, 0, 1800, 3600), (1000, 3600, 1800, 3600)]


def _decode_hpa(drain: int, stop: int) -> tuple[dict, dict]:
    spec = parse_spec({**spec_with(decode={"autoscaling": {"maxReplicas": 4},
                                           "drainSeconds": drain},
                                   prefill={"autoscaling": {"maxReplicas": 4}}),
                       "engine": {"terminationGracePeriodSeconds": stop}})
    hpas = {h["metadata"]["name"]: h for h in
            autoscaling.autoscalers(OWNER, spec, ("prefill", "decode"))}
    return hpas["tiny-decode"], hpas["tiny-prefill"]


@pytest.mark.parametrize(("drain", "stop", "period", "window"), BEHAVIOR)
def test_decode_scales_down_one_pod_per_grace_period(drain, stop, period, window):
    decode, prefill = _decode_hpa(drain, stop)
    assert decode["spec"]["behavior"] == {"scaleDown": {
        "stabilizationWindowSeconds": window,
        "policies": [{"type": "Pods", "value": 1, "periodSeconds": period}]}}
    assert "behavior" not in prefill["spec"]
    for version in KUBE_VERSIONS:
        assert schema_errors(decode, version) == []


@pytest.mark.parametrize("drain", [0, 1, 299, 300, 1799, 3599, 3600])
def test_decode_scales_down_only_on_a_need_lower_for_at_least_a_drain(drain):
    """A StatefulSet makes no pod of an ordinal whose old pod still terminates: a scale-up
    right after a scale-down waits out that pod's drain. So a pod leaves only once the
    lower need held for at least as long as a drain lasts."""
    for stop in (0, 60, 3600):
        decode, _ = _decode_hpa(drain, stop)
        window = decode["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"]
        assert drain <= window <= autoscaling.MAX_STABILIZATION_WINDOW_S


SEL = 'namespace="ns1",pod=~"tiny-{role}-[0-9]+"'
# (role, autoscaling, metricType, query, threshold)
KEDA_TABLE = [
    ("decode", {}, "AverageValue",
     "sum(vllm:bidirkv_kv_working_set_ratio{" + SEL.format(role="decode") + "})", "0.7"),
    ("prefill", {}, "AverageValue",
     "sum(vllm:num_requests_waiting{" + SEL.format(role="prefill") + "})", "4"),
    ("prefill", {"metric": "ttft", "averageValue": "750m"}, "Value",
     "((sum(rate(vllm:time_to_first_token_seconds_sum{" + SEL.format(role="prefill")
     + "}[1m])) / sum(rate(vllm:time_to_first_token_seconds_count{"
     + SEL.format(role="prefill") + "}[1m]))) > 0) or vector(0)", "0.75"),
    ("decode", {"averageValue": "1e-1"}, "AverageValue",
     "sum(vllm:bidirkv_kv_working_set_ratio{" + SEL.format(role="decode") + "})", "0.1"),
]


@pytest.mark.parametrize(("role", "auto", "metric_type", "query", "threshold"), KEDA_TABLE)
def test_scaled_object_per_role_against_the_table(role, auto, metric_type, query, threshold):
    spec = parse_spec(spec_with(**{role: {"autoscaling": {
        "engine": "keda", "minReplicas": 1, "maxReplicas": 6,
        "keda": {"serverAddress": PROM}, **auto}}}))
    (so,) = autoscaling.autoscalers(OWNER, spec, ("prefill", "decode"))
    assert (so["apiVersion"], so["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert so["metadata"]["name"] == f"tiny-{role}"
    assert so["spec"]["scaleTargetRef"]["name"] == f"tiny-{role}"
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (1, 6)
    assert "pollingInterval" not in so["spec"]
    assert so["spec"]["triggers"] == [{"type": "prometheus", "metricType": metric_type,
                                       "metadata": {"serverAddress": PROM, "query": query,
                                                    "threshold": threshold}}]
    assert scaled_object_errors(so) == []


def test_scaled_object_carries_keda_settings_and_decode_behavior():
    spec = parse_spec(spec_with(decode={"autoscaling": {
        "engine": "keda", "maxReplicas": 3,
        "keda": {"serverAddress": PROM, "pollingInterval": 10}}}))
    (so,) = autoscaling.autoscalers(OWNER, spec, ("prefill", "decode"))
    assert so["spec"]["pollingInterval"] == 10
    assert so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == \
        autoscaling.behavior(spec, "decode")
    assert scaled_object_errors(so) == []


def test_a_dotted_name_is_escaped_in_the_pod_regex():
    query, _ = autoscaling.prometheus_query(Owner("a.b", "ns", "u"),
                                            autoscaling.ScaleMetric.queue, "decode")
    # PromQL string "a\\.b" is the regex a\.b: a literal dot.
    assert 'pod=~"a\\\\.b-decode-[0-9]+"' in query


def scaled_object_errors(obj):
    """Errors of `obj` against KEDA's CRD, strictly: a field the schema would prune is
    an error too."""
    out, errors = validate_custom_resource(KEDA_CRD, obj, strict_cel=True)
    problems = [str(e) for e in errors]
    if out != obj:
        problems.append(f"fields pruned: {json.dumps(obj)} -> {json.dumps(out)}")
    return problems


def test_the_strict_keda_check_catches_unknown_and_mistyped_fields():
    spec = parse_spec(spec_with(decode={"autoscaling": {
        "engine": "keda", "maxReplicas": 3, "keda": {"serverAddress": PROM}}}))
    (so,) = autoscaling.autoscalers(OWNER, spec, ("decode",))
    bad = copy.deepcopy(so)
    bad["spec"]["maxReplicas"] = 3  # the HPA's name, not KEDA's
    assert scaled_object_errors(bad)
    bad = copy.deepcopy(so)
    bad["spec"]["triggers"][0]["metadata"]["threshold"] = 0.7  # KEDA takes strings
    assert scaled_object_errors(bad)
    bad = copy.deepcopy(so)
    bad["spec"]["triggers"][0]["metricType"] = "Average"
    assert scaled_object_errors(bad)


# -- the children: replicas left to the autoscaler ---------------------------------------

def children(spec, observed=None):
    return {(o["kind"], o["metadata"]["name"]): o
            for o in render(OWNER, parse_spec(spec), observed)}


def test_autoscaled_statefulset_has_no_replicas_and_fixed_ones_do():
    objs = children(spec_with(decode={"autoscaling": {"maxReplicas": 4}},
                              prefill={"replicas": 2}))
    assert "replicas" not in objs[("StatefulSet", "tiny-decode")]["spec"]
    assert objs[("StatefulSet", "tiny-prefill")]["spec"]["replicas"] == 2
    assert ("HorizontalPodAutoscaler", "tiny-decode") in objs
    assert ("HorizontalPodAutoscaler", "tiny-prefill") not in objs
    for obj in objs.values():
        if obj["apiVersion"] != "keda.sh/v1alpha1":
            for version in KUBE_VERSIONS:
                assert schema_errors(obj, version) == []


def test_every_autoscaler_kind_is_pruned_when_not_rendered():
    keys = optional_children(OWNER)
    for role in ("prefill", "decode"):
        assert ("HorizontalPodAutoscaler", f"tiny-{role}") in keys
        assert ("ScaledObject", f"tiny-{role}") in keys


# (observed decode pods, the decode pods the router lists) with bounds 2..5: what exists,
# at least the minimum (a pod scaled away stays listed while it drains)
ROUTER_TABLE = [(None, 2), (1, 2), (2, 2), (4, 4), (5, 5), (9, 9)]


@pytest.mark.parametrize(("observed", "listed"), ROUTER_TABLE)
def test_router_lists_the_pods_the_autoscaler_runs(observed, listed):
    spec = parse_spec(spec_with(decode={"autoscaling": {"minReplicas": 2, "maxReplicas": 5}}))
    cfg = router_config(OWNER, spec, None if observed is None else {"decode": observed})
    assert cfg["decode"] == [f"http://tiny-decode-{i}.tiny-decode.ns1.svc:{ENGINE_PORT}"
                             for i in range(listed)]
    assert len(cfg["prefill"]) == 1


# (observed decode pods, the decode pods the router lists) with a fixed count of 3: a
# scale-down (`kubectl scale di/NAME --replicas=N`) keeps a leaving pod listed while it
# drains, a scale-up lists the new pods at once.
FIXED_ROUTER_TABLE = [(None, 3), (0, 3), (1, 3), (3, 3), (4, 4), (7, 7)]


@pytest.mark.parametrize(("observed", "listed"), FIXED_ROUTER_TABLE)
def test_a_fixed_role_lists_its_leaving_pods(observed, listed):
    spec = parse_spec(spec_with(decode={"replicas": 3}, prefill={"replicas": 1}))
    cfg = router_config(OWNER, spec, None if observed is None else {"decode": observed})
    assert cfg["decode"] == [f"http://tiny-decode-{i}.tiny-decode.ns1.svc:{ENGINE_PORT}"
                             for i in range(listed)]
    assert len(cfg["prefill"]) == 1
    # The StatefulSet keeps the spec's count: only the router waits for the leaving pods.
    sts = children(spec_with(decode={"replicas": 3}),
                   None if observed is None else {"decode": observed})
    assert sts[("StatefulSet", "tiny-decode")]["spec"]["replicas"] == 3


def _sts_as_stored(obj, replicas):
    stored = copy.deepcopy(obj)
    stored["spec"]["replicas"] = replicas
    stored["metadata"]["resourceVersion"] = "7"
    return stored


def test_the_autoscalers_replicas_are_neither_a_difference_nor_overwritten():
    objs = children(spec_with(decode={"autoscaling": {"maxReplicas": 4}}))
    want = objs[("StatefulSet", "tiny-decode")]
    live = _sts_as_stored(want, 3)
    assert not diff.differs(want, live)
    # Another change (a hand edit of the template) is put right, the count is kept.
    live["spec"]["template"]["spec"]["containers"][0]["image"] = "other"
    assert diff.differs(want, live)
    assert diff.replacement(want, live)["spec"]["replicas"] == 3
    # A fixed role's count is the spec's.
    fixed = children(spec_with())[("StatefulSet", "tiny-decode")]
    assert diff.differs(fixed, _sts_as_stored(fixed, 3))
    assert diff.replacement(fixed, _sts_as_stored(fixed, 3))["spec"]["replicas"] == 1


def test_the_hpa_target_is_compared_as_the_api_server_stores_it():
    spec = parse_spec(spec_with(decode={"autoscaling": {"maxReplicas": 4, "averageValue": "0.9"}}))
    (want,) = autoscaling.autoscalers(OWNER, spec, ("decode",))
    stored = copy.deepcopy(want)
    target = stored["spec"]["metrics"][0]["pods"]["target"]
    target["averageValue"] = "900m"  # kube-apiserver writes quantities canonically
    assert not diff.differs(want, stored)
    target["averageValue"] = "800m"  # a hand edit is put right
    assert diff.differs(want, stored)


def test_status_counts_against_what_the_autoscaler_chose(minimal):
    minimal["spec"]["decode"] = {"autoscaling": {"minReplicas": 1, "maxReplicas": 4}}
    spec = parse_spec(minimal["spec"])
    objs = children(minimal["spec"], {"decode": 3})
    seen = {k: copy.deepcopy(v) for k, v in objs.items()}
    sts = seen[("StatefulSet", "tiny-decode")]
    sts["spec"]["replicas"] = 3
    sts["metadata"]["generation"] = 1
    sts["status"] = {"observedGeneration": 1, "replicas": 3, "readyReplicas": 2,
                     "updatedReplicas": 3}
    status = compute_status(OWNER, spec, 1, seen, {}, "2026-01-01T00:00:00Z", None)
    assert status["decode"]["summary"] == "2/3"


def test_render_resource_of_the_example_with_autoscaling_is_valid(example):
    doc = copy.deepcopy(example)
    doc["spec"]["decode"].pop("replicas", None)
    doc["spec"]["decode"]["autoscaling"] = {"maxReplicas": 8}
    doc["spec"]["prefill"].pop("replicas", None)
    doc["spec"]["prefill"]["autoscaling"] = {
        "engine": "keda", "maxReplicas": 4, "metric": "ttft", "keda": {"serverAddress": PROM}}
    for obj in render_resource(doc):
        if obj["kind"] == "ScaledObject":
            assert scaled_object_errors(obj) == []
        else:
            for version in KUBE_VERSIONS:
                assert schema_errors(obj, version) == []


# -- the operator's RBAC -------------------------------------------------------------------

@pytest.mark.parametrize("values", [{}, {"watchNamespaces": ["team-a"]}])
def test_the_operators_role_manages_autoscalers(values):
    from test_chart import by_kind, rules
    from test_chart import render as render_chart

    docs, _ = render_chart(values)
    # The operator's own role: the one that writes StatefulSets.
    (role,) = [r for r in by_kind(docs, "Role") + by_kind(docs, "ClusterRole")
               if ("apps", "statefulsets", "create") in rules(r)]
    granted = rules(role)
    for group, resource in (("autoscaling", "horizontalpodautoscalers"),
                            ("keda.sh", "scaledobjects")):
        # Read before a write, created, replaced, deleted when turned off; not watched.
        assert {v for g, r, v in granted if (g, r) == (group, resource)} == {
            "get", "create", "update", "delete"}


# -- switching engines ---------------------------------------------------------------------

class KedaCluster:
    """A client double of a cluster with KEDA: its admission refuses a ScaledObject on a
    workload another HorizontalPodAutoscaler already scales."""

    def __init__(self) -> None:
        from test_operator_controller import Client

        self.api = Client()
        self.order: list[tuple[str, str]] = []

    def __getattr__(self, name):
        return getattr(self.api, name)

    async def create(self, obj):
        meta = obj["metadata"]
        if obj["kind"] == "ScaledObject" and \
                ("HorizontalPodAutoscaler", meta["namespace"], meta["name"]) in self.api.objects:
            raise ApiError(400, "BadRequest", "the workload is already managed by the hpa")
        self.order.append(("POST", obj["kind"]))
        obj = copy.deepcopy(obj)
        obj["metadata"]["uid"] = f"uid-{obj['kind']}-{meta['name']}"
        return await self.api.create(obj)

    async def delete(self, kind, namespace, name, uid):
        self.order.append(("DELETE", kind))
        self.api.objects.pop((kind, namespace, name), None)


async def test_switching_engines_deletes_the_old_autoscaler_before_creating_the_new(minimal):
    from bidirkv.operator.reconcile.controller import Controller

    cluster = KedaCluster()
    controller = Controller(cluster)
    body = copy.deepcopy(minimal)
    body["metadata"]["generation"] = 1
    body["spec"]["decode"] = {"autoscaling": {"maxReplicas": 4}}
    cluster.api.hold(body)
    await controller.reconcile(body)
    assert ("HorizontalPodAutoscaler", "ns1", "tiny-decode") in cluster.api.objects
    body["spec"]["decode"]["autoscaling"].update(engine="keda", keda={"serverAddress": PROM})
    await controller.reconcile(body)
    assert ("ScaledObject", "ns1", "tiny-decode") in cluster.api.objects
    assert ("HorizontalPodAutoscaler", "ns1", "tiny-decode") not in cluster.api.objects
    # And back: the ScaledObject goes before the HPA comes.
    body["spec"]["decode"]["autoscaling"] = {"maxReplicas": 4}
    await controller.reconcile(body)
    assert cluster.order[-2:] == [("DELETE", "ScaledObject"), ("POST", "HorizontalPodAutoscaler")]
