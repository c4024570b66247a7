"""spec.monitoring rendered: the engines' PodMonitor and where traces go (pure)."""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml

from bidirkv.operator.api.spec import SpecError
from bidirkv.operator.render.children import optional_children, render_resource
from bidirkv.router.config import parse_config
from kubeapi.crdschema import validate_custom_resource

PODMONITOR_CRD = (pathlib.Path(__file__).parent.parent / "e2e" / "cluster" / "crds"
                  / "monitoring.coreos.com_podmonitors.yaml")
URL = "http://otel-collector.monitoring:4318/v1/traces"


def by_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def engine(objs, role):
    (sts,) = [o for o in by_kind(objs, "StatefulSet") if o["metadata"]["name"] == f"tiny-{role}"]
    return sts["spec"]["template"]["spec"]["containers"][0]


def router_json(objs):
    (cm,) = by_kind(objs, "ConfigMap")
    return json.loads(cm["data"]["router.json"])


def test_off_by_default(minimal):
    objs = render_resource(minimal)
    assert not by_kind(objs, "PodMonitor")
    assert "tracing" not in router_json(objs)
    for role in ("prefill", "decode"):
        c = engine(objs, role)
        assert "--otlp-traces-endpoint" not in c["args"]
        assert not [e for e in c["env"] if e["name"].startswith("OTEL_")]


