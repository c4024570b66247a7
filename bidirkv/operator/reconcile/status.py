"""The status of a DisaggregatedInference, computed from its children, and the merge patch
that writes it (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bidirkv.operator.api import spec as api
from bidirkv.operator.reconcile.drainwatch import (
    DRAINING,
    draining_condition,
    draining_pods,
    parse_time,
    role_drains,
)
from bidirkv.operator.render.autoscaling import role_replicas
from bidirkv.operator.render.children import Owner, child_name, router_url, selector_string
from bidirkv.operator.render.drain import short_drain
from bidirkv.operator.render.handlekey import STATUS_FIELD as HANDLE_KEY_FIELD
from bidirkv.roleconfig import ROLES, kv_fingerprint

# The condition that says what is wrong when the spec cannot be reconciled.
RECONCILED = "Reconciled"


def _counts(obj: dict[str, Any] | None) -> dict[str, int]:
    st = (obj or {}).get("status") or {}
    return {k: int(st.get(k) or 0) for k in ("replicas", "readyReplicas", "updatedReplicas")}


def rollout_lag(obj: dict[str, Any] | None, desired: int) -> str | None:
    """Why the child's current template does not yet run everywhere, or None.

    A controller that has not observed the latest generation has not started the rollout,
    whatever its counts say; then pods of the current template must be all there, and no
    pod of an older one left (a StatefulSet also says so with its revisions)."""
    if obj is None:
        return "not created yet"
    meta, st = obj.get("metadata") or {}, obj.get("status") or {}
    generation, observed = meta.get("generation"), st.get("observedGeneration")
    if generation is not None and (observed is None or observed < generation):
        return f"generation {generation} not yet observed by its controller " \
               f"(observed: {observed if observed is not None else 'none'})"
    counts = _counts(obj)
    if counts["updatedReplicas"] < desired:
        return f"{counts['updatedReplicas']}/{desired} pods updated to the current template"
    if counts["replicas"] > desired:
        return f"{counts['replicas'] - desired} pods of an older template still running"
    current, update = st.get("currentRevision"), st.get("updateRevision")
    if current and update and current != update:
        return f"revision {update} rolling out over {current}"
    return None


def _role_status(owner: Owner, desired: int, sts: dict[str, Any] | None, role: str):
    counts = _counts(sts)
    ready = counts["readyReplicas"]
    return {
        "desired": desired,
        "replicas": counts["replicas"],
        "ready": ready,
        "updated": counts["updatedReplicas"],
        "summary": f"{ready}/{desired}",
        "selector": selector_string(owner, role),
    }


def _readiness(obj: dict[str, Any] | None, desired: int, ready: int, what: str
               ) -> tuple[bool, str, str]:
    """(ok, reason, message) of one child's readiness condition."""
    lag = rollout_lag(obj, desired)
    if obj is None:
        return False, "NotCreated", lag or ""
    if lag is not None:
        return False, "RollingOut", f"{lag}; {ready}/{desired} {what} ready"
    if ready < desired:
        return False, "PodsNotReady", f"{ready}/{desired} {what} ready"
    return True, "PodsReady", f"{ready}/{desired} {what} ready"


