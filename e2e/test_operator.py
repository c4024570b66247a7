"""The real operator (kopf + official client) against an API server over HTTP."""

from __future__ import annotations

import pytest

from bidirkv.operator.kube import KINDS, ApiError
from kubeapi.operatorenv import api_server, di_path, eventually, resource, running_operator
from kubeapi.schemas import KUBE_VERSIONS, schema_errors

CHILDREN = [
    ("Service", "prefill"), ("StatefulSet", "prefill"), ("PodDisruptionBudget", "prefill"),
    ("Service", "decode"), ("StatefulSet", "decode"), ("PodDisruptionBudget", "decode"),
    ("ConfigMap", "router"), ("Deployment", "router"), ("Service", "router"),
    ("NetworkPolicy", "engines"), ("NetworkPolicy", "router"),
]


async def children(client, ns, name):
    out = {}
    for kind, comp in CHILDREN:
        out[(kind, comp)] = await client.get(kind, ns, f"{name}-{comp}")
    return out


async def all_children(client, ns, name):
    got = await children(client, ns, name)
    return got if all(got.values()) else None


async def get_di(client, ns, name):
    return await client.get("DisaggregatedInference", ns, name)


async def set_ready(client, ns, name, kind, ready):
    """What the StatefulSet/Deployment controller writes once `ready` pods of the current
    template serve (no controllers run here)."""
    obj = await client.get(kind, ns, name)
    path = KINDS[kind].path(ns, name, "status")
    await client.call("PATCH", path, {"status": {
        "observedGeneration": obj["metadata"]["generation"], "replicas": ready,
        "readyReplicas": ready, "updatedReplicas": ready}}, "application/merge-patch+json")


def cond(di, type_):
    return next(c for c in di["status"]["conditions"] if c["type"] == type_)


async def test_example_end_to_end(example):
    async with api_server() as (server, client), running_operator(client) as controller:
        await client.call("POST", di_path("default"), resource(example))
        kids = await eventually(lambda: all_children(client, "default", "qwen3-32b"),
                                what="all children")
        di = await eventually(
            lambda: _with_status(client, "default", "qwen3-32b"), what="status")
        await controller.idle()
        # Every object the operator wrote is valid for the strict schemas.
        bodies = [b for m, _, b in controller.client.sent if m in ("POST", "PUT")]
        assert {(b["kind"], b["metadata"]["name"]) for b in bodies} >= {
            (kind, f"qwen3-32b-{comp}") for kind, comp in CHILDREN}
        for body in bodies:
            for version in KUBE_VERSIONS:
                assert schema_errors(body, version) == []
        st = di["status"]
        assert st["observedGeneration"] == di["metadata"]["generation"]
        assert st["prefill"]["summary"] == "0/1" and st["decode"]["summary"] == "0/2"
        assert st["phase"] == "Pending"
        assert st["routerUrl"] == "http://qwen3-32b-router.default.svc:8000"
        assert cond(di, "Ready")["status"] == "False"
        assert cond(di, "Reconciled")["status"] == "True"
        sts = kids[("StatefulSet", "decode")]
        assert sts["spec"]["replicas"] == 2
        assert sts["metadata"]["ownerReferences"][0]["uid"] == di["metadata"]["uid"]

        # Pods become ready (no controllers here: their status is written for them).
        await set_ready(client, "default", "qwen3-32b-prefill", "StatefulSet", 1)
        await set_ready(client, "default", "qwen3-32b-decode", "StatefulSet", 2)
        await set_ready(client, "default", "qwen3-32b-router", "Deployment", 1)
        di = await eventually(lambda: _phase(client, "default", "qwen3-32b", "Ready"),
                              what="phase Ready")
        assert di["status"]["decode"]["summary"] == "2/2"
        assert cond(di, "Ready")["status"] == "True"
        assert cond(di, "DecodeReady")["status"] == "True"


async def _with_status(client, ns, name):
    di = await get_di(client, ns, name)
    return di if di and di.get("status", {}).get("conditions") else None


