"""The chart's monitoring: the engines' PodMonitor, the PrometheusRule, the Grafana dashboard.

Each renders only when asked, validates against prometheus-operator's CRDs (vendored in
e2e/cluster/crds/) or Kubernetes' schemas, and every PromQL expression of the dashboard
and the alerts parses with the Prometheus project's own grammar (tests/monitoring.py) and
names metrics this project or vLLM exports.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess

import dashboard as dashboard_tool
import helm_python as helm
import monitoring
import pytest
import yaml
from test_chart import CHART, NAMESPACE, RELEASE, ROOT, by_kind, render

from bidirkv.operator.render.children import render_resource
from bidirkv.router.metrics import REQUEST_OUTCOMES, REUSE_OUTCOMES, Metrics
from kubeapi.crdschema import validate_custom_resource
from kubeapi.labelselectors import LabelSelector, selector_to_string
from kubeapi.schemas import KUBE_VERSIONS, schema_errors

CRDS = ROOT / "e2e" / "cluster" / "crds"
CRD_FILES = {"PodMonitor": CRDS / "monitoring.coreos.com_podmonitors.yaml",
             "PrometheusRule": CRDS / "monitoring.coreos.com_prometheusrules.yaml"}
KINDS = {"podMonitor": "PodMonitor", "prometheusRule": "PrometheusRule",
         "dashboard": "ConfigMap"}
ALL_ON = {key: {"enabled": True} for key in KINDS}
# The alerts with their values key: the runbook of each is a README section.
ALERTS = {
    "BidirKVReuseHitRatioLow": "reuseHitRatioLow",
    "BidirKVDecodePinnedNearCapacity": "decodePinnedNearCapacity",
    "BidirKVLeaseRenewalsFailing": "leaseRenewalsFailing",
    "BidirKVHandleStoreDown": "handleStoreDown",
    "BidirKVHandleStoreErrors": "handleStoreErrors",
    "BidirKVPrefillOnlyMode": "prefillOnlyMode",
    "BidirKVDecodeReplicaDown": "decodeReplicaDown",
}
ROWS = ("Overview", "TTFT", "Reuse", "Decode residency", "Transfers", "Engines", "Router")
CUSTOM = {
    "watchNamespaces": ["team-a", "team-b"],
    "podMonitor": {"enabled": True, "labels": {"release": "prometheus"}, "interval": "15s",
                   "scrapeTimeout": "10s"},
    "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"},
                       "alertLabels": {"team": "ml"},
                       "runbookBaseUrl": "https://git.example.com/ml/bidir-kv/charts/README.md",
                       "alerts": {"reuseHitRatioLow": {"threshold": 0.25, "window": "30m",
                                                       "minTurnsPerSecond": 0.5},
                                  "decodePinnedNearCapacity": {"threshold": 0.95,
                                                               "for": "20m"},
                                  "handleStoreErrors": {"enabled": False},
                                  "prefillOnlyMode": {"severity": "warning"}}},
    "dashboard": {"enabled": True, "labels": {"team": "ml"}, "namespace": "grafana",
                  "annotations": {"grafana_folder": "LLM"}},
}


def monitoring_objects(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("PodMonitor", "PrometheusRule")
            or d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")]


def the(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in monitoring_objects(docs) if d["kind"] == kind]
    return doc


# -- rendered only when asked ----------------------------------------------------------------

def test_nothing_by_default():
    docs, notes = render({})
    assert monitoring_objects(docs) == []
    assert "PodMonitor" not in notes and "PrometheusRule" not in notes


@pytest.mark.parametrize("key", sorted(KINDS))
def test_each_only_when_asked(key):
    docs, notes = render({key: {"enabled": True}})
    assert [d["kind"] for d in monitoring_objects(docs)] == [KINDS[key]]
    assert [d for d in docs if d not in monitoring_objects(docs)] == render({})[0]
    doc = monitoring_objects(docs)[0]
    assert doc["metadata"]["namespace"] == NAMESPACE
    assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    assert doc["metadata"]["name"] in notes


def test_names_namespaces_and_labels():
    docs, _ = render(CUSTOM)
    pm, rule, dash = (the(docs, k) for k in ("PodMonitor", "PrometheusRule", "ConfigMap"))
    assert pm["metadata"]["name"] == f"{RELEASE}-engines"
    assert rule["metadata"]["name"] == RELEASE
    assert dash["metadata"]["name"] == f"{RELEASE}-dashboard"
    assert pm["metadata"]["namespace"] == rule["metadata"]["namespace"] == NAMESPACE
    assert dash["metadata"]["namespace"] == "grafana"
    assert pm["metadata"]["labels"]["release"] == rule["metadata"]["labels"]["release"] \
        == "prometheus"
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dash["metadata"]["labels"]["team"] == "ml"
    assert dash["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    # The sidecar's label value can be changed, never duplicated.
    changed = the(render({"dashboard": {"enabled": True,
                                         "labels": {"grafana_dashboard": "bidir"}}})[0],
                  "ConfigMap")
    assert changed["metadata"]["labels"]["grafana_dashboard"] == "bidir"


@pytest.mark.parametrize("kube", [f"v{v}.0" for v in KUBE_VERSIONS])
def test_lint_strict(kube):
    report = helm.lint(CHART, CUSTOM, strict=True, kube_version=kube)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


# -- valid objects ----------------------------------------------------------------------------

def pruned_paths(given, kept, path: str = "") -> list[str]:
    """Paths of `given` that the CRD's structural schema pruned (a misspelt field)."""
    if isinstance(given, dict):
        if not isinstance(kept, dict):
            return [path]
        return [p for k, v in given.items()
                for p in ([f"{path}.{k}"] if k not in kept else pruned_paths(v, kept[k],
                                                                              f"{path}.{k}"))]
    if isinstance(given, list) and isinstance(kept, list):
        return [p for i, (a, b) in enumerate(zip(given, kept, strict=True))
                for p in pruned_paths(a, b, f"{path}[{i}]")]
    return []