def _condition(type_: str, ok: bool, reason: str, message: str, generation: int | None):
    return {
        "type": type_,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def _stamp(conditions: list[dict[str, Any]], previous: list[dict[str, Any]], now: str):
    """Keep lastTransitionTime when a condition's status did not change."""
    before = {c.get("type"): c for c in previous or []}
    out = []
    for cond in conditions:
        old = before.get(cond["type"])
        same = old is not None and old.get("status") == cond["status"]
        cond["lastTransitionTime"] = old.get("lastTransitionTime", now) if same else now
        out.append(cond)
    return out


def compute_status(owner: Owner, spec: api.DisaggregatedInferenceSpec | None,
                   generation: int | None, children: dict[tuple[str, str], dict[str, Any] | None],
                   previous: dict[str, Any], now: str, problem: tuple[str, str] | None = None,
                   pods: Mapping[str, Sequence[dict[str, Any]]] | None = None,
                   held: Mapping[str, int] | None = None) -> dict[str, Any]:
    """`children` maps (kind, name) to the object as read; `problem` is (reason, message)
    when the spec could not be applied (then the last good counts are kept); `pods`: each
    role's pods as listed (None: not listed, the last drains are kept); `held`: the
    conversations each draining decode pod holds, by pod name, as read this pass."""
    status: dict[str, Any] = {"observedGeneration": generation}
    # A record, not a reading: kept as it is (a status write without it would drop it).
    if HANDLE_KEY_FIELD in previous:
        status[HANDLE_KEY_FIELD] = previous[HANDLE_KEY_FIELD]
    if spec is None:
        return _unusable(status, previous, problem or ("InvalidSpec", ""), generation, now)
    readiness = []  # (condition type, ok, reason, message) of each child
    for role in ROLES:
        sts = children.get(("StatefulSet", child_name(owner, role)))
        seen = ((sts or {}).get("spec") or {}).get("replicas")
        desired = role_replicas(spec, role, {role: seen} if isinstance(seen, int) else None)
        rs = _role_status(owner, desired, sts, role)
        rs.update(_drains(role, pods, previous, now, held if role == "decode" else None))
        status[role] = rs
        readiness.append((f"{role.capitalize()}Ready",
                          *_readiness(sts, desired, rs["ready"], "pods")))
    dep = children.get(("Deployment", child_name(owner, "router")))
    status["routerReady"] = _counts(dep)["readyReplicas"]
    status["routerUrl"] = router_url(owner, spec)
    status["kvFingerprint"] = kv_fingerprint(spec)
    readiness.append(("RouterReady", *_readiness(dep, spec.router.replicas,
                                                  status["routerReady"], "router pods")))
    rolling = [f"{type_[: -len('Ready')].lower()}: {msg}"
               for type_, _, reason, msg in readiness if reason == "RollingOut"]
    all_ready = all(ok for _, ok, _, _ in readiness)
    conds = [_condition(*r, generation) for r in readiness]
    conds += _conditions_beyond_readiness(spec, status, rolling, problem, generation)
    conds.insert(0, _ready(conds, all_ready, rolling, problem, generation))
    status["conditions"] = _stamp(conds, previous.get("conditions", []), now)
    status["phase"] = _phase(status, problem, all_ready, rolling, _counts(dep)["replicas"])
    return status


def _unusable(status: dict[str, Any], previous: dict[str, Any], problem: tuple[str, str],
              generation: int | None, now: str) -> dict[str, Any]:
    """The spec is unusable: keep the counts of what runs, say what is wrong."""
    for key in ("prefill", "decode", "routerReady", "routerUrl", "kvFingerprint"):
        if key in previous:
            status[key] = previous[key]
    conds = [c for c in previous.get("conditions", []) if c.get("type") != RECONCILED]
    conds.append(_condition(RECONCILED, False, *problem, generation))
    status["conditions"] = _stamp(conds, previous.get("conditions", []), now)
    status["phase"] = "Invalid"
    return status


def _conditions_beyond_readiness(spec: api.DisaggregatedInferenceSpec, status: dict[str, Any],
                                 rolling: list[str], problem: tuple[str, str] | None,
                                 generation: int | None) -> list[dict[str, Any]]:
    """Progressing, DrainCoversRetention, Draining and Reconciled."""
    # Allowed, but a leaving decode pod then drops what it still holds at the deadline.
    short = short_drain(spec)
    drains, reason, msg = draining_condition(status)
    return [
        _condition("Progressing", bool(rolling), "RollingOut" if rolling else "RolloutComplete",
                   "; ".join(rolling) if rolling else "every child runs its current template",
                   generation),
        _condition("DrainCoversRetention", short is None,
                   "ShorterThanRetention" if short else "CoversRetention",
                   short or "a leaving decode pod may wait for every conversation it retains",
                   generation),
        _condition(DRAINING, drains, reason, msg, generation),
        _condition(RECONCILED, False, *problem, generation) if problem
        else _condition(RECONCILED, True, "Applied", "all children match the spec", generation),
    ]


def _ready(conds: list[dict[str, Any]], all_ready: bool, rolling: list[str],
           problem: tuple[str, str] | None, generation: int | None) -> dict[str, Any]:
    if problem and all_ready:
        return _condition("Ready", False, problem[0], "the pods are ready, but " + problem[1],
                          generation)
    if all_ready:
        return _condition("Ready", True, "AllReady", "prefill, decode and router are ready",
                          generation)
    waiting = ", ".join(c["type"][: -len("Ready")].lower() for c in conds
                        if c["type"].endswith("Ready") and c["status"] == "False")
    return _condition("Ready", False, "RollingOut" if rolling else "NotReady",
                      "waiting for " + waiting, generation)


def _phase(status: dict[str, Any], problem: tuple[str, str] | None, all_ready: bool,
           rolling: list[str], router_pods: int) -> str:
    if problem:
        return "Degraded"
    if all_ready:
        return "Ready"
    if any(status[r]["ready"] for r in ROLES) or status["routerReady"] or (
            rolling and (any(status[r]["replicas"] for r in ROLES) or router_pods)):
        # Pending until a first pod exists; from then on a rollout is progress.
        return "Progressing"
    return "Pending"


def _drains(role: str, pods: Mapping[str, Sequence[dict[str, Any]]] | None,
            previous: dict[str, Any], now: str, held: Mapping[str, int] | None
            ) -> dict[str, Any]:
    """The role's draining pods (drainwatch.py); without a listing, what was last seen."""
    before = previous.get(role) or {}
    when = parse_time(now)
    if pods is None or when is None:
        return role_drains(before.get("drainingPods") or [])
    return role_drains(draining_pods(pods.get(role) or [], before, when, held))


def status_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any] | None:
    """The merge patch that makes `old` say `new` (its unset fields left out); None when
    it says that already."""
    new = _drop_none(new)
    if {k: v for k, v in old.items() if v is not None} == new:
        return None
    return merge_patch(old, new)


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new` as a merge patch over `old`: fields it no longer has, at any depth of
    objects, are removed (null deletes; a list is replaced whole)."""
    patch: dict[str, Any] = {k: None for k in old if k not in new}
    for k, v in new.items():
        before = old.get(k)
        patch[k] = merge_patch(before, v) if isinstance(v, dict) and isinstance(
            before, dict) else v
    return patch


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def failed_message(status: dict[str, Any]) -> str | None:
    """What the status's Reconciled condition says while it is False: its Event was
    posted when it first said it."""
    for cond in status.get("conditions", []):
        if cond.get("type") == RECONCILED and cond.get("status") == "False":
            return cond.get("message")
    return None