async def _phase(client, ns, name, phase):
    di = await get_di(client, ns, name)
    return di if di and di.get("status", {}).get("phase") == phase else None


async def _converged(client, controller, name="tiny", ns="ns1"):
    await eventually(lambda: all_children(client, ns, name), what="children")
    await eventually(lambda: _with_status(client, ns, name), what="status")
    await controller.idle()


async def _rvs(client, ns, name):
    return {k: v["metadata"]["resourceVersion"] for k, v in
            (await children(client, ns, name)).items()}


async def test_knob_update_and_scale_touch_only_what_they_should(minimal):
    async with api_server() as (server, client), running_operator(client) as controller:
        await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
        await _converged(client, controller)
        before = await children(client, "ns1", "tiny")
        rv0 = await _rvs(client, "ns1", "tiny")

        # A TTL knob: both engine templates change, the router Deployment does not.
        await client.call("PATCH", di_path("ns1", "tiny"),
                          {"spec": {"kvTransfer": {"decoderKvBlocksTtlSeconds": 900}}},
                          "application/merge-patch+json")
        await eventually(lambda: _ttl_is(client, 900), what="new TTL on decode")
        await controller.idle()
        after = await children(client, "ns1", "tiny")
        rv1 = await _rvs(client, "ns1", "tiny")
        changed = {k for k in rv0 if rv0[k] != rv1[k]}
        assert changed == {("StatefulSet", "prefill"), ("StatefulSet", "decode"),
                           ("ConfigMap", "router")}
        for role in ("prefill", "decode"):
            t0 = before[("StatefulSet", role)]["spec"]["template"]["metadata"]["annotations"]
            t1 = after[("StatefulSet", role)]["spec"]["template"]["metadata"]["annotations"]
            assert t0["bidirkv.io/config-hash"] != t1["bidirkv.io/config-hash"]

        # Scale decode through the scale subresource (kubectl scale / HPA).
        await client.call("PATCH", di_path("ns1", "tiny", "scale"),
                          {"spec": {"replicas": 3}}, "application/merge-patch+json")
        await eventually(lambda: _replicas_is(client, 3), what="decode replicas 3")
        await controller.idle()
        scaled = await children(client, "ns1", "tiny")
        rv2 = await _rvs(client, "ns1", "tiny")
        changed = {k for k in rv1 if rv1[k] != rv2[k]}
        assert changed == {("StatefulSet", "decode"), ("ConfigMap", "router")}
        assert (scaled[("StatefulSet", "decode")]["spec"]["template"]
                == after[("StatefulSet", "decode")]["spec"]["template"])
        di = await eventually(lambda: _desired_is(client, 3), what="status decode desired 3")
        assert di["status"]["decode"]["selector"].endswith("app.kubernetes.io/component=decode")


async def _ttl_is(client, ttl):
    sts = await client.get("StatefulSet", "ns1", "tiny-decode")
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    return f'"decoder_kv_blocks_ttl":{ttl}' in args[args.index("--kv-transfer-config") + 1]


async def _replicas_is(client, n):
    sts = await client.get("StatefulSet", "ns1", "tiny-decode")
    return sts["spec"]["replicas"] == n


async def _desired_is(client, n):
    di = await get_di(client, "ns1", "tiny")
    return di if di.get("status", {}).get("decode", {}).get("desired") == n else None


async def test_hand_edits_and_deletions_are_restored(minimal):
    async with api_server() as (server, client), running_operator(client) as controller:
        await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
        await _converged(client, controller)
        # Deleted child comes back.
        await client.call("DELETE", KINDS["Service"].path("ns1", "tiny-decode"))
        svc = await eventually(lambda: client.get("Service", "ns1", "tiny-decode"),
                               what="service restored")
        assert svc["spec"]["publishNotReadyAddresses"] is True
        # Edited child is put back; foreign labels survive.
        await client.call("PATCH", KINDS["StatefulSet"].path("ns1", "tiny-prefill"),
                          {"metadata": {"labels": {"team": "x"}},
                           "spec": {"replicas": 7}}, "application/merge-patch+json")
        sts = await eventually(lambda: _sts_replicas(client, "tiny-prefill", 1),
                               what="replicas restored")
        assert sts["metadata"]["labels"]["team"] == "x"
        cm_path = KINDS["ConfigMap"].path("ns1", "tiny-router")
        await client.call("PATCH", cm_path, {"data": {"router.json": "{}"}},
                          "application/merge-patch+json")
        await eventually(lambda: _cm_has_endpoints(client), what="configmap restored")


