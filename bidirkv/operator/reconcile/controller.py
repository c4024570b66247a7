"""Level-based reconciliation of DisaggregatedInference resources.

Watch events (delivered by kopf) only fill two caches and schedule a reconcile of the
owning resource; the reconcile compares the rendered children with the cache and
writes only what differs. A cache miss or a suspected difference is confirmed with a
fresh GET before anything is written, so a restarted operator whose caches are still
filling writes nothing when nothing changed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

from bidirkv.operator.api import spec as api
from bidirkv.operator.kube import ApiError, KubeClient
from bidirkv.operator.reconcile.diff import controlled_by, differs, owned_by, replacement
from bidirkv.operator.reconcile.drainwatch import (
    DRAIN_TIMED_OUT,
    newly_timed_out,
    next_look,
    parse_time,
    timed_out_message,
)
from bidirkv.operator.reconcile.heldcount import HeldReads
from bidirkv.operator.reconcile.keysecret import CRD_OUTDATED, KeySecrets, RecordDropped
from bidirkv.operator.reconcile.status import compute_status, same_status
from bidirkv.operator.render.autoscaling import AUTOSCALER_KINDS, SCALED_OBJECT_API_VERSION
from bidirkv.operator.render.children import (
    Owner,
    optional_children,
    render,
    selector_string,
)
from bidirkv.operator.render.handlekey import STATUS_FIELD, recorded
from bidirkv.operator.render.monitoring import POD_MONITOR_API_VERSION
from bidirkv.operator.render.naming import child_name
from bidirkv.operator.render.netpol import namespace_error
from bidirkv.roleconfig import ROLES

log = logging.getLogger("bidirkv.operator")

Key = tuple[str, str, str]  # kind, namespace, name
# Children the operator does not watch (their CRD may be missing, and a watch would need
# list and watch on them): never trusted from the cache.
UNWATCHED_KINDS = frozenset({"PodMonitor", "HorizontalPodAutoscaler", "ScaledObject"})


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new` as a merge patch over `old`: fields it no longer has, at any depth of
    objects, are removed (null deletes; a list is replaced whole)."""
    patch: dict[str, Any] = {k: None for k in old if k not in new}
    for k, v in new.items():
        before = old.get(k)
        patch[k] = _merge_patch(before, v) if isinstance(v, dict) and isinstance(
            before, dict) else v
    return patch


def _key(obj: dict[str, Any]) -> Key:
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace", ""), meta["name"]


