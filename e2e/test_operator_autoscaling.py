"""spec.<role>.autoscaling through the real operator and an API server over HTTP: the
autoscaler is created, owned and pruned; the operator leaves the StatefulSet's replicas
to it and the router's config follows them; KEDA's kind is reported until installed."""

from __future__ import annotations

import json
import pathlib

import yaml

from bidirkv.operator.kube import KINDS, ApiError
from kubeapi.operatorenv import (
    CRD_PATH,
    api_server,
    di_path,
    eventually,
    resource,
    running_operator,
)
from kubeapi.schemas import KUBE_VERSIONS, schema_errors

KEDA_CRD = (pathlib.Path(__file__).parent.parent / "tests" / "schemas"
            / "keda.sh_scaledobjects.yaml")
MERGE = "application/merge-patch+json"
PROM = "http://prometheus-operated.monitoring:9090"


async def _decode_endpoints(client, n):
    cm = await client.get("ConfigMap", "ns1", "tiny-router")
    if cm is None:
        return None
    decode = json.loads(next(iter(cm["data"].values())))["decode"]
    return decode if len(decode) == n else None


async def _reconciled(client, reason="Applied"):
    di = await client.get("DisaggregatedInference", "ns1", "tiny")
    for c in (di or {}).get("status", {}).get("conditions", []):
        if c["type"] == "Reconciled" and c["reason"] == reason:
            return c
    return None


async def _gone(client, kind, name):
    return await client.get(kind, "ns1", name) is None


async def set_pods(client, n):
    """What the StatefulSet controller reports while `n` pods exist (none run here)."""
    await client.call("PATCH", KINDS["StatefulSet"].path("ns1", "tiny-decode", "status"),
                      {"status": {"replicas": n}}, MERGE)


async def _sts_image(client, image):
    sts = await client.get("StatefulSet", "ns1", "tiny-decode")
    return sts if sts["spec"]["template"]["spec"]["containers"][0]["image"] == image else None


