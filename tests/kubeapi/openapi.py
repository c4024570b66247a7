"""The ``/openapi/v2`` document, built the way kube-apiserver publishes it.

Two sources, as in a cluster:

- built-in kinds: the upstream definitions of Kubernetes 1.33 (the ``kubernetes-validate``
  package's copy, which is JSON Schema: it is turned back into Swagger 2.0 here), limited to
  the kinds this server serves and what they reference;
- custom resources: each served version's ``openAPIV3Schema``, converted for Swagger 2.0 as
  apiextensions-apiserver does (what v2 cannot say is dropped so that kubectl neither rejects
  valid objects nor chokes on the document), with ``metadata`` pointing at ObjectMeta, the
  ``x-kubernetes-group-version-kind`` extension and a ``<Kind>List`` definition.

Definitions are named like kube-apiserver's: ``io.bidirkv.v1alpha1.DisaggregatedInference``
(the group reversed, the version, the kind). kubectl looks kinds up by the GVK extension.

Paths: each resource's PATCH operation with its query parameters, which is where kubectl
learns that the server takes ``dryRun`` (``kubectl apply --dry-run=server``). No
``fieldValidation`` parameter is listed, as this server does not check fields itself, so
kubectl 1.25+ keeps validating on the client. Other operations are not listed.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterable
from typing import Any

from kubernetes_validate import utils as kv

from kubeapi.patch import APPLY_PATCH, JSON_PATCH, MERGE_PATCH, STRATEGIC_PATCH
from kubeapi.resources import ResourceType

BUILTIN_SCHEMAS = "kubernetes-json-schema/v1.33.0-local/_definitions.json"
_DEFS = "#/$defs/"
_REF = "#/definitions/"
_META = "io.k8s.apimachinery.pkg.apis.meta.v1."
# What the JSON Schema copy writes as oneOf; upstream publishes them as strings.
_SCALARS = {
    "io.k8s.apimachinery.pkg.api.resource.Quantity": {"type": "string"},
    "io.k8s.apimachinery.pkg.util.intstr.IntOrString": {"type": "string",
                                                        "format": "int-or-string"},
}
_SUBSCHEMA_KEYS = ("items", "additionalProperties")
_DROPPED_FOR_V2 = ("allOf", "oneOf", "anyOf", "not", "nullable")


def _swagger(s: Any) -> Any:
    """One JSON Schema (draft 2020-12) node of the upstream copy as Swagger 2.0."""
    if not isinstance(s, dict):
        return s
    out = dict(s)
    if "$ref" in out:
        out["$ref"] = out["$ref"].replace(_DEFS, _REF)
    if isinstance(out.get("type"), list):
        types = [t for t in out["type"] if t != "null"]
        if len(types) == 1:
            out["type"] = types[0]
        else:
            del out["type"]
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: _swagger(v) for k, v in out["properties"].items()}
    for key in _SUBSCHEMA_KEYS:
        if isinstance(out.get(key), dict):
            out[key] = _swagger(out[key])
    return out


@functools.cache
def upstream_definitions() -> dict[str, dict]:
    """Kubernetes 1.33's definitions by name, as Swagger 2.0 (shared: never modify them)."""
    raw = kv.schema_contents(BUILTIN_SCHEMAS, "1.33")["$defs"]
    defs = {}
    for name, s in raw.items():
        d = _SCALARS.get(name) or _swagger(s)
        if "x-kubernetes-group-version-kind" in d:
            # The copy pins apiVersion and kind with an enum; upstream does not.
            for prop in ("apiVersion", "kind"):
                if prop in d.get("properties", {}):
                    d["properties"][prop] = {
                        k: v for k, v in d["properties"][prop].items() if k != "enum"}
        defs[name] = d
    return defs


def _refs(s: Any) -> Iterable[str]:
    if isinstance(s, dict):
        if isinstance(s.get("$ref"), str) and s["$ref"].startswith(_REF):
            yield s["$ref"][len(_REF):]
        for v in s.values():
            yield from _refs(v)
    elif isinstance(s, list):
        for v in s:
            yield from _refs(v)


