"""The operator against an API server that behaves like kube-apiserver where it matters:
canonical quantities and defaults, failed writes, dropped watches, rollouts."""

from __future__ import annotations

import asyncio
import copy

from bidirkv.operator.kube import KINDS
from bidirkv.operator.main import CHILD_RESOURCES, MANAGED_SELECTOR
from kubeapi.operatorenv import api_server, di_path, eventually, resource, running_operator

CHILD_KINDS = 11


def noncanonical(minimal: dict) -> dict:
    doc = copy.deepcopy(minimal)
    doc["spec"]["prefill"] = {"resources": {"requests": {"cpu": "0.5", "memory": "1024Mi"},
                                            "limits": {"memory": "2048Mi"}}}
    doc["spec"]["decode"] = {"resources": {"requests": {"cpu": "1.5e3", "memory": ".5Gi"},
                                           "limits": {"cpu": "+2"}}}
    doc["spec"]["efa"] = {"shmSize": "16384Mi"}
    doc["spec"]["engine"] = {"modelCache": {"emptyDir": {"sizeLimit": "1e11"}},
                             "extraEnv": [{"name": "EMPTY", "value": ""}]}
    return doc


async def converged(client, controller, name="tiny", ns="ns1"):
    async def all_there():
        di = await client.get("DisaggregatedInference", ns, name)
        return di if (di.get("status") or {}).get("conditions") else None

    await eventually(all_there, what="status")
    await controller.idle()


async def force_reconciles(controller, n: int) -> None:
    """Reconcile every resource `n` more times: the proof that it had the chance to write."""
    for _ in range(n):
        seen = controller.reconciles
        for uid in list(controller.controller.owners):
            controller.loop.call_soon_threadsafe(controller.controller.queue.schedule, uid, 0)
        await eventually(lambda s=seen: controller.reconciles > s, what="a reconcile")
        await controller.idle()


async def test_noncanonical_quantities_converge_then_nothing_is_written(minimal):
    async with api_server() as (server, client), running_operator(client) as controller:
        await client.call("POST", di_path("ns1"), resource(noncanonical(minimal), "ns1"))
        await converged(client, controller)
        sts = await client.get("StatefulSet", "ns1", "tiny-prefill")
        c = sts["spec"]["template"]["spec"]["containers"][0]
        assert c["resources"]["requests"] == {"cpu": "500m", "memory": "1Gi"}  # canonical
        server.requests.clear()
        # 10 s of reconciles (one per second, each forced) against what the server
        # canonicalised: any that compared the spec's spelling, or any timer, would write.
        before = controller.reconciles
        for _ in range(10):
            await force_reconciles(controller, 1)
            await asyncio.sleep(1)
        assert controller.reconciles >= before + 10
        assert server.writes() == []


async def test_child_watches_are_filtered_by_the_server(minimal):
    async with api_server() as (server, client), running_operator(client) as controller:
        await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
        await converged(client, controller)
    watched = {r.resource: r.label_selector for r in server.requests
               if r.verb in ("watch", "list")}
    for _, _, plural in CHILD_RESOURCES:
        assert watched[plural] == MANAGED_SELECTOR, plural


async def test_conflicts_and_server_errors_are_retried_until_converged(minimal):
    async with api_server() as (server, client), running_operator(client) as controller:
        await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
        await converged(client, controller)
        server.inject("update", "statefulsets", 409, times=2)
        server.inject("patch", "disaggregatedinferences", 500, subresource="status", times=2)
        await client.call("PATCH", di_path("ns1", "tiny"),
                          {"spec": {"kvTransfer": {"decoderKvBlocksTtlSeconds": 900}}},
                          "application/merge-patch+json")

        async def applied():
            sts = await client.get("StatefulSet", "ns1", "tiny-decode")
            di = await client.get("DisaggregatedInference", "ns1", "tiny")
            return ("900" in str(sts["spec"]["template"]["spec"]["containers"][0]["args"])
                    and di["status"]["observedGeneration"] == di["metadata"]["generation"])

        await eventually(applied, timeout=30, what="the TTL applied and reported")
        failed = [f for f in server.faults if f.times]
        assert failed == []  # every injected failure was met, and retried past


