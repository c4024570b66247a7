"""Admission checks and defaults the apiserver applies to every object, independent of the
store's state: object-meta validation, built-in defaults, status on create, CRD status."""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable
from typing import Any

from kubeapi.crdschema import FieldError
from kubeapi.defaults import apply_defaults
from kubeapi.errors import bad_request
from kubeapi.resources import NAMESPACES_KEY, ResourceType

_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUALIFIED = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
    "'.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used "
    r"for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
_LABEL_1123_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and "
    "must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex "
    "used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')")
_LABEL_1035_MSG = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
    "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or "
    "'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')")
_LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or "
    "'.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or "
    "'my_value',  or '12345', regex used for validation is "
    "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")
_QUALIFIED_MSG = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and "
    "end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex "
    "used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")
GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
# Set by the server on create; clients' values are dropped.
SERVER_META = ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds",
               "generation", "selfLink", "managedFields", "resourceVersion")
# Kept from the stored object on update whatever the client sends.
IMMUTABLE_META = ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds",
                  "namespace", "name", "generation", "selfLink")


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def name_error(rt: ResourceType, name: str) -> str | None:
    if rt.group == "rbac.authorization.k8s.io":
        bad = name in (".", "..") or "/" in name or "%" in name
        return None if not bad else "may not contain '/' or '%' and may not be '.' or '..'"
    if rt.key == NAMESPACES_KEY:
        ok, msg, limit = _LABEL_1123.match(name), _LABEL_1123_MSG, 63
    elif rt.key == ("", "services"):
        ok, msg, limit = _LABEL_1035.match(name), _LABEL_1035_MSG, 63
    else:
        ok, msg, limit = _SUBDOMAIN.match(name), _SUBDOMAIN_MSG, 253
    if len(name) > limit:
        return f"must be no more than {limit} characters"
    return None if ok else msg


def qualified_name_error(key: str) -> str | None:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _SUBDOMAIN.match(prefix)):
        return "prefix part " + _SUBDOMAIN_MSG
    if not name or len(name) > 63 or not _QUALIFIED.match(name):
        return _QUALIFIED_MSG if name and len(name) <= 63 else "name part must be non-empty " \
            "and no more than 63 characters"
    return None