async def test_autoscaled_decode_is_left_to_its_autoscaler(minimal):
    minimal["spec"]["decode"] = {"autoscaling": {"minReplicas": 2, "maxReplicas": 6}}
    async with api_server() as (server, client), running_operator(client) as op:
        await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
        hpa = await eventually(
            lambda: client.get("HorizontalPodAutoscaler", "ns1", "tiny-decode"), what="HPA")
        di = await client.get("DisaggregatedInference", "ns1", "tiny")
        assert hpa["metadata"]["ownerReferences"][0]["uid"] == di["metadata"]["uid"]
        assert hpa["spec"]["scaleTargetRef"]["name"] == "tiny-decode"
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
        assert await client.get("HorizontalPodAutoscaler", "ns1", "tiny-prefill") is None
        # Written without replicas: the API server's default until the HPA acts, and the
        # router already lists the HPA's minimum.
        await eventually(lambda: _decode_endpoints(client, 2), what="2 decode endpoints")

        # The HPA scales through the scale subresource, as its controller does: the
        # router's config follows, the status counts against it.
        await client.call("PATCH", KINDS["StatefulSet"].path("ns1", "tiny-decode", "scale"),
                          {"spec": {"replicas": 4}}, MERGE)
        await eventually(lambda: _decode_endpoints(client, 4), what="4 decode endpoints")
        await op.idle()
        di = await client.get("DisaggregatedInference", "ns1", "tiny")
        assert di["status"]["decode"]["summary"] == "0/4"

        # Scaled down while the leaving pods are still there (draining): the router keeps
        # them, and the conversations they hold, until they are gone.
        await set_pods(client, 4)
        await client.call("PATCH", KINDS["StatefulSet"].path("ns1", "tiny-decode", "scale"),
                          {"spec": {"replicas": 2}}, MERGE)
        await op.idle()
        assert await _decode_endpoints(client, 4)
        await set_pods(client, 3)
        await eventually(lambda: _decode_endpoints(client, 3), what="3 decode endpoints")
        await set_pods(client, 2)
        await eventually(lambda: _decode_endpoints(client, 2), what="2 decode endpoints")
        await client.call("PATCH", KINDS["StatefulSet"].path("ns1", "tiny-decode", "scale"),
                          {"spec": {"replicas": 4}}, MERGE)
        await eventually(lambda: _decode_endpoints(client, 4), what="4 decode endpoints")

        # A change of the pod template is applied; the autoscaler's count stays.
        await client.call("PATCH", di_path("ns1", "tiny"),
                          {"spec": {"engine": {"image": "bidir-kv-vllm:0.1.1"}}}, MERGE)
        sts = await eventually(lambda: _sts_image(client, "bidir-kv-vllm:0.1.1"),
                               what="new template")
        assert sts["spec"]["replicas"] == 4
        await op.idle()
        assert (await client.get("StatefulSet", "ns1", "tiny-decode"))["spec"]["replicas"] == 4

        # KEDA is not installed: the rest applies, the condition says why, and the HPA
        # of engine hpa is gone.
        await client.call("PATCH", di_path("ns1", "tiny"), {"spec": {"decode": {"autoscaling": {
            "engine": "keda", "keda": {"serverAddress": PROM}}}}}, MERGE)
        c = await eventually(lambda: _reconciled(client, "KindMissing"), what="KindMissing")
        assert "spec.decode.autoscaling.engine is 'keda'" in c["message"]
        assert "keda.sh/v1alpha1 ScaledObject" in c["message"]
        await eventually(lambda: _gone(client, "HorizontalPodAutoscaler", "tiny-decode"),
                         what="HPA deleted")

        await client.call("POST", CRD_PATH, yaml.safe_load(KEDA_CRD.read_text()))
        await eventually(lambda: server.get("apiextensions.k8s.io/v1",
                                            "customresourcedefinitions", None,
                                            "scaledobjects.keda.sh"))
        so = await eventually(lambda: client.get("ScaledObject", "ns1", "tiny-decode"),
                              timeout=30, what="ScaledObject")
        assert so["spec"]["triggers"][0]["metadata"]["serverAddress"] == PROM
        assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (2, 6)
        await eventually(lambda: _reconciled(client), what="reconciled")

        # Fixed again: the ScaledObject goes, the spec's count is written.
        await client.call("PATCH", di_path("ns1", "tiny"),
                          {"spec": {"decode": {"autoscaling": None, "replicas": 3}}}, MERGE)
        await eventually(lambda: _gone(client, "ScaledObject", "tiny-decode"),
                         what="ScaledObject deleted")
        await eventually(lambda: _decode_endpoints(client, 3), what="3 decode endpoints")
        await op.idle()
        assert (await client.get("StatefulSet", "ns1", "tiny-decode"))["spec"]["replicas"] == 3

        for method, _, body in op.client.sent:
            if method in ("POST", "PUT") and body.get("kind") == "HorizontalPodAutoscaler":
                for version in KUBE_VERSIONS:
                    assert schema_errors(body, version) == []
        deletes = sorted(p for m, p, _ in op.client.sent if m == "DELETE")
        assert deletes == [
            "/apis/autoscaling/v2/namespaces/ns1/horizontalpodautoscalers/tiny-decode",
            "/apis/keda.sh/v1alpha1/namespaces/ns1/scaledobjects/tiny-decode"]


async def test_the_api_server_refuses_a_fixed_count_with_autoscaling(minimal):
    async with api_server() as (server, client):
        await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
        for patch, field in (
            ({"decode": {"autoscaling": {"maxReplicas": 4}, "replicas": 2}},
             "spec.decode.replicas"),
            ({"prefill": {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}},
             "spec.prefill.autoscaling.minReplicas"),
        ):
            try:
                await client.call("PATCH", di_path("ns1", "tiny"), {"spec": patch}, MERGE)
            except ApiError as exc:
                assert exc.status == 422 and field in str(exc), str(exc)
            else:
                raise AssertionError(f"accepted {patch}")
        # `kubectl scale` writes decode.replicas: refused while decode is autoscaled.
        await client.call("PATCH", di_path("ns1", "tiny"),
                          {"spec": {"decode": {"autoscaling": {"maxReplicas": 4}}}}, MERGE)
        try:
            await client.call("PATCH", di_path("ns1", "tiny", "scale"),
                              {"spec": {"replicas": 3}}, MERGE)
        except ApiError as exc:
            assert exc.status == 422 and "spec.decode.replicas" in str(exc), str(exc)
        else:
            raise AssertionError("scaled an autoscaled decode")