@pytest.mark.parametrize("values", [ALL_ON, CUSTOM], ids=["defaults", "custom"])
def test_objects_are_valid(values):
    docs, _ = render(values)
    for doc in monitoring_objects(docs):
        assert len(doc["metadata"]["name"]) <= 63
        if doc["kind"] in CRD_FILES:
            crd = yaml.safe_load(CRD_FILES[doc["kind"]].read_text())
            assert doc["apiVersion"] == f"{crd['spec']['group']}/v1"
            kept, errors = validate_custom_resource(crd, doc, strict_cel=False)
            assert [str(e) for e in errors] == []
            assert pruned_paths(doc, kept) == []
        else:
            for version in KUBE_VERSIONS:
                assert schema_errors(doc, version) == []


def test_vendored_crds_are_prometheus_operators():
    for kind, path in CRD_FILES.items():
        text = path.read_text()
        header, _, body = text.partition("\n---\n")
        assert "prometheus-operator v0.93.0 (Apache-2.0), unmodified" in header
        crd = yaml.safe_load(body)
        assert crd["metadata"]["annotations"]["operator.prometheus.io/version"] == "0.93.0"
        assert crd["spec"]["names"]["kind"] == kind


# -- the PodMonitor ---------------------------------------------------------------------------

def test_pod_monitor_selects_the_engines(example):
    pm = the(render(CUSTOM)[0], "PodMonitor")
    spec = pm["spec"]
    assert spec["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    (endpoint,) = spec["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    assert (endpoint["interval"], endpoint["scrapeTimeout"]) == ("15s", "10s")
    # The operator's pods: the engines match (by a container port named http), the
    # router does not.
    workloads = [o for o in render_resource(example)
                 if o["kind"] in ("StatefulSet", "Deployment")]
    selector = LabelSelector.parse(selector_to_string(spec["selector"]))
    selected = {}
    for w in workloads:
        pod = w["spec"]["template"]
        if selector.matches(pod["metadata"]["labels"]):
            ports = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
            assert endpoint["port"] in ports
            selected[w["metadata"]["name"]] = pod["metadata"]["labels"]
    assert sorted(selected) == ["qwen3-32b-decode", "qwen3-32b-prefill"]
    # The role label the dashboard splits engines by comes from the component label.
    (relabel,) = endpoint["relabelings"]
    source = relabel["sourceLabels"][0].removeprefix("__meta_kubernetes_pod_label_")
    assert relabel["targetLabel"] == "role"
    assert {labels[k] for labels in selected.values() for k in labels
            if re.sub(r"[^a-zA-Z0-9_]", "_", k) == source} == {"prefill", "decode"}
    everywhere = the(render({"podMonitor": {"enabled": True}})[0], "PodMonitor")
    assert everywhere["spec"]["namespaceSelector"] == {"any": True}
    assert "scrapeTimeout" not in everywhere["spec"]["podMetricsEndpoints"][0]


# -- the PrometheusRule -----------------------------------------------------------------------

def alerts(values: dict) -> dict[str, dict]:
    rule = monitoring.prometheus_rule(values)
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}