async def _sts_replicas(client, name, n):
    sts = await client.get("StatefulSet", "ns1", name)
    return sts if sts and sts["spec"]["replicas"] == n else None


async def _cm_has_endpoints(client):
    cm = await client.get("ConfigMap", "ns1", "tiny-router")
    return "tiny-decode-0" in cm["data"]["router.json"]


async def test_restart_with_nothing_changed_writes_nothing(minimal, example):
    async with api_server() as (server, client):
        async with running_operator(client) as controller:
            await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
            await client.call("POST", di_path("default"), resource(example))
            await _converged(client, controller)
            await _converged(client, controller, "qwen3-32b", "default")
        expected = {(kind, ns, f"{name}-{comp}") for ns, name in (("ns1", "tiny"),
                                                                    ("default", "qwen3-32b"))
                    for kind, comp in CHILDREN}
        server.requests.clear()
        async with running_operator(client) as controller:
            # The proof that it had every chance to write: both resources reconciled
            # after every child reached its caches.
            await eventually(lambda: expected <= set(controller.controller.children.cache),
                             what="every child in the new operator's caches")
            seen = controller.reconciles
            for uid in list(controller.controller.owners):
                controller.loop.call_soon_threadsafe(controller.controller.queue.schedule, uid, 0)
            await eventually(lambda: controller.reconciles >= seen + 2, what="two reconciles")
            await controller.idle()
        # Not even the handle-key Secrets: each is recorded in its resource's status.
        assert server.writes() == []
        assert [r for r in server.requests if r.resource == "secrets"] == []


def mounted_secrets(kids) -> set[str]:
    """Every Secret the children's pod templates read."""
    out = set()
    for obj in kids.values():
        template = (obj.get("spec") or {}).get("template")
        for c in (template or {}).get("spec", {}).get("containers", []):
            out |= {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env") or []
                    if "secretKeyRef" in e.get("valueFrom", {})}
    return out


async def test_the_handle_key_secret_is_created_once_recorded_and_never_read(minimal):
    import base64
    import json

    async with api_server() as (server, client):
        async with running_operator(client) as controller:
            await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
            await _converged(client, controller)
            di = await get_di(client, "ns1", "tiny")
            record = di["status"]["handleKey"]
            assert record["name"] == f"tiny-handle-key-{di['metadata']['uid'][:8]}"
            secret = await client.get("Secret", "ns1", record["name"])
            assert secret["metadata"]["uid"] == record["uid"]
            key = base64.b64decode(secret["data"]["current"]).decode()
            assert len(key) == 64 and int(key, 16) >= 0  # 256 random bits, hex
            (ref,) = secret["metadata"]["ownerReferences"]
            assert (ref["kind"], ref["uid"], ref["controller"]) == (
                "DisaggregatedInference", di["metadata"]["uid"], True)
            assert mounted_secrets(await children(client, "ns1", "tiny")) == {record["name"]}
            # A spec change reconciles again, and so does a new process: the record is
            # all they go by, and the Secret is neither created again nor rewritten.
            await client.call("PATCH", di_path("ns1", "tiny"),
                              {"spec": {"decode": {"replicas": 2}}},
                              "application/merge-patch+json")
            await eventually(lambda: _decode_replicas(client, 2), what="decode scaled")
            await controller.idle()
        async with running_operator(client) as controller:
            await eventually(lambda: controller.reconciles >= 1, what="a reconcile")
            await controller.idle()
        assert [r.verb for r in server.writes() if r.resource == "secrets"] == ["create"]
        # The operator never read a Secret: the test's own read above is the one there is.
        reads = [r for r in server.requests
                 if r.resource == "secrets" and r.verb in ("get", "list", "watch")]
        assert len(reads) == 1 and server.metadata_reads == []
        # Nowhere but in the Secret: not in status, events or any child.
        others = [await get_di(client, "ns1", "tiny"),
                  *server.list("v1", "events", "ns1"),
                  *(await children(client, "ns1", "tiny")).values()]
        assert key not in json.dumps(others)