class Controller:
    def __init__(
        self,
        client: KubeClient,
        *,
        debounce: float = 0.05,
        max_backoff: float = 60.0,
        now: Callable[[], str] = _now,
        operator_namespace: str | None = None,
    ):
        """`operator_namespace`: the namespace this operator's pods run in, the one the
        engines' NetworkPolicy admits them from (None: not known; render/netpol.py)."""
        problem = None if operator_namespace is None else namespace_error(operator_namespace)
        if problem:
            raise ValueError(f"operator namespace: {problem}")
        self.client = client
        self.operator_namespace = operator_namespace
        self.debounce = debounce
        self.max_backoff = max_backoff
        self.now = now
        self.owners: dict[str, dict[str, Any]] = {}  # uid -> DisaggregatedInference
        self.children: dict[Key, dict[str, Any]] = {}
        self._pending: dict[str, asyncio.TimerHandle | asyncio.Task] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._failures: dict[str, int] = {}
        self._keys = KeySecrets(client, self._event)
        # Optional children confirmed absent: not looked up again until rendered.
        self._absent: set[Key] = set()
        # While pods drain: the next look at them (drainwatch.py), outside `_pending` so
        # that `idle` does not wait for drains.
        self._drain_looks: dict[str, asyncio.TimerHandle] = {}
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
            self._cancel(uid)
            if (look := self._drain_looks.pop(uid, None)) is not None:
                look.cancel()
            return
        self.owners[uid] = body
        self.schedule(uid, 0)

    def child_event(self, event_type: str | None, body: dict[str, Any]) -> None:
        key = _key(body)
        if event_type == "DELETED":
            self.children.pop(key, None)
        else:
            self.children[key] = body
        for ref in body["metadata"].get("ownerReferences", []):
            if ref.get("kind") == api.KIND and ref.get("uid") in self.owners:
                self.schedule(ref["uid"], self.debounce)

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
                self.schedule(uid, self.debounce)

    # -- scheduling -----------------------------------------------------------------
    def schedule(self, uid: str, delay: float) -> None:
        """Coalesce triggers: at most one reconcile of a resource is waiting."""
        if uid in self._pending:
            return
        loop = asyncio.get_running_loop()
        self._pending[uid] = loop.call_later(delay, self._start, uid)

    def _start(self, uid: str) -> None:
        self._pending[uid] = asyncio.get_running_loop().create_task(self._run(uid))

    def _cancel(self, uid: str) -> None:
        pending = self._pending.pop(uid, None)
        if pending is not None:
            pending.cancel()

    async def _run(self, uid: str) -> None:
        lock = self._locks.setdefault(uid, asyncio.Lock())
        async with lock:
            # Triggers arriving from here on schedule a new pass.
            self._pending.pop(uid, None)
            body = self.owners.get(uid)
            if body is None:
                return
            try:
                await self.reconcile(body)
                self._failures.pop(uid, None)
            except Exception as exc:  # noqa: BLE001 - any failure is retried with backoff
                n = self._failures[uid] = self._failures.get(uid, 0) + 1
                delay = min(self.max_backoff, 0.5 * 2 ** (n - 1))
                log.warning("reconcile of %s failed (%s); retrying in %.1fs",
                            body["metadata"]["name"], exc, delay)
                if uid in self.owners and uid not in self._pending:
                    self.schedule(uid, delay)

    async def idle(self, timeout: float = 30.0) -> None:
        """Wait until no reconcile is pending or running (tests, benchmarks)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._pending or any(lock.locked() for lock in self._locks.values()):
            if loop.time() > deadline:
                raise TimeoutError("reconciles still pending")
            await asyncio.sleep(0.02)

    def close(self) -> None:
        for uid in list(self._pending):
            self._cancel(uid)
        for look in self._drain_looks.values():
            look.cancel()
        self._drain_looks.clear()

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
                        await self._remove((kind, owner.namespace, obj["metadata"]["name"]),
                                           owner)
            try:
                seen[(obj["kind"], obj["metadata"]["name"])] = await self._apply(obj, owner)
            except ChildConflict as exc:
                problem = ("ChildConflict", str(exc))
                seen[(obj["kind"], obj["metadata"]["name"])] = None
            except KindMissing as exc:
                problem = problem or ("KindMissing", str(exc))
                seen[(obj["kind"], obj["metadata"]["name"])] = None
        for kind, name in optional_children(owner):
            if (kind, name) not in seen:
                await self._remove((kind, owner.namespace, name), owner)
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
        self._look_again(meta["uid"], status, now)
        if problem and _condition_message(previous) != problem[1]:
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
            sts = self.children.get(key)
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

    def _look_again(self, uid: str, status: dict[str, Any], now: str) -> None:
        """While pods drain, reconcile again at the next deadline (or RECHECK_S): a drain
        that runs out changes no StatefulSet."""
        when = parse_time(now)
        delay = None if when is None else next_look(status, when)
        look = self._drain_looks.pop(uid, None)
        if look is not None:
            look.cancel()
        if delay is not None:
            self._drain_looks[uid] = asyncio.get_running_loop().call_later(
                delay, self._drain_look, uid)

    def _drain_look(self, uid: str) -> None:
        self._drain_looks.pop(uid, None)
        if uid in self.owners:
            self.schedule(uid, 0)

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

    async def _remove(self, key: Key, owner: Owner) -> None:
        """Delete an optional child this resource owns and no longer renders."""
        if key in self._absent:
            return
        actual = self.children.pop(key, None) or await self.client.get(*key)
        if actual is not None and owned_by(actual, owner.uid):
            await self.client.delete(*key, actual["metadata"]["uid"])
            log.info("deleted %s/%s (turned off)", key[0], key[2])
        self._absent.add(key)

    async def _apply(self, obj: dict[str, Any], owner: Owner) -> dict[str, Any]:
        key = _key(obj)
        self._absent.discard(key)
        cached = self.children.get(key)
        # Only watched kinds keep their cache current; the others are read every pass, so
        # a hand edit or deletion is put right at the next reconcile.
        if (cached is not None and key[0] not in UNWATCHED_KINDS
                and owned_by(cached, owner.uid) and not differs(obj, cached)):
            return cached
        # Cache miss or a difference: confirm against the server before writing.
        actual = await self.client.get(*key)
        if actual is None:
            try:
                created = await self.client.create(obj)
            except ApiError as exc:
                if exc.status == 404 and (missing := _kind_missing(obj)):
                    raise KindMissing(missing) from None
                if exc.status != 409:
                    raise
                actual = await self.client.get(*key)
                if actual is None:
                    raise
            else:
                self.children[key] = created
                log.info("created %s/%s", key[0], key[2])
                return created
        if not owned_by(actual, owner.uid):
            raise ChildConflict(
                f"{key[0]} {key[1]}/{key[2]} exists and is not owned by this "
                "DisaggregatedInference; delete or rename it"
            )
        if not differs(obj, actual):
            self.children[key] = actual
            return actual
        updated = await self.client.replace(replacement(obj, actual))
        self.children[key] = updated
        log.info("updated %s/%s", key[0], key[2])
        return updated

    async def _write_status(self, body: dict[str, Any], status: dict[str, Any]) -> None:
        status = _drop_none(status)
        if same_status(body.get("status") or {}, status):
            return
        meta = body["metadata"]
        patch = _merge_patch(body.get("status") or {}, status)
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
        if _condition_message(previous) != message:
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


class ChildConflict(Exception):
    """A child name is taken by an object this resource does not own."""


class KindMissing(Exception):
    """The cluster does not serve the kind of an optional child (its CRD is missing)."""


def _kind_missing(obj: dict[str, Any]) -> str | None:
    """What to say when the cluster does not serve an optional child's kind."""
    served = f"the cluster serves no {obj['apiVersion']} {obj['kind']}"
    if obj["apiVersion"] == POD_MONITOR_API_VERSION:
        return (f"spec.monitoring.podMonitor.enabled is true but {served} (install "
                "prometheus-operator's CRDs, or turn it off)")
    if obj["apiVersion"] == SCALED_OBJECT_API_VERSION:
        role = obj["metadata"]["labels"]["app.kubernetes.io/component"]
        return (f"spec.{role}.autoscaling.engine is 'keda' but {served} (install KEDA, or "
                "use engine hpa)")
    return None


def _condition_message(status: dict[str, Any]) -> str | None:
    for cond in status.get("conditions", []):
        if cond.get("type") == "Reconciled" and cond.get("status") == "False":
            return cond.get("message")
    return None


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value
