"""Generate the DisaggregatedInference CRD from the pydantic models.

pydantic's JSON schema is close to, but not, a Kubernetes structural schema: it uses
$refs, `anyOf [X, null]` for optional fields, titles and no defaults for nested objects.
This module rewrites it into the structural form the API server accepts and adds what
only a CRD has (CEL rules, subresources, printer columns).
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from bidirkv.operator.api import spec as api

# Names are limited so that pod names (`NAME-decode-123`) and the controller-revision-hash
# label (`NAME-decode-<10 chars>`) stay within Kubernetes' 63-character label values.
MAX_NAME_LENGTH = 40

_DROP = {"title", "additionalProperties"}


_OPTIONAL = "x-bidirkv-optional"


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = copy.deepcopy(defs[node.pop("$ref").rsplit("/", 1)[-1]])
        target.update(node)  # keep the field's own description/default over the type's
        node = target
    any_of = node.pop("anyOf", None)
    if any_of is not None:
        branches = [b for b in any_of if b.get("type") != "null"]
        if len(branches) == 1:
            # The branch is structural already; processing it again would lose the optional
            # markers of its own fields.
            outer = {k: v for k, v in node.items() if k not in _DROP}
            return _optional({**_structural(branches[0], defs), **outer})
        if {b.get("type") for b in branches} != {"integer", "string"}:
            raise ValueError(f"cannot express anyOf {any_of} in a structural schema")
        # Kubernetes quantities: int-or-string, the string form with the API server's
        # own quantity grammar (the pattern applies to strings only).
        node["x-kubernetes-int-or-string"] = True
        pattern = next((b["pattern"] for b in branches if "pattern" in b), None)
        if pattern:
            node["pattern"] = pattern
        node = _optional(node)
    extra = node.get("additionalProperties")
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {k: _structural(v, defs) for k, v in value.items()}
        elif key == "items":
            out[key] = _structural(value, defs)
        else:
            out[key] = value
    if isinstance(extra, dict) and extra:
        out["additionalProperties"] = _structural(extra, defs)
    if out.get("type") == "object" and "properties" not in out and not isinstance(extra, dict):
        out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("type") == "object" and "properties" in out:
        _default_objects(out)
    return out


def _optional(node: dict[str, Any]) -> dict[str, Any]:
    """Optional (None by default): absent stays absent, never defaulted to `{}` (an empty
    label selector means "everything")."""
    if node.get("default", 0) is None:
        del node["default"]
        node[_OPTIONAL] = True
    return node


def _default_objects(node: dict[str, Any]) -> None:
    """An object field with a model default gets `{}` so the server fills in its fields."""
    required = set(node.get("required", []))
    for name, prop in node["properties"].items():
        if (
            prop.get("type") == "object"
            and "properties" in prop
            and "default" not in prop
            and name not in required
            and not prop.pop(_OPTIONAL, False)
        ):
            prop["default"] = {}
        prop.pop(_OPTIONAL, None)


def openapi_schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True)
    defs = raw.pop("$defs", {})
    return _structural(raw, defs)


def spec_schema() -> dict[str, Any]:
    schema = openapi_schema(api.DisaggregatedInferenceSpec)
    schema["description"] = "Desired state of a 1PnD disaggregated vLLM deployment."
    schema["x-kubernetes-validations"] = [
        {"rule": rule, "message": message, "fieldPath": path}
        for rule, message, path in api.CEL_RULES
    ]
    return schema


def status_schema() -> dict[str, Any]:
    schema = openapi_schema(api.DisaggregatedInferenceStatus)
    schema["description"] = "Observed state, written by the operator."
    cond = schema["properties"]["conditions"]
    cond["x-kubernetes-list-type"] = "map"
    cond["x-kubernetes-list-map-keys"] = ["type"]
    return schema


def _printer_columns() -> list[dict[str, str]]:
    return [
        {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
        {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.summary",
         "description": "Ready/desired prefill pods"},
        {"name": "Decode", "type": "string", "jsonPath": ".status.decode.summary",
         "description": "Ready/desired decode pods"},
        {"name": "Draining", "type": "string", "jsonPath": ".status.decode.drainingSummary",
         "description": "Decode pods leaving, each until the conversations it holds moved or "
         "its drain ran out, and the conversations they still hold"},
        {"name": "Bidirectional", "type": "boolean", "jsonPath": ".spec.kvTransfer.bidirectional"},
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def _root_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "DisaggregatedInference runs one prefill pool, n decode replicas and a "
        "KV-cache-aware router of vLLM with bidirectional NIXL KV transfer.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        "x-kubernetes-validations": [
            {
                "rule": f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
                "message": f"metadata.name must be at most {MAX_NAME_LENGTH} characters "
                "(pod and revision names derived from it must fit in 63)",
            }
        ],
    }


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{api.PLURAL}.{api.GROUP}",
            "labels": {"app.kubernetes.io/name": "bidir-kv"},
        },
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": ["all", "bidirkv"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": _root_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.decode.replicas",
                            "statusReplicasPath": ".status.decode.replicas",
                            "labelSelectorPath": ".status.decode.selector",
                        },
                    },
                    "additionalPrinterColumns": _printer_columns(),
                }
            ],
        },
    }


def crd_yaml() -> str:
    header = "# Generated from bidirkv/operator/api/spec.py by `make crds`; do not edit by hand.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)
