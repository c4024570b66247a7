"""`helm install/upgrade/uninstall` of charts/bidir-kv into the in-memory API server, then
the operator started with the arguments of the rendered Deployment, and its RBAC.

Helm is the real Go SDK (helm-python-sdk): memory release storage, client-side apply and
no OpenAPI validation (the emulator serves no /openapi), both set through the library's
option JSON. What the emulator lacks is played here:
- the Job controller and kubelet, for the CRD-upgrade hook: the Job's own command runs
  in-process (`bidir-kv crd --apply`, with a kubeconfig for the in-cluster credentials it
  would have) and its status is set Complete, which is what Helm waits for;
- RBAC: the emulator allows every request and logs it in RBAC terms; the rendered roles
  are evaluated here against that log, both ways (covers every request; grants nothing
  that was not used, but the allow-listed).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import pathlib
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import helm_python as helm
import pytest
import yaml
from aiohttp import web
from helm_python import _native

from bidirkv.cli import build_parser
from bidirkv.cli import main as cli_main
from bidirkv.operator.api import spec as api
from bidirkv.operator.crd.schema import build_crd
from bidirkv.operator.kube import KubeClient, load_configuration
from bidirkv.operator.main import operator_options, run_operator
from bidirkv.operator.reconcile.controller import Controller
from kubeapi.patch import MERGE_PATCH
from kubeapi.server import KubeAPIServer, Request, running_kubeapi

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "bidir-kv"
SERVICEMONITOR_CRD = (ROOT / "e2e" / "cluster" / "crds"
                      / "monitoring.coreos.com_servicemonitors.yaml")
PODMONITOR_CRD = ROOT / "e2e" / "cluster" / "crds" / "monitoring.coreos.com_podmonitors.yaml"
RELEASE, RELEASE_NS = "bidir-kv", "bidir-kv-system"
TOKEN = "kubeapi-test-token"  # the user of the emulator's kubeconfig
CRD_NAME = build_crd()["metadata"]["name"]
HA_VALUES = {"replicaCount": 2, "watchNamespaces": ["default", "ns1"],
             "serviceMonitor": {"enabled": True}}

# Granted but not exercised by the runs here, each with the reason it is needed (rule key:
# apiGroup, resource, verb, resourceName or ""). The runs use every other rule granted
# (events by a name clash, update by a hand edit of each kind, peering in both scopes).
ALLOWED_UNUSED: dict[tuple[str, str, str, str], str] = {
    # The example's roles have fixed replica counts, so this run makes no autoscaler; the
    # rights are the ones an autoscaled role needs, and e2e/test_operator_autoscaling.py
    # exercises each (create, update to a new target, delete on a switch of engine).
    **{("autoscaling", "horizontalpodautoscalers", verb, ""): "an autoscaled role's HPA "
       "(e2e/test_operator_autoscaling.py)" for verb in ("create", "update", "delete")},
    **{("keda.sh", "scaledobjects", verb, ""): "an autoscaled role's KEDA ScaledObject "
       "(e2e/test_operator_autoscaling.py)" for verb in ("get", "create", "update", "delete")},
}

pytestmark = pytest.mark.timeout(120)


# -- the emulated cluster ------------------------------------------------------------------

class HelmKubeAPIServer(KubeAPIServer):
    """The emulator plus the one thing Helm needs that it lacks: `/openapi/v3`.

    Helm always validates hook manifests ("failed to download openapi" otherwise);
    client-go first asks the OpenAPI v3 document whether the server does field validation
    itself (a `fieldValidation` parameter on each kind's PATCH). Saying yes here sends
    `fieldValidation=Strict` to the emulator, which ignores it: built-in kinds are checked
    against the strict schemas in tests/test_chart.py instead.

    It also keeps the credentials each request came with (`auth_log`): the emulator
    authenticates nobody, so a client that sends none goes unnoticed otherwise. (client-go,
    so Helm, sends a kubeconfig's credentials over TLS only: its requests here carry none;
    the Python clients send them over plain HTTP too.)"""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.auth_log: list[tuple[str, str, str | None]] = []

    async def _handle(self, request):
        self.auth_log.append((request.method, request.path_qs,
                              request.headers.get("Authorization")))
        return await super()._handle(request)

    def unauthenticated(self) -> list[tuple[str, str]]:
        return [(m, p) for m, p, auth in self.auth_log if auth != f"Bearer {TOKEN}"]

    async def _route(self, request):
        path = request.path.rstrip("/")
        if path == "/openapi/v3":
            return web.json_response({"paths": {
                gv: {"serverRelativeURL": f"/openapi/v3/{gv}?hash=0"} for gv in self._gvs()}})
        if path.startswith("/openapi/v3/"):
            gv = path.removeprefix("/openapi/v3/")
            if gv in self._gvs():
                return web.json_response(self._gv_doc(gv))
        return await super()._route(request)

    def _gvs(self) -> dict[str, list]:
        out: dict[str, list] = {}
        for rt in self.store.registry.all():
            gv = f"apis/{rt.group}/{rt.version}" if rt.group else f"api/{rt.version}"
            out.setdefault(gv, []).append(rt)
        return out

    def _gv_doc(self, gv: str) -> dict:
        paths = {}
        for rt in self._gvs()[gv]:
            scope = "/namespaces/{namespace}" if rt.namespaced else ""
            paths[f"/{gv}{scope}/{rt.plural}/{{name}}"] = {"patch": {
                "x-kubernetes-group-version-kind": {"group": rt.group, "version": rt.version,
                                                    "kind": rt.kind},
                "parameters": [{"name": "fieldValidation", "in": "query",
                                "schema": {"type": "string"}}],
                "responses": {"200": {"description": "OK"}}}}
        return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.33.0"},
                "paths": paths}


def running_server() -> contextlib.AbstractContextManager[HelmKubeAPIServer]:
    """`running_kubeapi` with the subclass: its own loop in a background thread."""
    return running_kubeapi(HelmKubeAPIServer, gc=True)


def _rt(server: KubeAPIServer, api_version: str, plural: str):
    group, _, version = api_version.rpartition("/")
    return server.store.rt(group, version, plural)


def store_create(server: KubeAPIServer, obj: dict, plural: str) -> dict:
    """A write by the test itself: straight into the store, so not in the request log."""
    ns = obj["metadata"].get("namespace")
    return server.store.create(_rt(server, obj["apiVersion"], plural), ns, copy.deepcopy(obj))


def store_patch(server: KubeAPIServer, api_version: str, plural: str, ns: str | None,
                name: str, patch: dict, subresource: str | None = None) -> dict:
    obj, _ = server.store.patch(_rt(server, api_version, plural), ns, name, MERGE_PATCH, patch,
                                subresource=subresource)
    return obj


def namespace(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


class HookJobs:
    """The Job controller and kubelet for Helm's hook Jobs: runs each new Job's container
    command in-process against the emulator and marks the Job Complete (or Failed)."""

    def __init__(self, server: KubeAPIServer, kubeconfig: pathlib.Path):
        self.server, self.kubeconfig = server, kubeconfig
        self.runs: list[dict[str, Any]] = []
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hook-jobs", daemon=True)

    def __enter__(self) -> HookJobs:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            for job in self.server.list("batch/v1", "jobs"):
                if job["metadata"]["uid"] not in self._seen:
                    self._seen.add(job["metadata"]["uid"])
                    self._run(job)

    def _run(self, job: dict) -> None:
        pod = job["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        argv = container.get("command", []) + container.get("args", [])
        assert argv[0] == "bidir-kv", argv
        start, auth_start = len(self.server.requests), len(self.server.auth_log)
        # In a pod the client finds its service account's token; here, a kubeconfig.
        rc = cli_main(argv[1:] + ["--kubeconfig", str(self.kubeconfig)])
        requests = [r for r in self.server.requests[start:]
                    if r.resource == "customresourcedefinitions"]
        credentials = [auth for _, path, auth in self.server.auth_log[auth_start:]
                       if "customresourcedefinitions" in path]
        self.runs.append({"job": job, "argv": argv, "rc": rc, "requests": requests,
                          "credentials": credentials})
        ok = rc == 0
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        condition = {"type": "Complete" if ok else "Failed", "status": "True",
                     "lastProbeTime": now, "lastTransitionTime": now}
        store_patch(self.server, "batch/v1", "jobs", job["metadata"]["namespace"],
                    job["metadata"]["name"],
                    {"status": {"conditions": [condition], "startTime": now,
                                "succeeded" if ok else "failed": 1}},
                    subresource="status")


class Helm:
    """helm install/upgrade/uninstall as the CLI would do them, into the emulator."""

    def __init__(self, kubeconfig: pathlib.Path):
        self.config = helm.Config(kubeconfig_path=kubeconfig, storage_driver="memory",
                                  namespace=RELEASE_NS)

    def _action(self, action: str, values: dict, ssa: Any) -> dict:
        # server_side_apply is not among Config.install/upgrade's keywords: off, as the
        # emulator's apply is a create-or-merge that never removes a field (an upgrade
        # would keep what the new manifest dropped); Helm's three-way merge patches then.
        opts = {"namespace": RELEASE_NS, "timeout_seconds": 60, "server_side_apply": ssa}
        return json.loads(_native.call_string(
            action, self.config._raw(), _native.HANDLE(0), _native.HANDLE(0), str(CHART),
            RELEASE, json.dumps(values), json.dumps(opts)))

    def install(self, values: dict) -> dict:
        return self._action("helm_install", values, False)

    def upgrade(self, values: dict) -> dict:
        return self._action("helm_upgrade", values, "false")  # a string in Helm 4's upgrade

    def uninstall(self) -> dict:
        return self.config.uninstall(RELEASE)

    def manifest(self) -> list[dict]:
        return [d for d in yaml.safe_load_all(self.config.status(RELEASE)["manifest"]) if d]

    def close(self) -> None:
        self.config.close()


@contextlib.contextmanager
def cluster(tmp_path: pathlib.Path) -> Iterator[tuple[KubeAPIServer, Helm, HookJobs]]:
    with running_server() as server:
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        for ns in (RELEASE_NS, "ns1"):
            store_create(server, namespace(ns), "namespaces")
        client = Helm(kubeconfig)
        try:
            with HookJobs(server, kubeconfig) as jobs:
                yield server, client, jobs
        finally:
            client.close()


# -- the operator as the chart runs it -----------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def operator_container(manifest: list[dict]) -> dict:
    (deploy,) = [d for d in manifest if d["kind"] == "Deployment"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    return container


@contextlib.contextmanager
def chart_operator(manifest: list[dict], kubeconfig: pathlib.Path, pod_name: str,
                   monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[dict, Controller]]:
    """`bidir-kv operator` with the rendered Deployment's command and args, in a thread
    with its own event loop (as its own process would be), as pod `pod_name`. Yields its
    run_operator options and its controller."""
    container = operator_container(manifest)
    argv = container["command"] + container["args"]
    assert argv[:2] == ["bidir-kv", "operator"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    monkeypatch.setenv("POD_ID", pod_name)  # the downward API's value in that pod
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    monkeypatch.setenv("POD_NAMESPACE", RELEASE_NS)
    args = build_parser().parse_args(argv[1:] + ["--kubeconfig", str(kubeconfig)])
    options = operator_options(args)
    # The liveness endpoint the probe calls: same path, the container's port; bound to
    # 127.0.0.1 and a free port here instead of 0.0.0.0:8080.
    url = urlsplit(options["liveness_endpoint"])
    probe = container["livenessProbe"]["httpGet"]
    port = next(p for p in container["ports"] if p["name"] == probe["port"])
    assert (url.port, url.path) == (port["containerPort"], probe["path"])
    local_port = _free_port()
    options["liveness_endpoint"] = urlunsplit(url._replace(netloc=f"127.0.0.1:{local_port}"))

    configuration = load_configuration(args.kubeconfig)
    controller = Controller(KubeClient(configuration), debounce=0.02,
                            operator_namespace=options["operator_namespace"])
    stop, ready = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(run_operator(configuration, stop_flag=stop, ready_flag=ready,
                                     controller=controller, **options))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)
            ready.set()

    thread = threading.Thread(target=target, name="chart-operator", daemon=True)
    thread.start()
    try:
        assert ready.wait(30) and not errors, f"operator did not start: {errors}"
        health = f"http://127.0.0.1:{local_port}{probe['path']}"
        eventually(lambda: _probe(health), f"the liveness endpoint {health}")
        yield options, controller
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive(), "operator did not stop"
    if errors:
        raise errors[0]


def _probe(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def eventually(check, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


CHILDREN = [("apps/v1", "statefulsets", "prefill"), ("apps/v1", "statefulsets", "decode"),
            ("v1", "services", "prefill"), ("v1", "services", "decode"),
            ("v1", "services", "router"), ("policy/v1", "poddisruptionbudgets", "prefill"),
            ("policy/v1", "poddisruptionbudgets", "decode"), ("v1", "configmaps", "router"),
            ("apps/v1", "deployments", "router"),
            ("networking.k8s.io/v1", "networkpolicies", "engines"),
            ("networking.k8s.io/v1", "networkpolicies", "router")]
# One hand edit per kind the operator writes; it must put each back (update).
DRIFT = [("apps/v1", "statefulsets", "decode", {"spec": {"replicas": 7}},
          lambda o: o["spec"]["replicas"] == 2),
         ("apps/v1", "deployments", "router", {"spec": {"replicas": 5}},
          lambda o: o["spec"]["replicas"] == 1),
         ("v1", "services", "decode", {"spec": {"publishNotReadyAddresses": False}},
          lambda o: o["spec"]["publishNotReadyAddresses"] is True),
         ("policy/v1", "poddisruptionbudgets", "prefill", {"spec": {"maxUnavailable": 3}},
          lambda o: o["spec"]["maxUnavailable"] == 1),
         ("v1", "configmaps", "router", {"data": {"router.json": "{}"}},
          lambda o: "decode-0" in o["data"]["router.json"]),
         ("networking.k8s.io/v1", "networkpolicies", "engines",
          {"spec": {"ingress": [{}]}}, lambda o: len(o["spec"]["ingress"]) == 2)]


def exercise_operator(server: KubeAPIServer, example: dict, ns: str) -> None:
    """What one operator run does here: reconcile examples/inference.yaml, report a name
    clash (an Event), and restore a hand edit of each kind of child."""
    name = example["metadata"]["name"]

    def child(api_version: str, plural: str, component: str) -> dict | None:
        return server.get(api_version, plural, ns, f"{name}-{component}")

    eventually(lambda: all(child(*c) for c in CHILDREN), "every child of the example")
    status = eventually(lambda: ((server.get(f"{api.GROUP}/{api.VERSION}", api.PLURAL, ns,
                                             name) or {}).get("status") or {}).get(
        "conditions") and server.get(f"{api.GROUP}/{api.VERSION}", api.PLURAL, ns,
                                     name)["status"], "the example's status")
    # The handle-key Secret: the one the status records (created, never read).
    key = status["handleKey"]
    assert server.get("v1", "secrets", ns, key["name"])["metadata"]["uid"] == key["uid"]
    eventually(lambda: [e for e in server.list("v1", "events", ns)
                        if e["reason"] == "ChildConflict"], "a ChildConflict event")
    for api_version, plural, component, patch, _ in DRIFT:
        store_patch(server, api_version, plural, ns, f"{name}-{component}", patch)
    for api_version, plural, component, _, restored in DRIFT:
        eventually(lambda a=api_version, p=plural, c=component, r=restored: r(child(a, p, c)),
                   f"{plural} {component} restored")
    # The engines' PodMonitor: created, changed with the spec, deleted when turned off.
    if not server.get("apiextensions.k8s.io/v1", "customresourcedefinitions", None,
                      "podmonitors.monitoring.coreos.com"):
        store_create(server, yaml.safe_load(PODMONITOR_CRD.read_text()),
                     "customresourcedefinitions")
    di_api = f"{api.GROUP}/{api.VERSION}"
    for interval in ("30s", "15s"):
        store_patch(server, di_api, api.PLURAL, ns, name, {"spec": {"monitoring": {
            "podMonitor": {"enabled": True, "interval": interval}}}})
        eventually(lambda i=interval: (child("monitoring.coreos.com/v1", "podmonitors",
                                             "engines") or {"spec": {}})["spec"].get(
            "podMetricsEndpoints", [{}])[0].get("interval") == i, f"PodMonitor at {interval}")
    store_patch(server, di_api, api.PLURAL, ns, name,
                {"spec": {"monitoring": {"podMonitor": {"enabled": False}}}})
    eventually(lambda: child("monitoring.coreos.com/v1", "podmonitors", "engines") is None,
               "PodMonitor deleted")


def seed(server: KubeAPIServer, example: dict, minimal: dict, ns: str) -> None:
    """Objects that exist before the operator starts (written by the test, not logged): the
    example, and a resource whose router ConfigMap name is taken."""
    di = copy.deepcopy(example)
    di["metadata"]["namespace"] = ns
    store_create(server, di, api.PLURAL)
    clash = copy.deepcopy(minimal)
    clash["metadata"] = {"name": "clash", "namespace": ns}
    store_create(server, clash, api.PLURAL)
    store_create(server, {"apiVersion": "v1", "kind": "ConfigMap",
                          "metadata": {"name": "clash-router", "namespace": ns}},
                 "configmaps")


# -- RBAC: the rendered roles evaluated against the request log ----------------------------

def rules_for(manifest: list[dict], sa_namespace: str, sa_name: str) -> list[tuple[str, dict]]:
    """(namespace or "" for cluster-wide, rule) for every rule bound to the service account."""
    roles = {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d
             for d in manifest if d["kind"] in ("Role", "ClusterRole")}
    out = []
    for binding in manifest:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if {"kind": "ServiceAccount", "name": sa_name, "namespace": sa_namespace} not in \
                binding["subjects"]:
            continue
        ref = binding["roleRef"]
        scope = binding["metadata"].get("namespace", "")
        role_ns = scope if ref["kind"] == "Role" else ""
        role = roles[(ref["kind"], role_ns, ref["name"])]
        out += [(scope, rule) for rule in role["rules"]]
    return out


def _rule_keys(rule: dict) -> Iterator[tuple[str, str, str, str]]:
    for group in rule["apiGroups"]:
        for resource in rule["resources"]:
            for verb in rule["verbs"]:
                for name in rule.get("resourceNames") or [""]:
                    yield group, resource, verb, name


def matching_rule(rules: list[tuple[str, dict]], req: Request) -> tuple[str, str, str, str] | None:
    resource = f"{req.resource}/{req.subresource}" if req.subresource else req.resource
    for scope, rule in rules:
        if scope and req.namespace != scope:
            continue  # a RoleBinding grants in its namespace only
        for key in _rule_keys(rule):
            group, res, verb, name = key
            if (group, res, verb) == (req.group, resource, req.verb) and \
                    (not name or name == req.name):
                return key
    return None


def check_rbac(rules: list[tuple[str, dict]], requests: list[Request],
               allowed_unused: dict) -> set[tuple[str, str, str, str]]:
    assert rules, "no rules bound to the service account"
    denied = sorted({r for r in requests if matching_rule(rules, r) is None})
    assert not denied, f"requests the rendered RBAC does not allow: {denied}"
    used = {matching_rule(rules, r) for r in requests}
    granted = {key for _, rule in rules for key in _rule_keys(rule)}
    unused = granted - used - set(allowed_unused)
    assert not unused, f"granted but never used (use it, or justify it): {sorted(unused)}"
    return used


def all_objects(server: KubeAPIServer) -> Iterator[tuple[str, dict]]:
    seen = set()
    for rt in server.store.registry.all():
        if rt.key not in seen:
            seen.add(rt.key)
            for obj in server.list(rt.api_version, rt.plural):
                yield rt.plural, obj


def operator_requests(server: KubeAPIServer) -> list[Request]:
    # The log holds only the operator's requests: cleared before it started, and the test
    # itself writes through the store.
    return list(server.requests)


# -- the tests -----------------------------------------------------------------------------

def test_install_run_upgrade_uninstall(tmp_path, example, minimal, monkeypatch):
    with cluster(tmp_path) as (server, client, jobs):
        # Install: crds/ first, then the hook (the CRD is already current), then the rest.
        release = client.install({})
        assert release["status"] == "deployed"
        assert "kubectl get disaggregatedinference" in release["notes"]
        assert server.get("apiextensions.k8s.io/v1", "customresourcedefinitions", None,
                          CRD_NAME)["spec"] == build_crd()["spec"]
        (run,) = jobs.runs
        assert run["rc"] == 0 and run["argv"] == ["bidir-kv", "crd", "--apply"]
        manifest = client.manifest()
        hooks = [yaml.safe_load(h["manifest"]) for h in client.config.get_all(RELEASE)["hooks"]]
        hook_rules = rules_for(hooks, RELEASE_NS, run["job"]["spec"]["template"]["spec"]
                               ["serviceAccountName"])
        check_rbac(hook_rules, run["requests"], {})
        assert run["credentials"] and set(run["credentials"]) == {f"Bearer {TOKEN}"}
        # hook-succeeded: the Job and its RBAC are gone again.
        assert not server.list("batch/v1", "jobs", RELEASE_NS)
        assert not server.get("rbac.authorization.k8s.io/v1", "clusterroles", None,
                              f"{RELEASE}-crd-upgrade")

        # The operator with the chart's arguments, cluster-wide.
        seed(server, example, minimal, "default")
        server.requests.clear()
        with chart_operator(manifest, tmp_path / "kubeconfig", "bidir-kv-6f7d8-x2x9p",
                            monkeypatch) as (options, _):
            assert options["namespaces"] == () and options["peering_name"] is None
            exercise_operator(server, example, "default")
        used = check_rbac(rules_for(manifest, RELEASE_NS, RELEASE), operator_requests(server),
                          ALLOWED_UNUSED)
        assert ("", "events", "create", "") in used

        # An older CRD in the cluster (as after an upgrade of the chart): `helm upgrade`
        # leaves crds/ alone, the pre-upgrade hook brings it to this version.
        stale = copy.deepcopy(server.get("apiextensions.k8s.io/v1",
                                         "customresourcedefinitions", None, CRD_NAME))
        stale["spec"]["versions"][0]["additionalPrinterColumns"].pop()
        stale["metadata"]["labels"]["team"] = "ml"
        server.store.update(_rt(server, "apiextensions.k8s.io/v1", "customresourcedefinitions"),
                            None, CRD_NAME, stale)
        store_create(server, yaml.safe_load(SERVICEMONITOR_CRD.read_text()),
                     "customresourcedefinitions")
        server.requests.clear()
        client.upgrade(HA_VALUES)
        crd = server.get("apiextensions.k8s.io/v1", "customresourcedefinitions", None, CRD_NAME)
        assert crd["spec"] == build_crd()["spec"]
        assert crd["metadata"]["labels"]["team"] == "ml"  # labels others added are kept
        assert len(jobs.runs) == 2 and jobs.runs[1]["rc"] == 0
        crd_writes = [r for r in server.requests if r.resource == "customresourcedefinitions"
                      and r.name == CRD_NAME and r.verb not in ("get", "list", "watch")]
        assert crd_writes == [r for r in jobs.runs[1]["requests"] if r.verb == "update"]
        manifest = client.manifest()
        kinds = sorted((d["kind"], d["metadata"].get("namespace", "")) for d in manifest)
        assert ("Role", "ns1") in kinds and ("Role", "default") in kinds
        assert ("ClusterRole", "") in kinds  # the discovery reads
        assert ("CustomResourceDefinition", "") in kinds  # kopf's KopfPeering CRD
        assert server.get("monitoring.coreos.com/v1", "servicemonitors", RELEASE_NS,
                          f"{RELEASE}-routers")
        assert server.get("rbac.authorization.k8s.io/v1", "clusterroles", None, RELEASE) is None

        # The upgraded operator: two namespaces, peering. It creates its KopfPeering objects.
        seed(server, example, minimal, "ns1")
        server.requests.clear()
        with chart_operator(manifest, tmp_path / "kubeconfig", "bidir-kv-6f7d8-k4b2z",
                            monkeypatch) as (options, _):
            assert options["namespaces"] == ("default", "ns1")
            assert options["peering_name"] == RELEASE and options["priority"] > 0
            for ns in ("default", "ns1"):
                eventually(lambda n=ns: (server.get("kopf.dev/v1", "kopfpeerings", n, RELEASE)
                                         or {}).get("status"), f"kopf's lease in {ns}")
            exercise_operator(server, example, "ns1")
        used = check_rbac(rules_for(manifest, RELEASE_NS, RELEASE), operator_requests(server),
                          ALLOWED_UNUSED)
        assert ("kopf.dev", "kopfpeerings", "patch", RELEASE) in used
        assert ("", "namespaces", "watch", "") in used

        # Uninstall: everything of the release goes; the CRD (from crds/) stays, as Helm
        # never deletes those.
        client.uninstall()
        left = [(plural, o["metadata"].get("namespace"), o["metadata"]["name"])
                for plural, o in all_objects(server)
                if (o["metadata"].get("labels") or {}).get("app.kubernetes.io/instance")
                == RELEASE]
        assert left == []
        assert server.get("apiextensions.k8s.io/v1", "customresourcedefinitions", None,
                          CRD_NAME)
        assert server.store.registry.find("kopf.dev", "v1", "kopfpeerings") is None


def test_two_replicas_one_active(tmp_path, example, minimal, monkeypatch, caplog):
    """replicaCount 2, all namespaces: both replicas run with `--priority auto`; the pod
    names give them distinct priorities, so exactly one reconciles (with equal ones kopf
    would freeze both)."""
    caplog.set_level("INFO", logger="kopf")
    with cluster(tmp_path) as (server, client, _):
        client.install({"replicaCount": 2, "crdUpgrade": {"enabled": False}})
        manifest = client.manifest()
        assert [d["metadata"]["name"] for d in manifest if d["kind"] ==
                "CustomResourceDefinition"] == ["clusterkopfpeerings.kopf.dev"]
        server.requests.clear()
        kubeconfig = tmp_path / "kubeconfig"
        pods = ["bidir-kv-7c9f6-2mz8q", "bidir-kv-7c9f6-h5tkl"]
        with chart_operator(manifest, kubeconfig, pods[0], monkeypatch) as (first, one), \
                chart_operator(manifest, kubeconfig, pods[1], monkeypatch) as (second, two):
            assert first["priority"] != second["priority"]
            lease = eventually(lambda: len((server.get("kopf.dev/v1", "clusterkopfpeerings",
                                                       None, RELEASE) or {})
                                           .get("status", {})) == 2 and
                               server.get("kopf.dev/v1", "clusterkopfpeerings", None, RELEASE),
                               "both replicas in the ClusterKopfPeering")
            assert {p["priority"] for p in lease["status"].values()} == \
                {first["priority"], second["priority"]}
            high, low = (pods[0], pods[1]) if first["priority"] > second["priority"] \
                else (pods[1], pods[0])
            active, standby = (one, two) if high == pods[0] else (two, one)
            eventually(lambda: any("Pausing operations in favour of" in r.getMessage()
                                   and high in r.getMessage() for r in caplog.records),
                       f"{low} to pause in favour of {high}")
            seed(server, example, minimal, "default")
            exercise_operator(server, example, "default")
            assert active.reconciles > 0 and standby.reconciles == 0
        used = check_rbac(rules_for(manifest, RELEASE_NS, RELEASE), operator_requests(server),
                          ALLOWED_UNUSED)
        assert ("kopf.dev", "clusterkopfpeerings", "create", "") in used


def test_operator_requests_carry_credentials(tmp_path, example, minimal, monkeypatch):
    with cluster(tmp_path) as (server, client, _):
        client.install({"crdUpgrade": {"enabled": False}})
        manifest = client.manifest()  # (Helm's status reads the cluster: before the clear)
        seed(server, example, minimal, "default")
        server.auth_log.clear()
        with chart_operator(manifest, tmp_path / "kubeconfig", "bidir-kv-6f7d8-x2x9p",
                            monkeypatch):
            eventually(lambda: server.get("apps/v1", "statefulsets", "default",
                                          "qwen3-32b-decode"), "a child")
        # kopf's own client (watches) logs in with the kubeconfig's token ...
        watches = [auth for _, path, auth in server.auth_log if "watch=" in path]
        assert watches and set(watches) == {f"Bearer {TOKEN}"}
        # ... the controller's reads and writes must too.
        assert server.unauthenticated() == []
