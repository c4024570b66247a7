"""The controller, the comparison and the status, without an API server: a client double
that records calls and fails on demand."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from bidirkv.operator.api.spec import parse_spec
from bidirkv.operator.kube import ApiError
from bidirkv.operator.reconcile import diff
from bidirkv.operator.reconcile.controller import Controller
from bidirkv.operator.reconcile.status import compute_status, rollout_lag
from bidirkv.operator.render.children import Owner, render_resource


class Client:
    """Objects by (kind, namespace, name); `fail` maps (method, kind) to ApiErrors to
    raise, kind "*" for any."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.fail: dict[tuple[str, str], list[ApiError]] = {}
        self.writes = 0
        self.hidden: set[tuple[str, str, str]] = set()  # answered 404 once (a race)

    def _maybe_fail(self, method: str, kind: str) -> None:
        errors = self.fail.get((method, kind)) or self.fail.get((method, "*"))
        if errors:
            raise errors.pop(0)

    async def get(self, kind, namespace, name):
        self.calls.append(("GET", kind))
        self._maybe_fail("GET", kind)
        key = (kind, namespace, name)
        if key in self.hidden:
            self.hidden.discard(key)
            return None
        obj = self.objects.get(key)
        return copy.deepcopy(obj) if obj else None

    async def get_metadata(self, kind, namespace, name):
        self.calls.append(("GET_METADATA", kind))
        obj = self.objects.get((kind, namespace, name))
        return {"metadata": copy.deepcopy(obj["metadata"])} if obj else None

    async def list(self, kind, namespace, label_selector):
        """Every object of the kind in the namespace whose labels carry the selector's
        pairs (the operator's selectors are `k=v,...`)."""
        self.calls.append(("LIST", kind))
        self._maybe_fail("LIST", kind)
        want = dict(pair.split("=", 1) for pair in label_selector.split(","))
        return [copy.deepcopy(o) for (k, ns, _), o in self.objects.items()
                if k == kind and ns == namespace
                and want.items() <= (o["metadata"].get("labels") or {}).items()]

    async def create(self, obj):
        self.calls.append(("POST", obj["kind"]))
        self.writes += 1
        self._maybe_fail("POST", obj["kind"])
        obj = copy.deepcopy(obj)
        meta = obj["metadata"]
        if "name" not in meta:
            meta["name"] = f"{meta['generateName']}g{len(self.objects)}"
        if (obj["kind"], meta["namespace"], meta["name"]) in self.objects:
            raise ApiError(409, "AlreadyExists", f"{meta['name']} already exists")
        meta.setdefault("uid", f"uid-{obj['kind']}-{meta['name']}")
        meta.update(resourceVersion="1", generation=1)
        self.objects[(obj["kind"], meta["namespace"], meta["name"])] = obj
        return copy.deepcopy(obj)

    async def replace(self, obj):
        self.calls.append(("PUT", obj["kind"]))
        self.writes += 1
        self._maybe_fail("PUT", obj["kind"])
        meta = obj["metadata"]
        self.objects[(obj["kind"], meta["namespace"], meta["name"])] = copy.deepcopy(obj)
        return copy.deepcopy(obj)

    async def patch_status(self, kind, namespace, name, status):
        """A merge patch of the status of a resource held (`hold`); None for any other."""
        self.calls.append(("PATCH", kind))
        self.writes += 1
        self._maybe_fail("PATCH", kind)
        obj = self.objects.get((kind, namespace, name))
        if obj is None:
            return None
        merged = {**(obj.get("status") or {}), **status}
        obj["status"] = {k: v for k, v in merged.items() if v is not None}
        return copy.deepcopy(obj)

    def hold(self, body: dict[str, Any]) -> dict[str, Any]:
        """Serve `body` as the resource: its GET and its status writes."""
        meta = body["metadata"]
        self.objects[(body["kind"], meta["namespace"], meta["name"])] = copy.deepcopy(body)
        return body


def owner_body(minimal, client: Client | None = None) -> dict[str, Any]:
    body = copy.deepcopy(minimal)
    body["metadata"].update(generation=1)
    return client.hold(body) if client is not None else body


