"""Level-based reconciliation of DisaggregatedInference resources: watch events (delivered
by kopf) fill the caches and schedule a pass over the owning resource (queue.py), which
brings its children to what it renders (apply.py) and writes its status (status.py)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

from bidirkv.operator.api import spec as api
from bidirkv.operator.kube import ApiError, KubeClient
from bidirkv.operator.reconcile.apply import ChildConflict, Children, KindMissing
from bidirkv.operator.reconcile.diff import controlled_by, owned_by
from bidirkv.operator.reconcile.drainwatch import (
    DRAIN_TIMED_OUT,
    format_time,
    newly_timed_out,
    next_look,
    parse_time,
    timed_out_message,
)
from bidirkv.operator.reconcile.heldcount import HeldReads
from bidirkv.operator.reconcile.keysecret import CRD_OUTDATED, KeySecrets, RecordDropped
from bidirkv.operator.reconcile.queue import PassQueue
from bidirkv.operator.reconcile.status import compute_status, failed_message, status_patch
from bidirkv.operator.render.autoscaling import AUTOSCALER_KINDS
from bidirkv.operator.render.children import (
    Owner,
    optional_children,
    render,
    selector_string,
)
from bidirkv.operator.render.handlekey import STATUS_FIELD, recorded
from bidirkv.operator.render.naming import child_name
from bidirkv.operator.render.netpol import namespace_error
from bidirkv.roleconfig import ROLES

log = logging.getLogger("bidirkv.operator")


def _now() -> str:
    return format_time(dt.datetime.now(dt.UTC))


class Controller:
    def __init__(self, client: KubeClient, *, debounce: float = 0.05, max_backoff: float = 60.0,
                 now: Callable[[], str] = _now, operator_namespace: str | None = None):
        """`operator_namespace`: the namespace this operator's pods run in, the one the
        engines' NetworkPolicy admits them from (None: not known; render/netpol.py)."""
        problem = None if operator_namespace is None else namespace_error(operator_namespace)
        if problem:
            raise ValueError(f"operator namespace: {problem}")
        self.client = client
        self.operator_namespace = operator_namespace
        self.debounce = debounce
        self.now = now
        self.owners: dict[str, dict[str, Any]] = {}  # uid -> DisaggregatedInference
        self.queue = PassQueue(self.owners, self.reconcile, max_backoff)
        self.children = Children(client)
        self._keys = KeySecrets(client, self._event)
        self._pods_refused = False
        # Draining decode pods' gauges: read on the event loop, one read per pod at once.
        self.held_reads = HeldReads()
        self.reconciles = 0

    # -- watch events ---------------------------------------------------------------
    def owner_event(self, event_type: str | None, body: dict[str, Any]) -> None:
        uid = body["metadata"]["uid"]
        if event_type == "DELETED" or body["metadata"].get("deletionTimestamp"):
            # Children carry owner references: the garbage collector removes them.
            self.owners.pop(uid, None)
            self._keys.forget(uid)
            self.queue.forget(uid)
            return
        self.owners[uid] = body
        self.queue.schedule(uid, 0)

    def child_event(self, event_type: str | None, body: dict[str, Any]) -> None:
        self.children.observe(event_type, body)
        for ref in body["metadata"].get("ownerReferences", []):
            if ref.get("kind") == api.KIND and ref.get("uid") in self.owners:
                self.queue.schedule(ref["uid"], self.debounce)

    def pod_event(self, event_type: str | None, body: dict[str, Any]) -> None:
        """An engine pod that starts leaving, or is gone: its resource's status follows
        its drain (a pod deleted by a node drain or an eviction changes no StatefulSet
        until it is gone)."""
        meta = body.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get("app.kubernetes.io/component") not in ROLES:
            return
        if event_type != "DELETED" and not meta.get("deletionTimestamp"):
            return
        for uid, owner in self.owners.items():
            om = owner["metadata"]
            if (om.get("name") == labels.get("app.kubernetes.io/instance")
                    and om.get("namespace") == meta.get("namespace")):
                self.queue.schedule(uid, self.debounce)

    # -- the reconcile pass ---------------------------------------------------------
    async def reconcile(self, body: dict[str, Any]) -> None:
        self.reconciles += 1
        meta = body["metadata"]
        generation = meta.get("generation")
        previous = body.get("status") or {}
        key = recorded(previous)
        owner = Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"],
                      handle_key=key and key["name"])
        try:
            spec = api.parse_spec(body.get("spec") or {})
            observed = await self._observed_replicas(owner, spec)
            desired = render(owner, spec, observed, operator_namespace=self.operator_namespace)
        except api.SpecError as exc:
            await self._report_invalid(body, owner, generation, previous, str(exc))
            return
        if key is None:
            # No child refers to a key before the Secret created here is recorded.
            key = await self._record_key(body, owner, previous)
            previous = {**previous, STATUS_FIELD: key}
            owner = dataclasses.replace(owner, handle_key=key["name"])
            desired = render(owner, spec, observed, operator_namespace=self.operator_namespace)
        seen: dict[tuple[str, str], dict[str, Any] | None] = {}
        problem = None
        for obj in desired:
            if obj["kind"] in AUTOSCALER_KINDS:
                # The other engine's autoscaler of the role goes first: KEDA refuses a
                # ScaledObject on a workload an HPA still scales, and the pass would stop.
                for kind in AUTOSCALER_KINDS:
                    if kind != obj["kind"]:
                        await self.children.remove(
                            (kind, owner.namespace, obj["metadata"]["name"]), owner)
            try:
                seen[(obj["kind"], obj["metadata"]["name"])] = await self.children.apply(
                    obj, owner)
            except ChildConflict as exc:
                problem = ("ChildConflict", str(exc))
                seen[(obj["kind"], obj["metadata"]["name"])] = None
            except KindMissing as exc:
                problem = problem or ("KindMissing", str(exc))
                seen[(obj["kind"], obj["metadata"]["name"])] = None
        for kind, name in optional_children(owner):
            if (kind, name) not in seen:
                await self.children.remove((kind, owner.namespace, name), owner)
        pods = await self._engine_pods(owner, seen)
        now = self.now()
        when = parse_time(now)
        # What each draining decode pod still holds, from its engine (unknown on failure).
        held = await self.held_reads.read(pods["decode"], when) if pods and when else {}
        status = compute_status(owner, spec, generation, seen, previous, now, problem,
                                pods, held)
        await self._write_status(body, status)
        for role, pod in newly_timed_out(previous, status):
            await self._event(body, "Warning", DRAIN_TIMED_OUT, timed_out_message(
                role, pod, getattr(spec, role).drain_seconds))
        self.queue.look_again(meta["uid"], None if when is None else next_look(status, when))
        if problem and failed_message(previous) != problem[1]:
            await self._event(body, "Warning", problem[0], problem[1])
        if problem and problem[0] == "KindMissing":
            # No event announces a CRD: retry (with backoff) until it is installed.
            raise KindMissing(problem[1])

    async def _observed_replicas(self, owner: Owner, spec: api.DisaggregatedInferenceSpec
                                 ) -> dict[str, int]:
        """The pods of each role's StatefulSet: its count (the autoscaler's, or the spec's),
        or more while a pod a scale-down removed is still there (draining: the router keeps
        its conversations until it is gone). Watched: a change reconciles, and the router's
        config follows."""
        out: dict[str, int] = {}
        for role in ROLES:
            key = ("StatefulSet", owner.namespace, child_name(owner, role))
            sts = self.children.cache.get(key)
            if sts is None and getattr(spec, role).autoscaling is not None:
                # Without a count of its own in the spec, an autoscaled role needs the
                # server's; a fixed role has one, and its watch brings what exists.
                sts = await self.client.get(*key)
            if sts is None or not owned_by(sts, owner.uid):
                continue
            counts = [(sts.get(part) or {}).get("replicas") for part in ("spec", "status")]
            counts = [n for n in counts if isinstance(n, int)]
            if counts:
                out[role] = max(counts)
        return out

    async def _engine_pods(self, owner: Owner,
                           seen: dict[tuple[str, str], dict[str, Any] | None]
                           ) -> dict[str, list[dict[str, Any]]] | None:
        """Each role's pods, for their drains: those its StatefulSet (as this pass applied
        it, `seen`) controls, not every pod with its labels, which anyone allowed to create
        pods in the namespace could give one (None: they could not be listed, and the
        status keeps what it last said of them)."""
        out: dict[str, list[dict[str, Any]]] = {}
        try:
            for role in ROLES:
                sts = seen.get(("StatefulSet", child_name(owner, role))) or {}
                uid = (sts.get("metadata") or {}).get("uid")
                listed = await self.client.list("Pod", owner.namespace,
                                                selector_string(owner, role))
                out[role] = [p for p in listed if uid and controlled_by(p, uid)]
        except ApiError as exc:
            if not self._pods_refused:
                log.warning("cannot list engine pods (%s): the status does not follow "
                            "their drains (the operator's role needs list on pods)", exc)
            self._pods_refused = True
            return None
        self._pods_refused = False
        return out

    async def _record_key(self, body: dict[str, Any], owner: Owner,
                          previous: dict[str, Any]) -> dict[str, str]:
        """The handle-key Secret the pods mount, created and recorded (keysecret.py)."""
        try:
            key, server_body = await self._keys.record(body, owner)
        except RecordDropped as exc:
            await self._report_invalid(body, owner, body["metadata"].get("generation"),
                                       previous, str(exc), CRD_OUTDATED, "Degraded")
            raise  # retried with backoff, recording the same Secret
        if server_body and owner.uid in self.owners:
            self.owners[owner.uid] = server_body
        return key

    async def _write_status(self, body: dict[str, Any], status: dict[str, Any]) -> None:
        patch = status_patch(body.get("status") or {}, status)
        if patch is None:
            return
        meta = body["metadata"]
        result = await self.client.patch_status(api.KIND, meta["namespace"], meta["name"], patch)
        if meta["uid"] in self.owners and result:
            self.owners[meta["uid"]] = result

    async def _report_invalid(self, body, owner, generation, previous, message,
                              reason: str = "InvalidSpec", phase: str | None = None) -> None:
        status = compute_status(owner, None, generation, {}, previous, self.now(),
                                (reason, message))
        if phase is not None:
            status["phase"] = phase
        await self._write_status(body, status)
        if failed_message(previous) != message:
            log.warning("%s/%s: %s", owner.namespace, owner.name, message)
            await self._event(body, "Warning", reason, message)

    async def _event(self, body: dict[str, Any], type_: str, reason: str, message: str):
        meta = body["metadata"]
        now = self.now()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": body.get("apiVersion", f"{api.GROUP}/{api.VERSION}"),
                "kind": api.KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": "bidir-kv-operator"},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.client.create(event)
        except ApiError as exc:  # an event is best effort; the condition says it too
            log.warning("could not post event %s: %s", reason, exc)