def _closure(roots: Iterable[str], known: dict[str, dict],
             extra: dict[str, dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in out or name in extra or name not in known:
            continue
        out[name] = known[name]
        todo.extend(_refs(known[name]))
    return out


def _gvks(d: dict) -> list[tuple[str, str, str]]:
    return [(g.get("group", ""), g.get("version", ""), g.get("kind", ""))
            for g in d.get("x-kubernetes-group-version-kind") or ()]


def definition_name(group: str, version: str, kind: str) -> str:
    """``bidirkv.io`` v1alpha1 ``X`` -> ``io.bidirkv.v1alpha1.X``, as kube-apiserver names a
    custom resource's definition."""
    return ".".join([*reversed(group.split(".")), version, kind])


def _v2_structural(s: Any) -> Any:
    """apiextensions-apiserver's v3 -> v2 conversion of a structural schema: value
    validations v2 cannot express are dropped; nullable and unknown-preserving nodes lose
    what kubectl would check too strictly (their type, or their properties and items); an
    array left without items loses its type (kubectl refuses item-less arrays)."""
    if not isinstance(s, dict):
        return s
    out = {k: v for k, v in s.items() if k not in _DROPPED_FOR_V2}
    if s.get("nullable"):
        for key in ("type", "items", "properties"):
            out.pop(key, None)
    if s.get("x-kubernetes-preserve-unknown-fields"):
        out.pop("items", None)
        out.pop("properties", None)
    if out.get("type") == "array" and "items" not in out:
        del out["type"]
    if isinstance(out.get("properties"), dict):
        props = out["properties"]
        nullable = {k for k, v in props.items() if isinstance(v, dict) and v.get("nullable")}
        if nullable and "required" in out:
            out["required"] = [r for r in out["required"] if r not in nullable]
        out["properties"] = {k: _v2_structural(v) for k, v in props.items()}
    for key in _SUBSCHEMA_KEYS:
        if isinstance(out.get(key), dict):
            out[key] = _v2_structural(out[key])
    return out


def crd_definitions(crd: dict) -> dict[str, dict]:
    """The definitions kube-apiserver publishes for each served version of `crd`."""
    spec = crd.get("spec") or {}
    group, kind = spec.get("group", ""), (spec.get("names") or {}).get("kind", "")
    list_kind = (spec.get("names") or {}).get("listKind") or f"{kind}List"
    upstream = upstream_definitions()
    out: dict[str, dict] = {}
    for ver in spec.get("versions") or ():
        if not ver.get("served", True):
            continue
        version = ver["name"]
        schema = ((ver.get("schema") or {}).get("openAPIV3Schema")) or {"type": "object"}
        d = _v2_structural(copy.deepcopy(schema))
        props = d.setdefault("properties", {})
        # Upstream's own wording of the common fields.
        deployment = upstream["io.k8s.api.apps.v1.Deployment"]["properties"]
        props["apiVersion"] = {"type": "string",
                               "description": deployment["apiVersion"]["description"]}
        props["kind"] = {"type": "string", "description": deployment["kind"]["description"]}
        props["metadata"] = {"$ref": f"{_REF}{_META}ObjectMeta",
                             "description": deployment["metadata"]["description"]}
        d["type"] = "object"
        gvk = {"group": group, "kind": kind, "version": version}
        d["x-kubernetes-group-version-kind"] = [gvk]
        out[definition_name(group, version, kind)] = d
        list_meta = upstream["io.k8s.api.apps.v1.DeploymentList"]["properties"]
        out[definition_name(group, version, list_kind)] = {
            "description": f"{list_kind} is a list of {kind}",
            "type": "object",
            "required": ["items"],
            "properties": {
                "apiVersion": props["apiVersion"],
                "items": {"type": "array",
                          "description": f"The {spec['names'].get('plural', kind)}.",
                          "items": {"$ref": _REF + definition_name(group, version, kind)}},
                "kind": props["kind"],
                "metadata": {"$ref": f"{_REF}{_META}ListMeta",
                             "description": list_meta["metadata"]["description"]},
            },
            "x-kubernetes-group-version-kind": [{**gvk, "kind": list_kind}],
        }
    return out


def _patch_path(rt: ResourceType) -> tuple[str, dict]:
    """The item path of `rt` with its PATCH operation, as kube-apiserver lists them."""
    prefix = f"/apis/{rt.group}/{rt.version}" if rt.group else f"/api/{rt.version}"
    scope = "/namespaces/{namespace}" if rt.namespaced else ""
    gvk = {"group": rt.group, "kind": rt.kind, "version": rt.version}
    # patchAppsV1NamespacedDeployment, patchBidirkvIoV1alpha1NamespacedDisaggregatedInference
    group = rt.group.removesuffix(".k8s.io") or "core"
    words = [*re.split(r"[.-]", group), rt.version]
    tag = "".join(w[:1].upper() + w[1:] for w in words)
    operation_id = f"patch{tag}{'Namespaced' if rt.namespaced else ''}{rt.kind}"
    ref = {"$ref": _REF + (definition_name(rt.group, rt.version, rt.kind) if rt.crd
                           else _builtin_name(rt))}

    def query(name: str, type_: str, description: str) -> dict:
        return {"name": name, "in": "query", "type": type_, "uniqueItems": True,
                "description": description}

    consumes = [JSON_PATCH, MERGE_PATCH, APPLY_PATCH]
    if rt.crd is None:
        consumes.insert(2, STRATEGIC_PATCH)
    patch = {
        "description": f"partially update the specified {rt.kind}",
        "consumes": consumes,
        "produces": ["application/json", "application/yaml"],
        "schemes": ["https"],
        "tags": [tag[:1].lower() + tag[1:]],
        "operationId": operation_id,
        "parameters": [
            {"name": "body", "in": "body", "required": True,
             "schema": {"$ref": f"{_REF}{_META}Patch"}},
            query("dryRun", "string", "All: validate and answer, store nothing."),
            query("fieldManager", "string", "Who makes the change (required by apply)."),
            query("force", "boolean", "Apply: take over fields other managers own."),
        ],
        "responses": {"200": {"description": "OK", "schema": ref},
                      "201": {"description": "Created", "schema": ref}},
        "x-kubernetes-action": "patch",
        "x-kubernetes-group-version-kind": gvk,
    }
    params = [{"name": "name", "in": "path", "required": True, "type": "string",
               "uniqueItems": True, "description": f"name of the {rt.kind}"}]
    if rt.namespaced:
        params.append({"name": "namespace", "in": "path", "required": True, "type": "string",
                       "uniqueItems": True, "description": "object name and auth scope"})
    return f"{prefix}{scope}/{rt.plural}/{{name}}", {"patch": patch, "parameters": params}


def _builtin_name(rt: ResourceType) -> str:
    gvk = (rt.group, rt.version, rt.kind)
    for name, d in upstream_definitions().items():
        if gvk in _gvks(d):
            return name
    raise KeyError(f"no upstream definition for {rt.api_version} {rt.kind}")


def document(types: Iterable[ResourceType], crds: Iterable[dict]) -> dict:
    """The Swagger 2.0 document for the resource `types` this server serves (built-in and
    custom) and the `crds` that define the custom ones."""
    types = list(types)
    upstream = upstream_definitions()
    served = {(rt.group, rt.version, rt.kind) for rt in types if rt.crd is None}
    custom: dict[str, dict] = {}
    for crd in crds:
        custom.update(crd_definitions(crd))
    roots = [name for name, d in upstream.items()
             if any(gvk in served for gvk in _gvks(d))]
    roots += [r for d in custom.values() for r in _refs(d)]
    roots += [f"{_META}Status", f"{_META}Patch"]
    definitions = {**_closure(roots, upstream, custom), **custom}
    paths = dict(_patch_path(rt) for rt in types
                 if rt.crd is None or definition_name(rt.group, rt.version, rt.kind) in custom)
    return {
        "swagger": "2.0",
        "info": {"title": "Kubernetes", "version": "v1.33.0"},
        "paths": dict(sorted(paths.items())),
        "definitions": dict(sorted(definitions.items())),
    }
