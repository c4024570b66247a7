"""The status of a DisaggregatedInference, computed from its children (pure)."""

from __future__ import annotations

from typing import Any

from bidirkv.roleconfig import ROLES, kv_fingerprint

from . import spec as api
from .render import Owner, child_name, router_url, selector_string

# The condition that says what is wrong when the spec cannot be reconciled.
RECONCILED = "Reconciled"


def _role_status(owner: Owner, desired: int, sts: dict[str, Any] | None, role: str):
    st = (sts or {}).get("status") or {}
    ready = int(st.get("readyReplicas") or 0)
    return {
        "desired": desired,
        "replicas": int(st.get("replicas") or 0),
        "ready": ready,
        "summary": f"{ready}/{desired}",
        "selector": selector_string(owner, role),
    }


def _role_ready(role_status: dict[str, Any], sts: dict[str, Any] | None) -> tuple[bool, str]:
    st = (sts or {}).get("status") or {}
    desired, ready = role_status["desired"], role_status["ready"]
    if sts is None:
        return False, "not created yet"
    updated = st.get("updatedReplicas")
    if updated is not None and updated < desired:
        return False, f"{updated}/{desired} pods updated to the current template"
    if ready < desired:
        return False, f"{ready}/{desired} pods ready"
    return True, f"{ready}/{desired} pods ready"


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


def compute_status(
    owner: Owner,
    spec: api.DisaggregatedInferenceSpec | None,
    generation: int | None,
    children: dict[tuple[str, str], dict[str, Any] | None],
    previous: dict[str, Any],
    now: str,
    problem: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """`children` maps (kind, name) to the object as read; `problem` is (reason, message)
    when the spec could not be applied (then the last good counts are kept)."""
    status: dict[str, Any] = {"observedGeneration": generation}
    if spec is None:
        # The spec is unusable: keep the counts of what runs, say what is wrong.
        for key in ("prefill", "decode", "routerReady", "routerUrl", "kvFingerprint"):
            if key in previous:
                status[key] = previous[key]
        reason, message = problem or ("InvalidSpec", "")
        conds = [c for c in previous.get("conditions", []) if c.get("type") != RECONCILED]
        conds.append(_condition(RECONCILED, False, reason, message, generation))
        status["conditions"] = _stamp(conds, previous.get("conditions", []), now)
        status["phase"] = "Invalid"
        return status

    conds = []
    all_ready = True
    for role in ROLES:
        sts = children.get(("StatefulSet", child_name(owner, role)))
        rs = _role_status(owner, getattr(spec, role).replicas, sts, role)
        status[role] = rs
        ok, msg = _role_ready(rs, sts)
        all_ready &= ok
        conds.append(_condition(f"{role.capitalize()}Ready", ok,
                                "PodsReady" if ok else "PodsNotReady", msg, generation))
    dep = children.get(("Deployment", child_name(owner, "router")))
    router_ready = int(((dep or {}).get("status") or {}).get("readyReplicas") or 0)
    status["routerReady"] = router_ready
    status["routerUrl"] = router_url(owner, spec)
    status["kvFingerprint"] = kv_fingerprint(spec)
    rok = dep is not None and router_ready >= spec.router.replicas
    all_ready &= rok
    conds.append(_condition("RouterReady", rok, "PodsReady" if rok else "PodsNotReady",
                            f"{router_ready}/{spec.router.replicas} router pods ready",
                            generation))
    if problem:
        conds.append(_condition(RECONCILED, False, problem[0], problem[1], generation))
    else:
        conds.append(_condition(RECONCILED, True, "Applied",
                                "all children match the spec", generation))
    conds.insert(0, _condition("Ready", all_ready and not problem,
                               "AllReady" if all_ready else "NotReady",
                               "prefill, decode and router are ready" if all_ready
                               else "waiting for " + ", ".join(
                                   c["type"][: -len("Ready")].lower() for c in conds
                                   if c["type"].endswith("Ready") and c["status"] == "False"
                               ), generation))
    status["conditions"] = _stamp(conds, previous.get("conditions", []), now)
    if problem:
        status["phase"] = "Degraded"
    elif all_ready:
        status["phase"] = "Ready"
    elif any(status[r]["ready"] for r in ROLES) or router_ready:
        status["phase"] = "Progressing"
    else:
        status["phase"] = "Pending"
    return status


def same_status(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return _normalise(a) == _normalise(b)


def _normalise(status: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in (status or {}).items() if v is not None}