def github_anchors(markdown: str) -> set[str]:
    """The ids GitHub gives the headings of a Markdown file."""
    out = set()
    for line in markdown.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
    return out


def test_every_alert_and_its_runbook():
    rules = alerts({})
    assert sorted(rules) == sorted(ALERTS)
    anchors = github_anchors((CHART / "README.md").read_text())
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"]
        assert "runbook_url" not in annotations
        section = re.fullmatch(r"charts/bidir-kv/README\.md#(\S+) \(bidir-kv chart \S+\)",
                               annotations["runbook"])
        assert section and section.group(1) == name.lower()
        assert name.lower() in anchors, f"no README section for {name}"
        assert re.fullmatch(r"\d+[smh]", rule["for"])


def test_prometheus_templates_survive_helm():
    rules = alerts({})
    # Prometheus' templating reaches the rule as written: Helm did not evaluate it.
    text = json.dumps(rules)
    assert "{{ $labels.namespace }}" in text and "{{ $labels.url }}" in text
    assert "{{ $value | humanizePercentage }}" in text
    assert "{{ $labels.pod }}" in rules["BidirKVPrefillOnlyMode"]["annotations"]["description"]
    for rule in rules.values():
        for value in rule["annotations"].values():
            # Every {{ ... }} left is one of Prometheus' own, balanced.
            for action in re.findall(r"\{\{(.*?)\}\}", value):
                assert re.fullmatch(r" \$(labels\.\w+|value)( \| \w+)? ", action), action
            assert value.count("{{") == value.count("}}")


def test_custom_alert_values():
    rules = alerts(CUSTOM)
    assert "BidirKVHandleStoreErrors" not in rules
    reuse = rules["BidirKVReuseHitRatioLow"]["expr"]
    assert ") < 0.25\n" in reuse and "[30m]" in reuse and "> 0.5\n" in reuse
    assert "[15m]" not in reuse
    pinned = rules["BidirKVDecodePinnedNearCapacity"]
    assert pinned["expr"].endswith("> 0.95") and pinned["for"] == "20m"
    assert rules["BidirKVPrefillOnlyMode"]["labels"] == {"severity": "warning", "team": "ml"}
    for name, rule in rules.items():
        assert rule["annotations"]["runbook_url"] == (
            f"https://git.example.com/ml/bidir-kv/charts/README.md#{name.lower()}")
        assert "runbook" not in rule["annotations"]
        # Only the watched namespaces' routers.
        for selector in re.findall(r"bidirkv_router_\w+\{[^}]*\}", rule["expr"]):
            assert 'namespace=~"team-a|team-b"' in selector, selector


def test_every_alert_can_be_turned_off():
    off = {key: {"enabled": False} for key in ALERTS.values()}
    for key in ALERTS.values():
        assert len(alerts({"prometheusRule": {"alerts": {key: {"enabled": False}}}})) == 6
    docs, _ = render({"prometheusRule": {"enabled": True, "alerts": off}})
    assert by_kind(docs, "PrometheusRule") == []


def test_rules_use_the_dashboards_outcome_sets():
    """The hit ratio the alert watches is the dashboard's, over the outcomes the router
    exports."""
    assert set(dashboard_tool.REACHED_PREFILL) <= set(REUSE_OUTCOMES)
    assert set(dashboard_tool.REUSED) <= set(dashboard_tool.REACHED_PREFILL)
    assert {"off", "extended"} == set(REUSE_OUTCOMES) - set(dashboard_tool.REACHED_PREFILL)
    assert set(dashboard_tool.SERVER_ERRORS) <= set(REQUEST_OUTCOMES) - {"ok"}
    expr = monitoring.rule_exprs()["BidirKVReuseHitRatioLow"]
    assert f'outcome=~"{dashboard_tool.regex(dashboard_tool.REUSED)}"' in expr
    assert f'outcome=~"{dashboard_tool.regex(dashboard_tool.REACHED_PREFILL)}"' in expr


