"""charts/bidir-kv on a real cluster (kind or EKS): what no emulator here shows.

`helm install` (with the CRD-upgrade hook Job really running), the operator pods under
their real RBAC, security context (in a namespace that enforces the "restricted" Pod
Security Standard) and liveness probe, kopf peering between two replicas, a
small DisaggregatedInference whose pods really start, a two-turn conversation through the
router (reached through the API server's service proxy: no port-forward, no ingress) and
decode-KV reuse seen in the router's /metrics; then `helm upgrade` and `helm uninstall`.

Runs when KUBECONFIG points at a cluster (see conftest.py); skipped otherwise. Knobs:
  BIDIRKV_E2E_IMAGE          operator/router image   (bidir-kv:0.1.0; kind: `kind load`)
  BIDIRKV_E2E_ENGINE_IMAGE   engine image            (bidir-kv-vllm:0.1.0)
  BIDIRKV_E2E_MODEL          model of the engines    (Qwen/Qwen3-0.6B)
  BIDIRKV_E2E_DEVICE         cpu | gpu               (cpu: vLLM's CPU build, kvBufferDevice cpu)
  BIDIRKV_E2E_NAMESPACE      for the inference; the operator goes to NAMESPACE-system;
                             both created and deleted (bidirkv-e2e)
  BIDIRKV_E2E_VALUES         a YAML file of extra chart values (e.g. image pull secrets)
  BIDIRKV_E2E_READY_TIMEOUT  seconds for the engines to load and become Ready (1800)
  BIDIRKV_E2E_KEEP=1         leave the release and namespace for inspection
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from bidirkv.operator.api import spec as api
from bidirkv.operator.crd.schema import build_crd
from bidirkv.operator.kube import ApiError
from bidirkv.operator.kube import request as api_request
from bidirkv.operator.render.children import render_resource
from kubeapi.crdschema import validate_custom_resource

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "bidir-kv"
RELEASE = "bidir-kv-e2e"
NAMESPACE = os.environ.get("BIDIRKV_E2E_NAMESPACE", "bidirkv-e2e")
SYSTEM_NS = f"{NAMESPACE}-system"  # the release's; enforces the restricted Pod Security
IMAGE = os.environ.get("BIDIRKV_E2E_IMAGE", "bidir-kv:0.1.0")
ENGINE_IMAGE = os.environ.get("BIDIRKV_E2E_ENGINE_IMAGE", "bidir-kv-vllm:0.1.0")
MODEL = os.environ.get("BIDIRKV_E2E_MODEL", "Qwen/Qwen3-0.6B")
DEVICE = os.environ.get("BIDIRKV_E2E_DEVICE", "cpu")
READY_TIMEOUT = float(os.environ.get("BIDIRKV_E2E_READY_TIMEOUT", "1800"))
KEEP = os.environ.get("BIDIRKV_E2E_KEEP") == "1"
DI_NAME = "e2e-tiny"
DI_PATH = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NAMESPACE}/{api.PLURAL}"
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"

pytestmark = pytest.mark.cluster


def inference() -> dict[str, Any]:
    """One prefill pod, one decode pod and a router: the smallest 1PnD there is."""
    if DEVICE == "gpu":
        resources = {"requests": {"cpu": "4", "memory": "16Gi"},
                     "limits": {"nvidia.com/gpu": 1}}
        engine: dict[str, Any] = {"image": ENGINE_IMAGE}
        kv_buffer_device = "cuda"
    else:
        resources = {"requests": {"cpu": "2", "memory": "6Gi"}, "limits": {"memory": "8Gi"}}
        # As examples/local.yaml: vLLM's CPU build, UCX over TCP.
        engine = {"image": ENGINE_IMAGE, "extraArgs": ["--enforce-eager"],
                  "extraEnv": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "2"},
                               {"name": "UCX_TLS", "value": "tcp,self,sm"}]}
        kv_buffer_device = "cpu"
    return {
        "apiVersion": f"{api.GROUP}/{api.VERSION}",
        "kind": api.KIND,
        "metadata": {"name": DI_NAME, "namespace": NAMESPACE},
        "spec": {
            "model": {"name": MODEL, "maxModelLen": 4096},
            "engine": engine,
            # Off on P: every turn's history is gone from P, so the second turn's prefix
            # can only come back from D (what the router's reuse metric counts).
            "prefill": {"replicas": 1, "resources": resources, "enablePrefixCaching": False},
            "decode": {"replicas": 1, "resources": resources},
            "kvTransfer": {"bidirectional": True, "decoderKvBlocksTtlSeconds": 600,
                           "kvRecomputeThreshold": 16, "backend": "UCX",
                           "kvBufferDevice": kv_buffer_device},
            "router": {"replicas": 1, "image": IMAGE, "conversationTtlSeconds": 300},
        },
    }


def test_the_e2e_spec_is_valid():
    """Runs without a cluster too: the spec this suite applies still passes the CRD (schema
    and CEL) and the operator's own checks."""
    obj, errors = validate_custom_resource(build_crd(), inference())
    assert [str(e) for e in errors] == []
    kinds = sorted(o["kind"] for o in render_resource(obj))
    assert kinds.count("StatefulSet") == 2 and "Deployment" in kinds