async def test_triggers_are_coalesced_into_one_reconcile(minimal):
    client = Client()
    controller = Controller(client, debounce=0.05)
    body = owner_body(minimal, client)
    controller.owners["u-1"] = body
    for _ in range(20):
        controller.queue.schedule("u-1", 0.05)
    await asyncio.sleep(0)
    await controller.queue.idle()
    assert controller.reconciles == 1


async def test_failures_back_off_exponentially_up_to_the_cap(minimal, monkeypatch):
    client = Client()
    controller = Controller(client, max_backoff=2.0)
    delays: list[float] = []
    real = controller.queue.schedule

    def record(uid: str, delay: float) -> None:
        delays.append(delay)
        real(uid, 0)  # run at once: the test checks the delays asked for, not the waiting

    monkeypatch.setattr(controller.queue, "schedule", record)
    client.fail["GET", "*"] = [ApiError(500, "InternalError", "boom")] * 5
    controller.owners["u-1"] = owner_body(minimal, client)
    record("u-1", 0)
    while len(delays) < 6:
        await asyncio.sleep(0.01)
    await controller.queue.idle()
    assert delays == [0, 0.5, 1.0, 2.0, 2.0, 2.0]
    assert controller.queue._failures == {}  # the sixth pass succeeded and cleared the count


async def test_a_conflict_on_create_reads_the_winner_and_goes_on(minimal):
    client = Client()
    controller = Controller(client)
    body = owner_body(minimal, client)
    children = render_resource(body)
    # Another replica created the first child between our GET and our POST.
    first = children[0]
    key = (first["kind"], "ns1", first["metadata"]["name"])
    client.objects[key] = copy.deepcopy(first)
    client.hidden.add(key)
    client.fail["POST", "Service"] = [ApiError(409, "AlreadyExists", "exists")]
    await controller.reconcile(body)
    # After the handle-key Secret's create and record (never a read of it):
    assert client.calls[1:3] == [("POST", "Secret"), ("PATCH", "DisaggregatedInference")]
    assert client.calls[3:7] == [("GET", "Service"), ("POST", "Service"), ("GET", "Service"),
                                 ("GET", "StatefulSet")]
    assert ("PUT", "Service") not in client.calls  # the winner's object matched: kept


def _mounted(client) -> set[str]:
    """The Secrets the pod templates the client holds read."""
    return {e["valueFrom"]["secretKeyRef"]["name"]
            for (kind, _, _), obj in client.objects.items() if kind in ("StatefulSet",
                                                                        "Deployment")
            for c in obj["spec"]["template"]["spec"]["containers"]
            for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})}


async def test_the_key_is_created_recorded_then_taken_from_the_record(minimal):
    client = Client()
    controller = Controller(client)
    body = owner_body(minimal, client)
    await controller.reconcile(body)
    # A fresh look at the resource, the create, the record: before any child.
    assert client.calls[:3] == [("GET", "DisaggregatedInference"), ("POST", "Secret"),
                                ("PATCH", "DisaggregatedInference")]
    record = client.objects[("DisaggregatedInference", "ns1", "tiny")]["status"]["handleKey"]
    assert record == {"name": "tiny-handle-key-u-1", "uid": "uid-Secret-tiny-handle-key-u-1"}
    assert _mounted(client) == {"tiny-handle-key-u-1"}
    # The next pass goes by the record alone: nothing asked of Secrets or the resource.
    client.calls.clear()
    await controller.reconcile(copy.deepcopy(client.objects[
        ("DisaggregatedInference", "ns1", "tiny")]))
    assert not [c for c in client.calls if c[1] in ("Secret", "DisaggregatedInference")
                and c[0] != "PATCH"]
    # A body older than the record (a watch event behind the status write): the fresh
    # look finds the record, and no second Secret is made.
    client.calls.clear()
    await controller.reconcile(body)
    assert ("POST", "Secret") not in client.calls
    assert [k for k in client.objects if k[0] == "Secret"] == [
        ("Secret", "ns1", "tiny-handle-key-u-1")]


