"""Leaving engine pods through the real operator and an API server over HTTP: a fixed-count
scale-down keeps the leaving pod in the router's config until it is gone, so its drain can
move the conversations it holds; the status says which pods drain, until when, and how
many conversations each still holds, read from its engine's /metrics (the stand-in
engine of tests/fake_engine.py, on 127.0.0.1)."""

from __future__ import annotations

import contextlib
import json

from fake_engine import FakeEngine

from bidirkv.operator.kube import KINDS
from kubeapi.operatorenv import api_server, di_path, eventually, resource, running_operator

MERGE = "application/merge-patch+json"


async def _decode_endpoints(client, n):
    cm = await client.get("ConfigMap", "ns1", "tiny-router")
    if cm is None:
        return None
    decode = json.loads(next(iter(cm["data"].values())))["decode"]
    return decode if len(decode) == n else None


async def set_pods(client, n):
    """What the StatefulSet controller reports while `n` pods exist (none run here)."""
    await client.call("PATCH", KINDS["StatefulSet"].path("ns1", "tiny-decode", "status"),
                      {"status": {"replicas": n}}, MERGE)


async def test_a_fixed_scale_down_keeps_the_leaving_pod_listed_until_it_is_gone(minimal):
    minimal["spec"]["decode"] = {"replicas": 2}
    async with api_server() as (server, client), running_operator(client) as op:
        await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
        await eventually(lambda: _decode_endpoints(client, 2), what="2 decode endpoints")
        await set_pods(client, 2)
        await op.idle()

        # `kubectl scale di/tiny --replicas=1`: the StatefulSet shrinks at once, the
        # router keeps decode-1 while its pod drains.
        await client.call("PATCH", di_path("ns1", "tiny", "scale"),
                          {"spec": {"replicas": 1}}, MERGE)
        await eventually(lambda: _sts_replicas(client, 1), what="StatefulSet at 1")
        await op.idle()
        assert await _decode_endpoints(client, 2)
        # The pod is gone: the router lets it go.
        await set_pods(client, 1)
        await eventually(lambda: _decode_endpoints(client, 1), what="1 decode endpoint")
        # A scale-up lists the new pod at once.
        await client.call("PATCH", di_path("ns1", "tiny", "scale"),
                          {"spec": {"replicas": 3}}, MERGE)
        await eventually(lambda: _decode_endpoints(client, 3), what="3 decode endpoints")


async def _sts_replicas(client, n):
    sts = await client.get("StatefulSet", "ns1", "tiny-decode")
    return sts if sts and sts["spec"].get("replicas") == n else None