BAD_VALUES = [
    ({"podMonitor": {"enabled": "yes"}}, "/podMonitor/enabled"),
    ({"podMonitor": {"interval": "soon"}}, "/podMonitor/interval"),
    ({"podMonitor": {"port": "http"}}, "'port' not allowed"),
    ({"dashboard": {"namespace": "Grafana_NS"}}, "/dashboard/namespace"),
    ({"dashboard": {"labels": {"grafana_dashboard": 1}}}, "/dashboard/labels/grafana_dashboard"),
    ({"prometheusRule": {"runbookBaseUrl": "ftp://example.com"}},
     "/prometheusRule/runbookBaseUrl"),
    ({"prometheusRule": {"alerts": {"reuseHitRatioLow": {"threshold": 1.5}}}},
     "/prometheusRule/alerts/reuseHitRatioLow/threshold"),
    ({"prometheusRule": {"alerts": {"reuseHitRatioLow": {"window": "0"}}}},
     "/prometheusRule/alerts/reuseHitRatioLow/window"),
    ({"prometheusRule": {"alerts": {"decodePinnedNearCapacity": {"threshold": 0}}}},
     "/prometheusRule/alerts/decodePinnedNearCapacity/threshold"),
    ({"prometheusRule": {"alerts": {"prefillOnlyMode": {"severity": "page"}}}},
     "/prometheusRule/alerts/prefillOnlyMode/severity"),
    ({"prometheusRule": {"alerts": {"decodeReplicaDown": {"for": "a while"}}}},
     "/prometheusRule/alerts/decodeReplicaDown/for"),
    ({"prometheusRule": {"alerts": {"decodeDown": {}}}}, "'decodeDown' not allowed"),
]


@pytest.mark.parametrize(("values", "where"), BAD_VALUES, ids=[w for _, w in BAD_VALUES])
def test_bad_values_are_rejected(values, where):
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError) as excinfo:
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert where in str(excinfo.value)


# -- the dashboard ----------------------------------------------------------------------------

def test_dashboard_is_the_generated_one():
    assert dashboard_tool.DASHBOARD_FILE == monitoring.DASHBOARD_FILE
    assert monitoring.DASHBOARD_FILE.read_text() == dashboard_tool.render(), (
        "charts/bidir-kv/dashboards/bidir-kv.json is not what tools/dashboard.py writes: "
        "run `make monitoring`")
    configmap = the(render({"dashboard": {"enabled": True}})[0], "ConfigMap")
    assert json.loads(configmap["data"]["bidir-kv.json"]) == monitoring.dashboard()


def test_dashboard_shape():
    dash = monitoring.dashboard()
    assert dash["uid"] == "bidir-kv" and dash["id"] is None
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["namespace"]["datasource"] == {"type": "prometheus",
                                                    "uid": "${datasource}"}
    panels = dash["panels"]
    assert [p["title"] for p in panels if p["type"] == "row"] == list(ROWS)
    assert len({p["id"] for p in panels}) == len(panels)
    taken: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                 for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{p['title']} overlaps another panel"
        taken |= cells
        if p["type"] == "row":
            continue
        assert p["type"] in ("timeseries", "stat")
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"] and p["description"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"]
            assert 'namespace=~"$namespace"' in t["expr"], p["title"]
            # Ranges follow the scrape interval Grafana knows, never a fixed window.
            assert set(re.findall(r"\[([^\]]*)\]", t["expr"])) <= {"$__rate_interval"}


# -- PromQL -----------------------------------------------------------------------------------

def test_the_parser_rejects_what_prometheus_would():
    monitoring.require_parser()
    broken = ["sum(rate(foo[5m])", 'foo{a=}', "rate(foo)", "sum(foo[5m])", "foo +", "",
              'histogram_quantile(0.9, rate(x_bucket[5m])) by (le)']
    good = ['sum by (le) (rate(foo_bucket{namespace=~"$namespace"}[$__rate_interval]))',
            '{__name__="only_by_name"}', "vllm:num_requests_running > bool 0",
            'a / on (x) group_left b offset 5m']
    results = monitoring.parse_report(broken + good)
    assert [r.ok for r in results] == [False] * len(broken) + [True] * len(good)
    assert all(r.errors for r in results[:len(broken)])
    names = [set(r.metric_names) for r in results[len(broken):]]
    assert names == [{"foo_bucket"}, set(), {"vllm:num_requests_running"}, {"a", "b"}]
    assert monitoring.parse(["up"]) == [(True, frozenset({"up"}))]