def test_pod_monitor_selects_this_resources_engines(minimal):
    minimal["spec"]["monitoring"] = {"podMonitor": {
        "enabled": True, "interval": "1m", "scrapeTimeout": "10s",
        "labels": {"release": "prometheus"}}}
    (pm,) = by_kind(render_resource(minimal), "PodMonitor")
    assert (pm["kind"], pm["metadata"]["name"]) == ("PodMonitor", "tiny-engines")
    assert ("PodMonitor", "tiny-engines") in optional_children(_owner())
    assert pm["metadata"]["labels"]["release"] == "prometheus"
    assert pm["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "bidir-kv-operator"
    sel = pm["spec"]["selector"]
    assert sel["matchLabels"] == {"app.kubernetes.io/name": "bidir-kv",
                                  "app.kubernetes.io/instance": "tiny"}
    assert sel["matchExpressions"] == [{"key": "app.kubernetes.io/component", "operator": "In",
                                        "values": ["prefill", "decode"]}]
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert (ep["port"], ep["path"], ep["interval"], ep["scrapeTimeout"]) == (
        "http", "/metrics", "1m", "10s")
    # The port it names is the engines' container port.
    ports = {p["name"] for p in engine(render_resource(minimal), "decode")["ports"]}
    assert "http" in ports
    crd = yaml.safe_load(PODMONITOR_CRD.read_text())
    _, errors = validate_custom_resource(crd, pm, strict_cel=False)
    assert [str(e) for e in errors] == []


def test_tracing_reaches_router_and_both_engines(minimal):
    minimal["spec"]["monitoring"] = {"tracing": {"otlpEndpoint": URL, "sampleRatio": 0.1}}
    objs = render_resource(minimal)
    cfg = router_json(objs)
    assert cfg["tracing"] == {"otlpEndpoint": URL, "sampleRatio": 0.1}
    assert parse_config(cfg).tracing.otlp_endpoint == URL  # what the router reads, it accepts
    for role in ("prefill", "decode"):
        c = engine(objs, role)
        assert c["args"][c["args"].index("--otlp-traces-endpoint") + 1] == URL
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
        assert env["OTEL_SERVICE_NAME"] == f"bidir-kv-{role}"


TLS_URL = "https://otel-collector.monitoring:4318/v1/traces"
HEADERS = {"name": "otel", "key": "headers"}


def test_the_collectors_headers_come_from_a_secret(minimal):
    minimal["spec"]["monitoring"] = {"tracing": {
        "otlpEndpoint": TLS_URL, "headersSecretRef": HEADERS}}
    objs = render_resource(minimal)
    want = {"name": "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
            "valueFrom": {"secretKeyRef": {"name": "otel", "key": "headers"}}}
    (router,) = by_kind(objs, "Deployment")
    assert want in router["spec"]["template"]["spec"]["containers"][0]["env"]
    for role in ("prefill", "decode"):
        assert want in engine(objs, role)["env"]
    assert "headers" not in json.dumps(router_json(objs))  # nothing of it in the ConfigMap


@pytest.mark.parametrize(
    "monitoring, expected",
    [
        ({"tracing": {"otlpEndpoint": "otel:4318"}},
         "spec.monitoring.tracing.otlpEndpoint: 'otel:4318'"),
        ({"tracing": {"otlpEndpoint": "grpc://otel:4317"}}, "expected the http(s) URL"),
        ({"tracing": {"otlpEndpoint": "http://u:secret@otel:4318/v1/traces"}},
         "no credentials in the URL"),
        ({"tracing": {"sampleRatio": 2}}, "spec.monitoring.tracing.sampleRatio: 2"),
        ({"podMonitor": {"interval": "soon"}}, "spec.monitoring.podMonitor.interval: 'soon'"),
        ({"podMonitor": {"labels": {"bad key!": "x"}}},
         "spec.monitoring.podMonitor.labels: {...}"),
        ({"podMonitr": {}}, "spec.monitoring.podMonitr: {...}: Extra inputs"),
    ],
)
def test_bad_monitoring_names_the_field(minimal, monitoring, expected):
    minimal["spec"]["monitoring"] = monitoring
    with pytest.raises(SpecError) as err:
        render_resource(minimal)
    assert expected in str(err.value)


def test_a_refused_endpoint_with_credentials_is_not_shown(minimal):
    minimal["spec"]["monitoring"] = {"tracing": {
        "otlpEndpoint": "https://u:secret-token@otel:4318/v1/traces"}}
    with pytest.raises(SpecError) as err:
        render_resource(minimal)
    assert "secret-token" not in str(err.value)
    assert "spec.monitoring.tracing.otlpEndpoint: '<not shown" in str(err.value)


def test_headers_over_plain_http_only_when_the_spec_says_so(minimal):
    from bidirkv.operator.crd.schema import build_crd
    from kubeapi.crdschema import validate_custom_resource

    minimal["spec"]["monitoring"] = {"tracing": {"otlpEndpoint": URL,
                                                 "headersSecretRef": HEADERS}}
    with pytest.raises(SpecError) as err:
        render_resource(minimal)
    assert ("headersSecretRef: 'otel' would be sent in clear text to otlpEndpoint "
            f"{URL!r}") in str(err.value)
    assert "allowInsecureHeaders: true" in str(err.value)
    (error,) = validate_custom_resource(build_crd(), minimal, None)[1]
    assert "spec.monitoring.tracing.headersSecretRef" in str(error)
    assert "plain http://" in str(error)
    # The scheme's case does not matter to either check.
    minimal["spec"]["monitoring"]["tracing"]["otlpEndpoint"] = URL.replace("http", "HTTP", 1)
    assert validate_custom_resource(build_crd(), minimal, None)[1]
    with pytest.raises(SpecError):
        render_resource(minimal)
    # Said explicitly, it is the author's choice; without headers, plain HTTP is fine.
    minimal["spec"]["monitoring"]["tracing"]["allowInsecureHeaders"] = True
    assert validate_custom_resource(build_crd(), minimal, None)[1] == []
    assert "OTEL_EXPORTER_OTLP_TRACES_HEADERS" in json.dumps(engine(render_resource(minimal),
                                                                    "decode")["env"])
    minimal["spec"]["monitoring"]["tracing"] = {"otlpEndpoint": URL}
    assert validate_custom_resource(build_crd(), minimal, None)[1] == []
    render_resource(minimal)


def test_the_tracing_flag_is_the_operators_once_the_spec_sets_it(minimal):
    flag = "--otlp-traces-endpoint=http://x:4318/v1/traces"
    minimal["spec"]["engine"] = {"extraArgs": [flag]}
    # Before spec.monitoring.tracing, extraArgs was the way: such a spec keeps working.
    assert flag in engine(render_resource(minimal), "decode")["args"]
    minimal["spec"]["monitoring"] = {"tracing": {"otlpEndpoint": URL}}
    with pytest.raises(SpecError) as err:
        render_resource(minimal)
    assert f"spec.engine.extraArgs[0]: {flag!r} is managed" in str(err.value)


def _owner():
    from bidirkv.operator.render.children import Owner

    return Owner(name="tiny", namespace="ns1", uid="u-1")