# -- cluster access -----------------------------------------------------------------------

def raw(client, method: str, path: str, body: Any = None, timeout: float = 300) -> bytes:
    """A request whose answer is not JSON (router /metrics), authenticated."""
    headers = {"Accept": "*/*"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    params = client.param_serialize(method=method, resource_path=path, header_params=headers,
                                    body=body, auth_settings=["BearerToken"])
    resp = client.call_api(*params, _request_timeout=(10, timeout))
    data = resp.read()
    if resp.status >= 400:
        raise ApiError(resp.status, "", data.decode(errors="replace")[:2000])
    return data


def get(client, path: str) -> dict | None:
    try:
        return api_request(client, "GET", path)
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


def wait_for(check, what: str, timeout: float, interval: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


@pytest.fixture(scope="module")
def client(kubeconfig: str) -> Iterator[Any]:
    import kubernetes

    with kubernetes.config.new_client_from_config(config_file=kubeconfig) as api_client:
        yield api_client


def chart_values(client) -> dict[str, Any]:
    repository, _, tag = IMAGE.rpartition(":")
    values: dict[str, Any] = {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"},
        "replicaCount": 2,
        "watchNamespaces": [NAMESPACE],
        # Scrape the routers when the cluster has prometheus-operator's CRDs.
        "serviceMonitor": {"enabled": get(
            client, f"{CRD_PATH}/servicemonitors.monitoring.coreos.com") is not None},
    }
    peering_crd = get(client, f"{CRD_PATH}/kopfpeerings.kopf.dev")
    if peering_crd and (peering_crd["metadata"].get("annotations") or {}).get(
            "meta.helm.sh/release-name") != RELEASE:
        values["peering"] = {"createCRDs": False}  # another kopf operator brought it
    extra = os.environ.get("BIDIRKV_E2E_VALUES")
    if extra:
        values = _merge(values, yaml.safe_load(pathlib.Path(extra).read_text()) or {})
    return values


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(
            out.get(key), dict) else value
    return out


@pytest.fixture(scope="module")
def release(kubeconfig: str, client) -> Iterator[tuple[Any, dict]]:
    import helm_python as helm

    values = chart_values(client)
    for ns, labels in ((SYSTEM_NS, {"pod-security.kubernetes.io/enforce": "restricted"}),
                       (NAMESPACE, {})):
        try:
            api_request(client, "POST", "/api/v1/namespaces", {
                "apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": ns, "labels": labels}})
        except ApiError as exc:
            if exc.status != 409:
                raise
    config = helm.Config(kubeconfig_path=kubeconfig, namespace=SYSTEM_NS)
    try:
        # wait: the hook Job has run (pre-install) and the operator Deployment is Available.
        config.install(str(CHART), RELEASE, values, namespace=SYSTEM_NS, wait="watcher",
                       timeout=600)
        yield config, values
    finally:
        if not KEEP:
            try:
                api_request(client, "DELETE", f"{DI_PATH}/{DI_NAME}")
            except ApiError:
                pass
            config.uninstall(RELEASE, wait="watcher", timeout=300, ignore_not_found=True)
            for ns in (NAMESPACE, SYSTEM_NS):
                try:
                    api_request(client, "DELETE", f"/api/v1/namespaces/{ns}")
                except ApiError:
                    pass
        config.close()


# -- the suite ------------------------------------------------------------------------------

def test_operator_runs_with_peering(client, release):
    _, values = release
    deploy = get(client, f"/apis/apps/v1/namespaces/{SYSTEM_NS}/deployments/{RELEASE}")
    replicas = values["replicaCount"]
    assert deploy["status"].get("availableReplicas") == replicas
    # Each replica renewed its lease in the KopfPeering, with distinct priorities.
    peering = wait_for(
        lambda: (p := get(client, f"/apis/kopf.dev/v1/namespaces/{NAMESPACE}/kopfpeerings/"
                                  f"{RELEASE}")) and len(p.get("status") or {}) >= replicas and p,
        "every replica in the KopfPeering", timeout=120)
    priorities = [peer["priority"] for peer in peering["status"].values()]
    assert len(set(priorities)) == len(priorities), priorities
    # Admitted under the restricted Pod Security Standard, running, never restarted (the
    # liveness probe passes).
    pods = api_request(client, "GET", f"/api/v1/namespaces/{SYSTEM_NS}/pods?labelSelector="
                       "app.kubernetes.io/component%3Doperator")["items"]
    assert len(pods) == replicas
    for pod in pods:
        assert pod["status"]["phase"] == "Running"
        assert all(c["ready"] and c["restartCount"] == 0 for c in pod["status"]
                   ["containerStatuses"]), pod["metadata"]["name"]


def test_the_hook_made_the_crd_current(client, release):
    crd = get(client, f"{CRD_PATH}/{build_crd()['metadata']['name']}")
    want = build_crd()["spec"]["versions"][0]
    have = crd["spec"]["versions"][0]
    assert have["additionalPrinterColumns"] == want["additionalPrinterColumns"]
    assert sorted(have["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]) == \
        sorted(want["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"])
    # hook-succeeded: the Job and its RBAC are gone.
    assert get(client, f"/apis/batch/v1/namespaces/{SYSTEM_NS}/jobs/{RELEASE}-crd-upgrade") \
        is None
    assert get(client, "/apis/rbac.authorization.k8s.io/v1/clusterroles/"
                       f"{RELEASE}-crd-upgrade") is None


def _metrics(client) -> dict[str, float]:
    # The router serves /metrics on its pod's metrics port only (the Service has none).
    pods = api_request(client, "GET", f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector="
                       f"app.kubernetes.io/instance%3D{DI_NAME},"
                       "app.kubernetes.io/component%3Drouter")["items"]
    text = raw(client, "GET", f"/api/v1/namespaces/{NAMESPACE}/pods/"
                              f"{pods[0]['metadata']['name']}:9090/proxy/metrics").decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(bidirkv_router_[a-z_]+(?:\{[^}]*\})?) ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _chat(client, model: str, messages: list[dict]) -> str:
    body = {"model": model, "messages": messages, "max_tokens": 24, "temperature": 0}
    data = raw(client, "POST", f"/api/v1/namespaces/{NAMESPACE}/services/{DI_NAME}-router:http"
                               "/proxy/v1/chat/completions", body, timeout=600)
    return json.loads(data)["choices"][0]["message"]["content"]


def test_two_turns_through_the_router_reuse_decode_kv(client, release):
    api_request(client, "POST", DI_PATH, inference())
    di = wait_for(lambda: (d := get(client, f"{DI_PATH}/{DI_NAME}")) and
                  d.get("status", {}).get("phase") == "Ready" and d,
                  "the DisaggregatedInference to become Ready", READY_TIMEOUT, interval=10)
    assert di["status"]["prefill"]["summary"] == "1/1"
    assert di["status"]["decode"]["summary"] == "1/1"
    assert di["status"]["routerUrl"] == f"http://{DI_NAME}-router.{NAMESPACE}.svc:8000"

    models = json.loads(raw(client, "GET", f"/api/v1/namespaces/{NAMESPACE}/services/"
                                           f"{DI_NAME}-router:http/proxy/v1/models"))
    model = models["data"][0]["id"]
    history = [
        {"role": "system", "content": "You are a terse assistant for a shipping company. " * 20},
        {"role": "user", "content": "List three things to check before sealing a container."},
    ]
    before = _metrics(client)
    history.append({"role": "assistant", "content": _chat(client, model, history)})
    history.append({"role": "user", "content": "And which of them matters most? One word."})
    assert _chat(client, model, history)
    after = _metrics(client)
    hit = 'bidirkv_router_reuse_total{outcome="hit"}'
    assert after.get(hit, 0) - before.get(hit, 0) >= 1, {
        k: v for k, v in after.items() if "reuse" in k}


def test_upgrade_keeps_serving(client, release):
    config, values = release
    di_before = get(client, f"{DI_PATH}/{DI_NAME}")
    config.upgrade(str(CHART), RELEASE, _merge(values, {"verbose": True}), namespace=SYSTEM_NS,
                   wait="watcher", timeout=600)
    deploy = get(client, f"/apis/apps/v1/namespaces/{SYSTEM_NS}/deployments/{RELEASE}")
    assert "--verbose" in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    # The new operator pods take over the resource without touching its pods.
    di = wait_for(lambda: (d := get(client, f"{DI_PATH}/{DI_NAME}")) and
                  d["status"].get("phase") == "Ready" and d, "Ready after the upgrade", 300)
    assert di["metadata"]["generation"] == di_before["metadata"]["generation"]
    sts = get(client, f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/{DI_NAME}-decode")
    assert sts["status"].get("readyReplicas") == 1
