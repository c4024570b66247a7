"""Compare a rendered child with what the API server holds, and build the replacement.

The API server adds defaults and allocated values (clusterIP, nodePorts, defaulted
probe fields, ...) to what we wrote, canonicalises quantities and drops empty values, so
"unchanged" means: every field we render is present with the same value as the server
keeps it. Anything else (a hand edit, a knob change) is replaced.
"""

from __future__ import annotations

import copy
from typing import Any

from kubernetes.utils import parse_quantity

# Service fields the API server allocates; a replace without them would reallocate
# (or be refused, clusterIP being immutable).
_SERVICE_ALLOCATED = ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy",
                      "healthCheckNodePort")

# Kinds whose spec.replicas an autoscaler may own.
_SCALED_KINDS = ("StatefulSet", "Deployment")

# Fields whose values are quantities: the API server stores them canonicalised ("0.5" ->
# "500m", "1024Mi" -> "1Gi"), so they are compared by value. Maps of quantities by their
# field name, single quantities by theirs.
_QUANTITY_MAPS = ("requests", "limits", "overhead")
_QUANTITY_FIELDS = ("sizeLimit", "averageValue")


def _quantity_equal(want: Any, have: Any) -> bool:
    try:
        return parse_quantity(want) == parse_quantity(have)
    except (ValueError, TypeError, ArithmeticError):
        return False


# Plain (not pointer) booleans the API server leaves out when false. Elsewhere an absent
# boolean means its default, which may be true (automountServiceAccountToken): a false we
# wrote that is gone was removed by someone, and is put back.
_OMITTED_FALSE = ("readOnly", "stdin", "stdinOnce", "tty", "hostNetwork", "hostPID",
                  "hostIPC", "publishNotReadyAddresses")


def _zero(key: str, value: Any) -> bool:
    # Go's omitempty drops these on the way out: absent on the server means "as written".
    if value is False:
        return key in _OMITTED_FALSE
    return value is None or value == "" or value == [] or value == {}


def is_subset(want: Any, have: Any, key: str = "") -> bool:
    """True when every field of `want` is in `have` with an equal value (lists pairwise),
    where equal is what the API server keeps: quantities by value, zero values may be
    absent. `key` is the field `want` is the value of."""
    if isinstance(want, dict):
        if not isinstance(have, dict):
            return False
        in_map = key in _QUANTITY_MAPS
        return all(_field_matches(k, v, have, in_map) for k, v in want.items())
    if isinstance(want, list):
        if not isinstance(have, list) or len(want) != len(have):
            return False
        return all(is_subset(w, h) for w, h in zip(want, have, strict=True))
    return want == have and type(want) is type(have)


def _field_matches(k: str, v: Any, have: dict[str, Any], in_quantity_map: bool) -> bool:
    if k not in have:
        return _zero(k, v)
    if (in_quantity_map or k in _QUANTITY_FIELDS) and not isinstance(v, dict | list | bool):
        return _quantity_equal(v, have[k])
    return is_subset(v, have[k], k)


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
    if body["kind"] in _SCALED_KINDS and "replicas" not in body["spec"]:
        # Left out by the renderer when an autoscaler owns it: a PUT without it would
        # reset it to the default (1).
        if "replicas" in actual.get("spec", {}):
            body["spec"]["replicas"] = actual["spec"]["replicas"]
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


def controlled_by(obj: dict[str, Any], uid: str) -> bool:
    """`obj`'s managing controller is the object with `uid` (a StatefulSet's pods: the
    reference it writes, `controller: true`; labels alone say nothing of who made it)."""
    return any(ref.get("uid") == uid and ref.get("controller") is True
               for ref in (obj.get("metadata") or {}).get("ownerReferences") or [])