async def test_a_planted_handle_key_is_never_mounted(minimal):
    """A Secret put where the operator would create the key, before its first pass (by
    anyone allowed to create Secrets in the namespace, who can read the resource's uid),
    even owned by the resource, is left unused: the key is created under a generated
    name and the status records that one."""
    async with api_server() as (server, client):
        await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
        uid = (await get_di(client, "ns1", "tiny"))["metadata"]["uid"]
        owned = [{"apiVersion": "bidirkv.io/v1alpha1", "kind": "DisaggregatedInference",
                  "name": "tiny", "uid": uid, "controller": True}]
        planted = [f"tiny-handle-key-{uid[:8]}", "tiny-handle-key"]  # and the former name
        for name in planted:
            await client.create({"apiVersion": "v1", "kind": "Secret", "metadata": {
                "name": name, "namespace": "ns1", "ownerReferences": owned},
                "data": {"current": "YWJj"}})
        server.requests.clear()
        async with running_operator(client) as controller:
            await _converged(client, controller)
        requests = [r.verb for r in server.requests if r.resource == "secrets"]
        mounted = mounted_secrets(await children(client, "ns1", "tiny"))
        assert mounted and mounted.isdisjoint(planted), mounted
        assert requests == ["create", "create"]  # the first refused; and no read
        di = await get_di(client, "ns1", "tiny")
        record = di["status"]["handleKey"]
        assert record["name"].startswith(f"{planted[0]}-") and record["name"] not in planted
        assert cond(di, "Reconciled")["status"] == "True"
        assert mounted == {record["name"]}
        secret = await client.get("Secret", "ns1", record["name"])
        assert secret["metadata"]["uid"] == record["uid"]
        assert secret["data"] != {"current": "YWJj"}
        for name in planted:  # left as they were
            assert (await client.get("Secret", "ns1", name))["data"] == {"current": "YWJj"}
        (event,) = [e for e in server.list("v1", "events", "ns1")
                    if e.get("reason") == "HandleKeyNameTaken"]
        assert event["type"] == "Warning"
        assert f"Secret ns1/{planted[0]} already existed" in event["message"]
        assert f"the key is Secret ns1/{record['name']}" in event["message"]


async def _decode_replicas(client, n):
    sts = await client.get("StatefulSet", "ns1", "tiny-decode")
    return sts if sts and sts["spec"]["replicas"] == n else None


async def test_delete_leaves_children_to_the_garbage_collector(minimal):
    async with api_server(gc=True) as (server, client), running_operator(client) as ctl:
        await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
        await _converged(client, ctl)
        uid = (await get_di(client, "ns1", "tiny"))["metadata"]["uid"]
        for obj in (await children(client, "ns1", "tiny")).values():
            refs = obj["metadata"]["ownerReferences"]
            assert refs[0]["uid"] == uid and refs[0]["blockOwnerDeletion"] is True
        server.requests.clear()
        await client.call("DELETE", di_path("ns1", "tiny"))
        await eventually(lambda: _none_left(client), what="children collected")
        # The proof that it saw everything go: the deletion processed, every child's
        # DELETED event in its caches.
        await eventually(lambda: not ctl.controller.owners and not any(
            k[1] == "ns1" for k in ctl.controller.children.cache), what="deletions seen")
        await ctl.idle()
        # The operator wrote nothing while its resource went away (no re-creation).
        assert [r for r in server.writes() if r.verb != "delete"] == []