def check_kind(rt: ResourceType, body: Any) -> dict:
    """Decoding-level checks (400 BadRequest): a body for another kind, or ObjectMeta fields of
    the wrong JSON type, never reach validation on a real apiserver."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    api_version, kind = body.get("apiVersion"), body.get("kind")
    if api_version and api_version != rt.api_version:
        raise bad_request(f"the API version in the data ({api_version}) does not match the "
                          f"expected API version ({rt.api_version})")
    if kind and kind != rt.kind:
        raise bad_request(f"the kind in the data ({kind}) does not match the expected kind "
                          f"({rt.kind})")
    meta = body.get("metadata", {})
    if not isinstance(meta, dict):
        raise bad_request("metadata must be an object")
    for field in ("labels", "annotations"):
        value = meta.get(field)
        if value is not None and (not isinstance(value, dict) or not all(
                isinstance(v, str) for v in value.values())):
            raise bad_request(f"json: cannot unmarshal into Go struct field "
                              f"ObjectMeta.metadata.{field} of type map[string]string")
    return body


def metadata_errors(rt: ResourceType, obj: dict, old: dict | None) -> list[FieldError]:
    meta = obj["metadata"]
    errors = []
    if old is None and (why := name_error(rt, meta.get("name", ""))):
        errors.append(FieldError("metadata.name", detail=why, value=meta.get("name")))
    for key, value in (meta.get("labels") or {}).items():
        if why := qualified_name_error(key):
            errors.append(FieldError("metadata.labels", detail=why, value=key))
        if len(value) > 63:
            errors.append(FieldError("metadata.labels", detail="must be no more than 63 "
                                                               "characters", value=value))
        elif not _LABEL_VALUE.match(value):
            errors.append(FieldError("metadata.labels", detail=_LABEL_VALUE_MSG,
                                     value=value))
    for key in meta.get("annotations") or {}:
        if why := qualified_name_error(key.lower()):
            errors.append(FieldError("metadata.annotations", detail=why, value=key))
    finalizers = meta.get("finalizers") or []
    if not isinstance(finalizers, list) or not all(isinstance(f, str) for f in finalizers):
        errors.append(FieldError("metadata.finalizers", detail="must be a list of strings",
                                 value=finalizers))
    elif old is not None and (old.get("metadata") or {}).get("deletionTimestamp"):
        added = [f for f in finalizers if f not in old["metadata"].get("finalizers") or []]
        if added:
            errors.append(FieldError(
                "metadata.finalizers", "FieldValueForbidden",
                f"no new finalizers can be added if the object is being deleted, found new "
                f"finalizers {json.dumps(added)}"))
    for i, ref in enumerate(meta.get("ownerReferences") or []):
        for field in ("apiVersion", "kind", "name", "uid"):
            if not isinstance(ref, dict) or not ref.get(field):
                errors.append(FieldError(f"metadata.ownerReferences[{i}].{field}",
                                         detail=f"{field} must not be empty", value=""))
    return errors


def builtin_defaults(rt: ResourceType, obj: dict, old: dict | None,
                     allocate_ip: Callable[[], str]) -> None:
    """Built-in defaults: replicas for scale, service IPs/ports, the namespace name label, and
    for the kinds the operator writes what defaults.py models (defaults, canonical
    quantities, dropped empty values)."""
    if rt.key == NAMESPACES_KEY:
        labels = obj["metadata"].setdefault("labels", {})
        labels["kubernetes.io/metadata.name"] = obj["metadata"]["name"]
    spec = obj.get("spec")
    old_ip = (old.get("spec") or {}).get("clusterIP") if old else None
    if old_ip and isinstance(spec, dict):
        spec.setdefault("clusterIP", old_ip)  # immutable once allocated
    if rt.scale and rt.scale.builtin_selector and isinstance(spec, dict):
        spec.setdefault("replicas", 1)
    if rt.key == ("", "services") and isinstance(spec, dict):
        spec.setdefault("type", "ClusterIP")
        if spec["type"] != "ExternalName" and "clusterIP" not in spec:
            spec["clusterIP"] = allocate_ip()
        if spec.get("clusterIP"):
            spec.setdefault("clusterIPs", [spec["clusterIP"]])
        spec.setdefault("sessionAffinity", "None")
        for port in spec.get("ports") or []:
            if isinstance(port, dict):
                port.setdefault("protocol", "TCP")
                port.setdefault("targetPort", port.get("port"))
        spec.setdefault("ipFamilies", ["IPv4"])
        spec.setdefault("ipFamilyPolicy", "SingleStack")
        spec.setdefault("internalTrafficPolicy", "Cluster")
    apply_defaults(rt.key, obj)


def prepare_create_status(rt: ResourceType, obj: dict) -> None:
    # Status is the controllers' business: the apiserver drops it on create where the
    # resource has a status subresource (nodes are the classic exception).
    if rt.key == NAMESPACES_KEY:
        obj["status"] = {"phase": "Active"}
    elif rt.key == ("", "pods"):
        obj["status"] = {"phase": "Pending"}
    elif rt.status and rt.key != ("", "nodes"):
        obj.pop("status", None)


def crd_status(crd: dict, old_status: dict | None, clash: bool) -> dict:
    """Status as the CRD controllers would set it: names accepted, established, stored versions."""
    spec = crd.get("spec") or {}
    names = dict(spec.get("names") or {})
    names.setdefault("singular", names.get("kind", "").lower())
    names.setdefault("listKind", f"{names.get('kind', '')}List")
    storage = [v["name"] for v in spec.get("versions") or [] if v.get("storage")]
    stored = list((old_status or {}).get("storedVersions") or [])
    stored += [v for v in storage if v not in stored]
    old_conditions = {c.get("type"): c for c in (old_status or {}).get("conditions") or []}

    def condition(kind: str, ok: bool, reason: str, message: str) -> dict:
        status = "True" if ok else "False"
        prev = old_conditions.get(kind)
        since = prev["lastTransitionTime"] if prev and prev.get("status") == status \
            else now_rfc3339()
        return {"type": kind, "status": status, "lastTransitionTime": since,
                "reason": reason, "message": message}

    return {
        "conditions": [
            condition("NamesAccepted", not clash, "NoConflicts" if not clash else
                      "PluralConflict", "no conflicts found" if not clash else
                      f'"{names.get("plural")}" is already in use'),
            condition("Established", not clash, "InitialNamesAccepted" if not clash else
                      "NotAccepted", "the initial names have been accepted"),
        ],
        "acceptedNames": names if not clash else {"plural": "", "kind": ""},
        "storedVersions": stored,
    }