def test_every_expression_parses_and_names_a_metric():
    monitoring.require_parser()
    exprs = {**monitoring.dashboard_exprs(), **monitoring.rule_exprs(),
             **{f"custom {k}": v for k, v in monitoring.rule_exprs(CUSTOM).items()}}
    for (where, expr), report in zip(exprs.items(), monitoring.parse_report(exprs.values()),
                                     strict=True):
        assert report.ok, f"{where}: {expr}\n{report.errors}"
        assert report.metric_names, f"{where} names no metric: {expr}"


def exported_names() -> set[str]:
    """Metric names as exposed by the router (its registry) and by vLLM with bidir-kv's
    connector (their sources: vLLM is only read, never imported)."""
    suffixes = {"counter": ("_total",), "gauge": ("",), "info": ("_info",),
                "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
    names = {f.name + s for f in Metrics().registry.collect() for s in suffixes[f.type]}
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed (make engine): its metric names are unknown")
    vllm = pathlib.Path(spec.origin).parent
    for source in (vllm / "v1" / "metrics" / "loggers.py",
                   vllm / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "nixl"
                   / "stats.py"):
        for kind, name in re.findall(r"_(counter|gauge|histogram)_cls\(\s*name=\"(vllm:\w+)\"",
                                     source.read_text()):
            names |= {name + s for s in suffixes[kind]}
    connector = (ROOT / "bidirkv" / "connector" / "nixl" / "stats.py").read_text()
    assert "self._counter_cls(name=name" in connector  # every one of METRICS a counter
    names |= {n + "_total" for n in re.findall(r"\"(vllm:bidirkv_\w+)\"", connector)}
    return names


def test_every_metric_named_is_exported():
    monitoring.require_parser()
    named = monitoring.metric_names_of_all()
    assert {"bidirkv_router_requests_total", "vllm:bidirkv_reuse_total",
            "vllm:nixl_xfer_time_seconds_bucket"} <= named
    assert sorted(named - exported_names()) == []


# -- the alerts' behaviour, with Prometheus' promtool (optional) -----------------------------

def _promtool() -> str | None:
    return os.environ.get("PROMTOOL") or shutil.which("promtool")


def _humanize(v: float) -> str:
    """Prometheus' `humanize` for the values below (SI prefixes, 4 significant digits)."""
    prefix = ""
    for p in ("m", "u", "n", "p"):
        if v == 0 or abs(v) >= 1:
            break
        prefix, v = p, v * 1000
    for p in ("k", "M", "G", "T"):
        if abs(v) < 1000:
            break
        prefix, v = p, v / 1000
    return f"{v:.4g}{prefix}"


HUMANIZE = {"humanize": _humanize, "humanizePercentage": lambda v: f"{v * 100:.4g}%"}


def _expected_annotations(rule: dict, labels: dict[str, str], value: float) -> dict[str, str]:
    """The rule's annotations as Prometheus renders them (only the actions
    test_prometheus_templates_survive_helm allows)."""
    def action(m: re.Match[str]) -> str:
        ref, _, fn = (part.strip() for part in m.group(1).partition("|"))
        return labels[ref.removeprefix("$labels.")] if ref != "$value" else HUMANIZE[fn](value)
    return {k: re.sub(r"\{\{(.*?)\}\}", action, v) for k, v in rule["annotations"].items()}


ROUTER = {"namespace": "team-a", "service": "qwen-router", "pod": "qwen-router-0"}
DECODE_URL = "http://qwen-decode-0.qwen-decode.team-a.svc:8000"


def _series(metric: str, values: str, **labels: str) -> dict[str, str]:
    labels = {**ROUTER, **labels}
    return {"series": metric + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}",
            "values": values}


def _reuse(**per_minute: int) -> list[dict[str, str]]:
    """bidirkv_router_reuse_total over an hour, each outcome growing by its count a minute
    (every outcome exported, as the router does)."""
    return [_series("bidirkv_router_reuse_total", f"0+{per_minute.get(o, 0)}x60", outcome=o)
            for o in REUSE_OUTCOMES]