async def test_a_secret_already_at_the_first_name_is_never_mounted(minimal):
    client = Client()
    controller = Controller(client)
    body = owner_body(minimal, client)
    taken = ("Secret", "ns1", "tiny-handle-key-u-1")
    # Planted, even with an ownerReference to the resource: the operator cannot tell.
    client.objects[taken] = {"kind": "Secret", "metadata": {
        "name": taken[2], "namespace": "ns1", "ownerReferences": [
            {"kind": "DisaggregatedInference", "name": "tiny", "uid": "u-1"}]}}
    await controller.reconcile(body)
    record = client.objects[("DisaggregatedInference", "ns1", "tiny")]["status"]["handleKey"]
    assert record["name"].startswith("tiny-handle-key-u-1-")
    assert _mounted(client) == {record["name"]}
    assert ("GET", "Secret") not in client.calls  # never read, not even its owners
    (event,) = [o for k, o in client.objects.items() if k[0] == "Event"]
    assert event["reason"] == "HandleKeyNameTaken" and event["type"] == "Warning"
    assert "Secret ns1/tiny-handle-key-u-1 already existed" in event["message"]


async def test_a_record_the_crd_drops_fails_the_pass_and_makes_no_second_secret(minimal):
    from bidirkv.operator.reconcile.keysecret import RecordDropped

    class OldCrd(Client):
        async def patch_status(self, kind, namespace, name, status):
            status = {k: v for k, v in status.items() if k != "handleKey"}  # pruned
            return await super().patch_status(kind, namespace, name, status)

    client = OldCrd()
    controller = Controller(client)
    body = owner_body(minimal, client)
    for _ in range(2):
        with pytest.raises(RecordDropped, match="CRD is older than this operator"):
            await controller.reconcile(body)
    assert [k for k in client.objects if k[0] == "Secret"] == [
        ("Secret", "ns1", "tiny-handle-key-u-1")]
    assert not [k for k in client.objects if k[0] == "StatefulSet"]
    status = client.objects[("DisaggregatedInference", "ns1", "tiny")]["status"]
    reconciled = next(c for c in status["conditions"] if c["type"] == "Reconciled")
    assert (reconciled["reason"], status["phase"]) == ("CrdOutdated", "Degraded")


async def test_a_trusted_tenant_header_open_to_anyone_creates_nothing(minimal):
    """Where the CRD's rule is not there to refuse it (an older CRD), the operator does:
    no child, the condition and an event naming both fields."""
    client = Client()
    controller = Controller(client)
    minimal["spec"]["router"] = {"trustedTenantHeader": "X-Tenant"}
    body = owner_body(minimal, client)
    await controller.reconcile(body)
    assert {k[0] for k in client.objects} == {"DisaggregatedInference", "Event"}
    status = client.objects[("DisaggregatedInference", "ns1", "tiny")]["status"]
    reconciled = next(c for c in status["conditions"] if c["type"] == "Reconciled")
    assert (status["phase"], reconciled["reason"]) == ("Invalid", "InvalidSpec")
    assert "spec.router.trustedTenantHeader: 'X-Tenant'" in reconciled["message"]
    assert "spec.networkPolicy.routerFrom is empty" in reconciled["message"]
    (event,) = [o for k, o in client.objects.items() if k[0] == "Event"]
    assert event["message"] == reconciled["message"]


async def test_a_foreign_child_is_reported_not_taken(minimal):
    client = Client()
    controller = Controller(client)
    body = owner_body(minimal, client)
    svc = render_resource(body)[0]
    foreign = copy.deepcopy(svc)
    foreign["metadata"]["ownerReferences"] = []
    client.objects[("Service", "ns1", svc["metadata"]["name"])] = foreign
    await controller.reconcile(body)
    assert ("PUT", "Service") not in client.calls
    assert client.objects[("Service", "ns1", svc["metadata"]["name"])] == foreign