async def test_a_dropped_watch_resumes(minimal):
    async with api_server() as (server, client), running_operator(client) as controller:
        await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
        await converged(client, controller)
        watches = sum(r.verb == "watch" for r in server.requests)
        server.drop_watches()
        await eventually(lambda: sum(r.verb == "watch" for r in server.requests) >= watches + 7,
                         what="watches re-established")
        await client.call("PATCH", KINDS["StatefulSet"].path("ns1", "tiny-decode"),
                          {"spec": {"replicas": 5}}, "application/merge-patch+json")

        async def restored():
            sts = await client.get("StatefulSet", "ns1", "tiny-decode")
            return sts["spec"]["replicas"] == 1

        await eventually(restored, timeout=20, what="hand edit seen and undone")


async def controller_writes(client, kind, name, ready: int, updated: int | None = None):
    obj = await client.get(kind, "ns1", name)
    await client.call("PATCH", KINDS[kind].path("ns1", name, "status"), {"status": {
        "observedGeneration": obj["metadata"]["generation"], "replicas": ready,
        "readyReplicas": ready, "updatedReplicas": ready if updated is None else updated}},
        "application/merge-patch+json")


async def phase(client, want):
    di = await client.get("DisaggregatedInference", "ns1", "tiny")
    return di if (di.get("status") or {}).get("phase") == want else None


def condition(di, type_):
    return next(c for c in di["status"]["conditions"] if c["type"] == type_)


async def test_a_template_change_is_progressing_until_it_runs_everywhere(minimal):
    minimal["spec"]["decode"] = {"replicas": 2}
    async with api_server() as (_, client), running_operator(client) as controller:
        await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
        await converged(client, controller)
        for kind, name, n in (("StatefulSet", "tiny-prefill", 1),
                              ("StatefulSet", "tiny-decode", 2),
                              ("Deployment", "tiny-router", 1)):
            await controller_writes(client, kind, name, n)
        await eventually(lambda: phase(client, "Ready"), what="Ready")

        # A knob that changes the engines' template: their counts still say 1/1 and 2/2,
        # but no controller has seen the new generation yet.
        await client.call("PATCH", di_path("ns1", "tiny"),
                          {"spec": {"kvTransfer": {"kvRecomputeThreshold": 128}}},
                          "application/merge-patch+json")
        di = await eventually(lambda: phase(client, "Progressing"), what="Progressing")
        assert condition(di, "Ready")["status"] == "False"
        assert condition(di, "Progressing")["reason"] == "RollingOut"
        assert "not yet observed" in condition(di, "DecodeReady")["message"]

        # The controller starts: one of two decode pods on the new template.
        await controller_writes(client, "StatefulSet", "tiny-decode", 2, updated=1)
        await controller_writes(client, "StatefulSet", "tiny-prefill", 1)

        # The two StatefulSets' events come on separate watches, in either order: a pass
        # may see decode's new counts before prefill's, so wait for the state with both.
        async def half_way():
            di = await phase(client, "Progressing")
            return di if di and "1/2 pods updated" in condition(di, "DecodeReady")["message"] \
                and condition(di, "PrefillReady")["status"] == "True" else None

        di = await eventually(half_way, what="prefill rolled out, decode 1/2 updated")
        assert condition(di, "Ready")["status"] == "False"
        assert di["status"]["decode"]["updated"] == 1

        await controller_writes(client, "StatefulSet", "tiny-decode", 2)
        di = await eventually(lambda: phase(client, "Ready"), what="Ready again")
        assert condition(di, "Progressing")["status"] == "False"
        assert condition(di, "Progressing")["reason"] == "RolloutComplete"