async def _none_left(client):
    return not any((await children(client, "ns1", "tiny")).values())


async def test_operator_only_errors_become_condition_and_event(minimal):
    async with api_server() as (server, client), running_operator(client) as controller:
        await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
        await _converged(client, controller)
        rv0 = await _rvs(client, "ns1", "tiny")
        # The schema allows any extra argument; only the operator knows --port is its own.
        await client.call("PATCH", di_path("ns1", "tiny"),
                          {"spec": {"engine": {"extraArgs": ["--port=9000"]},
                                    "decode": {"replicas": 4}}},
                          "application/merge-patch+json")
        di = await eventually(lambda: _phase(client, "ns1", "tiny", "Invalid"),
                              what="phase Invalid")
        c = cond(di, "Reconciled")
        assert c["status"] == "False" and c["reason"] == "InvalidSpec"
        assert "spec.engine.extraArgs[0]: '--port=9000' is managed by the operator" in c[
            "message"]
        assert di["status"]["observedGeneration"] == di["metadata"]["generation"]
        await controller.idle()
        assert await _rvs(client, "ns1", "tiny") == rv0  # nothing half-applied
        events = [e for e in server.list("v1", "events", "ns1")
                  if e.get("reason") == "InvalidSpec"]
        assert len(events) == 1 and "extraArgs[0]" in events[0]["message"]
        assert events[0]["involvedObject"]["name"] == "tiny"

        # Fixing the spec applies it and clears the condition.
        await client.call("PATCH", di_path("ns1", "tiny"),
                          {"spec": {"engine": {"extraArgs": ["--block-size=16"]}}},
                          "application/merge-patch+json")
        di = await eventually(lambda: _reconciled(client), what="reconciled again")
        sts = await client.get("StatefulSet", "ns1", "tiny-decode")
        assert sts["spec"]["replicas"] == 4


async def _reconciled(client):
    di = await get_di(client, "ns1", "tiny")
    c = next((c for c in di.get("status", {}).get("conditions", [])
              if c["type"] == "Reconciled"), None)
    return di if c and c["status"] == "True" else None


async def test_a_foreign_object_with_a_child_name_is_not_taken_over(minimal):
    async with api_server() as (server, client), running_operator(client) as controller:
        foreign = {"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": "tiny-router", "namespace": "ns1"},
                   "data": {"mine": "yes"}}
        await client.create(foreign)
        await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
        di = await eventually(lambda: _phase(client, "ns1", "tiny", "Degraded"),
                              what="phase Degraded")
        assert "ConfigMap ns1/tiny-router exists and is not owned" in cond(di, "Reconciled")[
            "message"]
        await controller.idle()
        cm = await client.get("ConfigMap", "ns1", "tiny-router")
        assert cm["data"] == {"mine": "yes"}
        assert await client.get("StatefulSet", "ns1", "tiny-decode") is not None


@pytest.mark.parametrize(
    "change, message",
    [
        ({"router": {"conversationTtlSeconds": 475}},
         "router.conversationTtlSeconds must be at least 10 s below"),
        ({"efa": {"enabled": True}, "prefill": {"efaDevices": 1},
          "decode": {"efaDevices": 1}}, "kvTransfer.backend must be LIBFABRIC"),
        ({"decode": {"replicas": 0}}, "spec.decode.replicas"),
        ({"kvTransfer": {"kvRecomputeThreshold": -5}}, "spec.kvTransfer.kvRecomputeThreshold"),
    ],
)
async def test_the_api_server_refuses_bad_specs(minimal, change, message):
    async with api_server() as (server, client):
        minimal["spec"].update(change)
        with pytest.raises(ApiError) as err:
            await client.call("POST", di_path("ns1"), resource(minimal, "ns1"))
        assert err.value.status == 422
        assert message in err.value.message
        assert server.list("bidirkv.io/v1alpha1", "disaggregatedinferences", "ns1") == []