def _decode_pod(name: str, instance: str = "tiny", drain_s: int = 3) -> dict:
    """A decode pod bound to a node (no kubelet runs here): grace period 150 s, drain cap
    `drain_s`."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ns1",
                         "labels": {"app.kubernetes.io/name": "bidir-kv",
                                    "app.kubernetes.io/instance": instance,
                                    "app.kubernetes.io/component": "decode",
                                    "app.kubernetes.io/managed-by": "bidir-kv-operator"}},
            "spec": {"nodeName": "node-a", "terminationGracePeriodSeconds": 150,
                     "containers": [{"name": "engine", "image": "bidir-kv-vllm:0.1.0",
                                     "env": [{"name": "BIDIRKV_DRAIN_SECONDS",
                                              "value": str(drain_s)}]}]},
            "status": {"podIP": "127.0.0.1"}}


async def _delete_pod(client, name: str, grace: int | None = None) -> None:
    """`kubectl delete pod` (grace None: the pod's own), or its kubelet's final delete
    (grace 0)."""
    body = {"apiVersion": "v1", "kind": "DeleteOptions"}
    if grace is not None:
        body["gracePeriodSeconds"] = grace
    await client.call("DELETE", f"/api/v1/namespaces/ns1/pods/{name}", body)


async def _status(client, check):
    di = await client.get("DisaggregatedInference", "ns1", "tiny")
    st = (di or {}).get("status") or {}
    return st if check(st) else None


def _condition(st, type_):
    return next((c for c in st.get("conditions", []) if c["type"] == type_), None)


async def _drain_events(client):
    out = await client.call("GET", "/api/v1/namespaces/ns1/events")
    return [e for e in out.get("items", []) if e.get("reason") == "DrainTimedOut"]


@contextlib.asynccontextmanager
async def _decode_engine():
    """A stand-in decode engine on 127.0.0.1: what a pod's engine port serves."""
    engine = FakeEngine("decode")
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def test_the_status_shows_draining_pods_and_one_event_when_a_drain_runs_out(minimal):
    minimal["spec"]["decode"] = {"replicas": 2}
    async with (api_server() as (server, client), running_operator(client) as op,
                _decode_engine() as engine):
        await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
        st = await eventually(lambda: _status(client, lambda s: "decode" in s), what="status")
        assert st["decode"]["draining"] == 0
        assert _condition(st, "Draining")["status"] == "False"
        selector = st["decode"]["selector"]

        # The pod's engine: it holds 3 conversations when its drain starts.
        engine.behaviour.retained_requests = 3
        pod = _decode_pod("tiny-decode-1")
        # The labels the StatefulSet's template gives its pods: the selector's and the
        # operator's managed-by, which its watch of pods filters on.
        pod["metadata"]["labels"] = {**dict(p.split("=") for p in selector.split(",")),
                                     "app.kubernetes.io/managed-by": "bidir-kv-operator"}
        # The engine port as the operator renders it, and the pod's IP as its kubelet
        # reports it (status is the kubelet's: dropped on create).
        pod["spec"]["containers"][0]["ports"] = [
            {"name": "http", "containerPort": engine.port, "protocol": "TCP"}]
        # A pod with the same labels and engine that its StatefulSet did not make (anyone
        # allowed to create pods in the namespace can): neither listed nor read.
        stray = json.loads(json.dumps(pod))
        stray["metadata"]["name"] = "tiny-decode-7"
        # The reference the StatefulSet controller writes on the pods it makes.
        sts = await client.get("StatefulSet", "ns1", "tiny-decode")
        pod["metadata"]["ownerReferences"] = [{
            "apiVersion": "apps/v1", "kind": "StatefulSet", "name": "tiny-decode",
            "uid": sts["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
        for one in (pod, stray):
            await client.call("POST", "/api/v1/namespaces/ns1/pods", one)
            await client.call(
                "PATCH", f"/api/v1/namespaces/ns1/pods/{one['metadata']['name']}/status",
                {"status": {"podIP": "127.0.0.1"}}, MERGE)
        # A pod of another resource is not this one's.
        await client.call("POST", "/api/v1/namespaces/ns1/pods",
                          _decode_pod("other-decode-0", instance="other"))
        for name in ("tiny-decode-7", "tiny-decode-1", "other-decode-0"):
            await _delete_pod(client, name)  # marked; its drain ends 3 s from now
        live = await client.call("GET", "/api/v1/namespaces/ns1/pods/tiny-decode-1")
        assert live["metadata"]["deletionGracePeriodSeconds"] == 150
        # Nothing of the StatefulSet changes when a pod starts draining (a node drain, an
        # eviction): the pod's own watch event brings the pass.
        st = await eventually(lambda: _status(client, lambda s: s["decode"]["draining"] == 1),
                              what="1 draining")
        (listed,) = st["decode"]["drainingPods"]
        assert listed["name"] == "tiny-decode-1" and listed["timedOut"] is False
        # What it still holds, from its engine; the role's total and printer column.
        assert listed["conversations"] == 3
        assert st["decode"]["drainingConversations"] == 3
        assert st["decode"]["drainingSummary"] == "1 (3 held)"
        cond = _condition(st, "Draining")
        assert cond["status"] == "True"
        assert "tiny-decode-1 holds 3 conversations" in cond["message"]
        assert st["prefill"]["draining"] == 0
        assert "drainingConversations" not in st["prefill"]
        assert not await _drain_events(client)

        # Past its deadline and still there: its drain ran out. One Event, by itself
        # (nothing else changed), marked in the status.
        st = await eventually(
            lambda: _status(client, lambda s: s["decode"]["drainingPods"]
                            and s["decode"]["drainingPods"][0]["timedOut"]),
            what="timed out")
        (event,) = await eventually(lambda: _drain_events(client), what="DrainTimedOut")
        assert event["type"] == "Warning"
        assert event["involvedObject"]["name"] == "tiny"
        assert "tiny-decode-1" in event["message"] and "recompute" in event["message"]
        # Past its deadline the engine stopped: the last reading is what was lost.
        assert "still held 3 conversations" in event["message"]
        assert st["decode"]["drainingPods"][0]["conversations"] == 3
        await set_pods(client, 2)  # another pass
        await op.idle()
        assert len(await _drain_events(client)) == 1

        # The pod is gone: nothing drains.
        await _delete_pod(client, "tiny-decode-1", grace=0)
        st = await eventually(lambda: _status(client, lambda s: s["decode"]["draining"] == 0),
                              what="none draining")
        assert st["decode"]["drainingPods"] == []
        assert st["decode"]["drainingSummary"] == "0"
        assert "drainingConversations" not in st["decode"]
        assert _condition(st, "Draining")["status"] == "False"
        assert len(await _drain_events(client)) == 1
