"""spec.monitoring through the real operator and an API server over HTTP: the engines'
PodMonitor follows the spec (created, deleted when turned off, reported when the cluster
lacks prometheus-operator's CRDs) and tracing reaches the router and both engines."""

from __future__ import annotations

import json
import pathlib

import yaml

from kubeapi.operatorenv import (
    CRD_PATH,
    api_server,
    di_path,
    eventually,
    resource,
    running_operator,
)

PODMONITOR_CRD = (pathlib.Path(__file__).parent / "cluster" / "crds"
                  / "monitoring.coreos.com_podmonitors.yaml")
MERGE = "application/merge-patch+json"


async def _condition(client, reason):
    di = await client.get("DisaggregatedInference", "ns1", "tiny")
    for c in (di or {}).get("status", {}).get("conditions", []):
        if c["type"] == "Reconciled" and c["reason"] == reason:
            return c
    return None


async def _monitor(client, present=True):
    obj = await client.get("PodMonitor", "ns1", "tiny-engines")
    if present:
        return obj
    return obj is None


async def test_pod_monitor_follows_the_spec(minimal):
    minimal["spec"]["monitoring"] = {"podMonitor": {"enabled": True, "interval": "15s",
                                                    "labels": {"release": "prometheus"}}}
    async with api_server() as (server, client), running_operator(client) as op:
        # No prometheus-operator CRDs yet: the rest is applied, the condition says why
        # the PodMonitor is not.
        await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
        c = await eventually(lambda: _condition(client, "KindMissing"), what="KindMissing")
        assert "spec.monitoring.podMonitor.enabled is true" in c["message"]
        assert "monitoring.coreos.com/v1 PodMonitor" in c["message"]
        di = await client.get("DisaggregatedInference", "ns1", "tiny")
        assert di["status"]["phase"] == "Degraded"
        assert await client.get("StatefulSet", "ns1", "tiny-decode") is not None

        await client.call("POST", CRD_PATH, yaml.safe_load(PODMONITOR_CRD.read_text()))
        await eventually(lambda: server.get("apiextensions.k8s.io/v1",
                                            "customresourcedefinitions", None,
                                            "podmonitors.monitoring.coreos.com"))
        # The failed pass is retried (with backoff) until the kind is served; then a change
        # of the spec applies as for any child, and so does a hand deletion.
        await client.call("PATCH", di_path("ns1", "tiny"),
                          {"spec": {"monitoring": {"podMonitor": {"interval": "20s"}}}}, MERGE)
        pm = await eventually(lambda: _monitor_interval(client, "20s"), what="PodMonitor")
        assert pm["metadata"]["labels"]["release"] == "prometheus"
        assert pm["metadata"]["ownerReferences"][0]["name"] == "tiny"
        (endpoint,) = pm["spec"]["podMetricsEndpoints"]
        assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == (
            "http", "/metrics", "20s")
        assert pm["spec"]["namespaceSelector"] == {"matchNames": ["ns1"]}
        assert pm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "tiny"
        await eventually(lambda: _reconciled(client), what="reconciled")
        server.store.delete(_rt(server), "ns1", "tiny-engines", {})
        await client.call("PATCH", di_path("ns1", "tiny"),
                          {"metadata": {"labels": {"touched": "yes"}}}, MERGE)
        await eventually(lambda: _monitor(client), what="PodMonitor put back")

        # Turned off: the operator deletes the one it created, and nothing else.
        await client.call("PATCH", di_path("ns1", "tiny"),
                          {"spec": {"monitoring": {"podMonitor": {"enabled": False}}}}, MERGE)
        await eventually(lambda: _monitor(client, present=False), what="PodMonitor deleted")
        await op.idle()
        assert await client.get("Deployment", "ns1", "tiny-router") is not None
        deletes = [(m, p) for m, p, _ in op.client.sent if m == "DELETE"]
        assert deletes == [("DELETE", "/apis/monitoring.coreos.com/v1/namespaces/ns1/"
                                      "podmonitors/tiny-engines")]


async def test_a_foreign_pod_monitor_is_never_deleted(minimal):
    async with api_server() as (server, client):
        await client.call("POST", CRD_PATH, yaml.safe_load(PODMONITOR_CRD.read_text()))
        foreign = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
                   "metadata": {"name": "tiny-engines", "namespace": "ns1"},
                   "spec": {"selector": {}, "podMetricsEndpoints": [{"port": "web"}]}}
        await eventually(lambda: _create(client, foreign), what="foreign PodMonitor")
        async with running_operator(client) as op:
            await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
            await eventually(lambda: _reconciled(client), what="reconciled")
            await op.idle()
        assert (await client.get("PodMonitor", "ns1", "tiny-engines"))["spec"][
            "podMetricsEndpoints"] == [{"port": "web"}]


async def test_tracing_endpoint_reaches_router_and_engines(minimal):
    url = "http://otel-collector.monitoring:4318/v1/traces"
    minimal["spec"]["monitoring"] = {"tracing": {"otlpEndpoint": url, "sampleRatio": 0.25}}
    async with api_server() as (server, client), running_operator(client):
        await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
        cm = await eventually(lambda: client.get("ConfigMap", "ns1", "tiny-router"))
        config = json.loads(next(iter(cm["data"].values())))
        assert config["tracing"] == {"otlpEndpoint": url, "sampleRatio": 0.25}
        for role in ("prefill", "decode"):
            sts = await eventually(lambda r=role: client.get("StatefulSet", "ns1", f"tiny-{r}"))
            (vllm,) = sts["spec"]["template"]["spec"]["containers"]
            args = vllm["args"]
            assert args[args.index("--otlp-traces-endpoint") + 1] == url
            env = {e["name"]: e.get("value") for e in vllm["env"]}
            assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
            assert env["OTEL_SERVICE_NAME"] == f"bidir-kv-{role}"


def _rt(server):
    return next(rt for rt in server.store.registry.all() if rt.plural == "podmonitors")


async def _monitor_interval(client, interval):
    pm = await client.get("PodMonitor", "ns1", "tiny-engines")
    if pm and pm["spec"]["podMetricsEndpoints"][0]["interval"] == interval:
        return pm
    return None


async def _create(client, obj):
    try:
        return await client.create(obj)
    except Exception:  # noqa: BLE001 - the CRD's kind is served a moment after it is created
        return None


async def _reconciled(client):
    di = await client.get("DisaggregatedInference", "ns1", "tiny")
    for c in (di or {}).get("status", {}).get("conditions", []):
        if c["type"] == "Reconciled" and c["status"] == "True":
            return di
    return None