# (alert, input series, minute evaluated, labels of the alert expected or None, its $value)
SCENARIOS = [
    ("BidirKVReuseHitRatioLow", _reuse(miss=60), 35,
     {"namespace": "team-a", "service": "qwen-router"}, 0.0),
    ("BidirKVReuseHitRatioLow", _reuse(hit=30, miss=30), 35, None, 0),
    ("BidirKVReuseHitRatioLow", _reuse(miss=1), 35, None, 0),  # too few turns to judge
    ("BidirKVReuseHitRatioLow", _reuse(miss=6, off=60), 35, None, 0),  # mostly off
    ("BidirKVDecodePinnedNearCapacity",
     [_series("bidirkv_router_decode_pinned_blocks", "95x30", url=DECODE_URL),
      _series("bidirkv_router_decode_kv_blocks", "100x30", url=DECODE_URL)], 20,
     {"namespace": "team-a", "service": "qwen-router", "url": DECODE_URL}, 0.95),
    ("BidirKVDecodePinnedNearCapacity",
     [_series("bidirkv_router_decode_pinned_blocks", "80x30", url=DECODE_URL),
      _series("bidirkv_router_decode_kv_blocks", "100x30", url=DECODE_URL)], 20, None, 0),
    ("BidirKVLeaseRenewalsFailing",
     [_series("bidirkv_router_residency_calls_total", "0+1x30", result="error"),
      _series("bidirkv_router_residency_calls_total", "0+12x30", result="ok")], 15, ROUTER,
     1 / 60),
    ("BidirKVLeaseRenewalsFailing",
     [_series("bidirkv_router_residency_calls_total", "0+12x30", result="ok")], 15, None, 0),
    ("BidirKVHandleStoreDown", [_series("bidirkv_router_handle_store_up", "1 1 0x20")], 10,
     ROUTER, 0),
    ("BidirKVHandleStoreErrors",
     [_series("bidirkv_router_handle_store_errors_total", "0+2x30", op="put")], 20,
     {"namespace": "team-a", "service": "qwen-router", "op": "put"}, 2 / 60),
    ("BidirKVPrefillOnlyMode", [_series("bidirkv_router_prefill_only_mode", "0 0 1x20")], 10,
     ROUTER, 1),
    ("BidirKVPrefillOnlyMode", [_series("bidirkv_router_prefill_only_mode", "0x20")], 10,
     None, 0),
    ("BidirKVDecodeReplicaDown",
     [_series("bidirkv_router_backend_healthy", "0x20", role="decode", url=DECODE_URL),
      _series("bidirkv_router_backend_healthy", "0x20", role="decode", url=DECODE_URL,
              pod="qwen-router-1")], 10,
     {"namespace": "team-a", "service": "qwen-router", "url": DECODE_URL}, 0),
    # One router still reaches it: not down.
    ("BidirKVDecodeReplicaDown",
     [_series("bidirkv_router_backend_healthy", "0x20", role="decode", url=DECODE_URL),
      _series("bidirkv_router_backend_healthy", "1x20", role="decode", url=DECODE_URL,
              pod="qwen-router-1")], 10, None, 0),
]


@pytest.mark.skipif(_promtool() is None,
                    reason="no promtool: set PROMTOOL=/path/to/promtool (e.g. /usr/bin/promtool "
                    "of Debian's prometheus package)")
@pytest.mark.parametrize("watch", [[], ["team-a"], ["team-b"]], ids=["all", "watched",
                                                                     "other"])
def test_promtool_alerts_fire_when_they_should(tmp_path, watch):
    rule = monitoring.prometheus_rule({"watchNamespaces": watch})
    rules = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
    tests = []
    for alert, series, minute, labels, value in SCENARIOS:
        fires = labels is not None and watch != ["team-b"]  # team-a's series
        expected = [{"exp_labels": {**labels, **rules[alert]["labels"]},
                     "exp_annotations": _expected_annotations(rules[alert], labels, value)}
                    ] if fires else []
        tests.append({"interval": "1m", "input_series": series, "alert_rule_test": [
            {"eval_time": f"{minute}m", "alertname": alert, "exp_alerts": expected}]})
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(
        {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}))
    for command in ("check", "test"):
        done = subprocess.run([_promtool(), command, "rules",
                               "rules.yaml" if command == "check" else "tests.yaml"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