def test_is_subset_reads_values_as_the_api_server_keeps_them():
    want = {"resources": {"requests": {"cpu": "0.5", "memory": "1024Mi"}},
            "env": [{"name": "A", "value": ""}], "readOnly": False, "args": [],
            "emptyDir": {"sizeLimit": "16384Mi"}}
    have = {"resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
            "env": [{"name": "A"}], "emptyDir": {"sizeLimit": "16Gi"}, "extra": 1}
    assert diff.is_subset(want, have)
    assert not diff.is_subset({"resources": {"requests": {"cpu": "0.6"}}}, have)
    # Only quantity fields compare by value: an env value of "1k" is not "1000".
    assert not diff.is_subset({"env": [{"name": "A", "value": "1k"}]},
                              {"env": [{"name": "A", "value": "1000"}]})
    assert not diff.is_subset({"replicas": 1}, {"replicas": "1"})
    assert not diff.is_subset({"enabled": True}, {})
    # A false the server keeps (a pointer field whose default is true) that is gone was
    # removed by someone: the child differs, and is put back.
    assert not diff.is_subset({"automountServiceAccountToken": False}, {})
    assert diff.is_subset({"readOnly": False}, {})


def test_replacement_keeps_what_the_server_allocated_and_others_added(minimal):
    svc = next(o for o in render_resource(minimal) if o["kind"] == "Service")
    actual = copy.deepcopy(svc)
    actual["metadata"].update(resourceVersion="7", labels={"team": "x"},
                              annotations={"note": "y"})
    actual["spec"].update(clusterIP="None", clusterIPs=["None"], ipFamilies=["IPv4"])
    body = diff.replacement(svc, actual)
    assert body["metadata"]["resourceVersion"] == "7"
    assert body["metadata"]["labels"]["team"] == "x"
    assert body["metadata"]["annotations"] == {"note": "y"}
    assert body["spec"]["ipFamilies"] == ["IPv4"]


def sts(generation=2, observed=2, replicas=2, ready=2, updated=2, revisions=("a", "a")):
    return {"metadata": {"generation": generation},
            "status": {"observedGeneration": observed, "replicas": replicas,
                       "readyReplicas": ready, "updatedReplicas": updated,
                       "currentRevision": revisions[0], "updateRevision": revisions[1]}}


@pytest.mark.parametrize(("obj", "lag"), [
    (sts(), None),
    (None, "not created yet"),
    (sts(observed=1), "generation 2 not yet observed"),
    (sts(observed=None), "observed: none"),
    (sts(updated=1), "1/2 pods updated"),
    (sts(replicas=3), "1 pods of an older template still running"),
    (sts(revisions=("a", "b")), "revision b rolling out over a"),
])
def test_rollout_lag(obj, lag):
    got = rollout_lag(obj, 2)
    assert got == lag if lag is None else lag in got


def test_ready_only_when_the_current_template_runs_everywhere(minimal):
    owner = Owner("tiny", "ns1", "u-1")
    spec = parse_spec(minimal["spec"])
    ready = {("StatefulSet", "tiny-prefill"): sts(replicas=1, ready=1, updated=1),
             ("StatefulSet", "tiny-decode"): sts(replicas=1, ready=1, updated=1),
             ("Deployment", "tiny-router"): sts(replicas=1, ready=1, updated=1)}
    status = compute_status(owner, spec, 1, ready, {}, "now")
    assert status["phase"] == "Ready"
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Progressing"]["status"] == "False"

    rolling = dict(ready)
    rolling[("StatefulSet", "tiny-decode")] = sts(generation=3, replicas=1, ready=1, updated=1)
    status = compute_status(owner, spec, 2, rolling, status, "later")
    conds = {c["type"]: c for c in status["conditions"]}
    assert status["phase"] == "Progressing"
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["reason"] == "RollingOut"
    assert conds["DecodeReady"]["reason"] == "RollingOut"
    assert "decode: generation 3 not yet observed" in conds["Progressing"]["message"]
    assert conds["PrefillReady"]["status"] == "True"


def test_nothing_running_yet_is_pending(minimal):
    owner = Owner("tiny", "ns1", "u-1")
    spec = parse_spec(minimal["spec"])
    fresh = {k: {"metadata": {"generation": 1}} for k in (
        ("StatefulSet", "tiny-prefill"), ("StatefulSet", "tiny-decode"),
        ("Deployment", "tiny-router"))}
    status = compute_status(owner, spec, 1, fresh, {}, "now")
    assert status["phase"] == "Pending"
