"""Compare a rendered child with what the API server holds, and build the replacement.

The API server adds defaults and allocated values (clusterIP, nodePorts, defaulted
probe fields, ...) to what we wrote, so "unchanged" means: every field we render is
present with the same value. Anything else (a hand edit, a knob change) is replaced.
"""

from __future__ import annotations

import copy
from typing import Any

# Service fields the API server allocates; a replace without them would reallocate
# (or be refused, clusterIP being immutable).
_SERVICE_ALLOCATED = ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy",
                      "healthCheckNodePort")


def _scalar_equal(want: Any, have: Any) -> bool:
    if want == have and type(want) is type(have):
        return True
    # Quantities written as numbers come back as strings ("16" for 16).
    if isinstance(want, int | float) and not isinstance(want, bool) and isinstance(have, str):
        return str(want) == have
    return False


def is_subset(want: Any, have: Any) -> bool:
    """True when every field of `want` is in `have` with an equal value (lists pairwise)."""
    if isinstance(want, dict):
        if not isinstance(have, dict):
            return False
        return all(k in have and is_subset(v, have[k]) for k, v in want.items())
    if isinstance(want, list):
        if not isinstance(have, list) or len(want) != len(have):
            return False
        return all(is_subset(w, h) for w, h in zip(want, have, strict=True))
    return _scalar_equal(want, have)


def differs(desired: dict[str, Any], actual: dict[str, Any]) -> bool:
    keys = [k for k in desired if k not in ("apiVersion", "kind", "metadata")]
    meta_want = {k: desired["metadata"].get(k) for k in ("labels", "ownerReferences")}
    return not (
        is_subset({k: desired[k] for k in keys}, actual)
        and is_subset({k: v for k, v in meta_want.items() if v is not None},
                      actual.get("metadata", {}))
    )


def replacement(desired: dict[str, Any], actual: dict[str, Any]) -> dict[str, Any]:
    """The body of a PUT that makes `actual` match `desired`, keeping what others own."""
    body = copy.deepcopy(desired)
    meta, have = body["metadata"], actual.get("metadata", {})
    meta["resourceVersion"] = have.get("resourceVersion")
    # Labels and annotations others add (tools, controllers) survive; ours win.
    meta["labels"] = {**(have.get("labels") or {}), **(meta.get("labels") or {})}
    annotations = {**(have.get("annotations") or {}), **(meta.get("annotations") or {})}
    if annotations:
        meta["annotations"] = annotations
    if body["kind"] == "Service":
        spec, old = body["spec"], actual.get("spec", {})
        for key in _SERVICE_ALLOCATED:
            if key in old and key not in spec:
                spec[key] = old[key]
        node_ports = {p.get("name"): p.get("nodePort") for p in old.get("ports", [])}
        for port in spec.get("ports", []):
            if node_ports.get(port.get("name")) and "nodePort" not in port:
                if spec.get("type") in ("NodePort", "LoadBalancer"):
                    port["nodePort"] = node_ports[port["name"]]
    return body


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences", []))
