"""Custom-resource admission like the apiserver's: prune, default, validate, run CEL rules.

:func:`validate_custom_resource` is pure and usable from tests without a server::

    obj, errors = validate_custom_resource(crd, {"apiVersion": ..., "spec": {...}})
    assert [str(e) for e in errors] == ['spec.replicas: Invalid value: ...']

Order and semantics follow ``k8s.io/apiextensions-apiserver``:

1. prune unknown fields (``x-kubernetes-preserve-unknown-fields``, ``additionalProperties``,
   ``x-kubernetes-embedded-resource``; ``metadata`` keeps only ObjectMeta fields);
2. apply ``default`` top-down, so defaults inside an object defaulted to ``{}`` apply too;
   ``null`` on a non-nullable field is defaulted or dropped;
3. OpenAPI v3 validation (types, ``nullable``, ``enum``, numeric bounds, ``multipleOf``, string
   lengths, ``pattern``, simple ``format`` s, item counts, ``uniqueItems``, ``required``,
   property counts, ``allOf``/``anyOf``/``oneOf``/``not``, ``x-kubernetes-int-or-string``,
   ``x-kubernetes-list-type: set|map`` uniqueness);
4. ``x-kubernetes-validations`` (CEL) at every node where declared, ``self`` bound to that node;
   transition rules (those mentioning ``oldSelf``) only on update and only where the old value
   correlates (object properties, map values, ``list-type: map`` items). As in the apiserver, CEL
   rules are skipped when a "blocking" schema error (type, required, enum, too long, too many)
   exists, and a ``<nil>: ... some validation rules were not checked ...`` error is added.

Not modelled: validation ratcheting of unchanged invalid fields, CEL cost limits, conversion
webhooks, ``x-kubernetes-map-type``, and the rules listed in :mod:`kubeapi.crdcel`.
"""

from __future__ import annotations

import base64
import copy
import ipaddress
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import celpy.celtypes as ct

from kubeapi import crdcel
from kubeapi.patch import json_equal

__all__ = ["FieldError", "validate_custom_resource", "validate_crd", "crd_version"]

log = logging.getLogger(__name__)

OBJECT_META_FIELDS = frozenset({
    "name", "generateName", "namespace", "selfLink", "uid", "resourceVersion", "generation",
    "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "labels",
    "annotations", "ownerReferences", "finalizers", "managedFields",
})
_NO_VALUE = object()
_TYPE_LABELS = {
    "FieldValueRequired": "Required value", "FieldValueForbidden": "Forbidden",
    "FieldValueTooLong": "Too long", "FieldValueTooMany": "Too many",
    "FieldValueNotSupported": "Unsupported value", "FieldValueDuplicate": "Duplicate value",
    "FieldValueNotFound": "Not found", "FieldValueInvalid": "Invalid value",
    "FieldValueTypeInvalid": "Invalid value", "InternalError": "Internal error",
}
_VALUELESS = {"FieldValueRequired", "FieldValueForbidden", "FieldValueTooLong", "InternalError"}
_BLOCKING = {"FieldValueNotSupported", "FieldValueRequired", "FieldValueTooLong",
             "FieldValueTooMany", "FieldValueTypeInvalid"}


def _render(value: Any) -> str:
    if value is None:
        return '"null"'
    return json.dumps(value, separators=(",", ":"), default=str)


@dataclass(frozen=True)
class FieldError:
    """One ``field.Error``: ``str(err)`` is the apiserver's ``spec.a: Invalid value: 1: detail``."""

    field: str
    type: str = "FieldValueInvalid"
    detail: str = ""
    value: Any = _NO_VALUE

    @property
    def field_path(self) -> str:
        return self.field or "<nil>"

    def message(self) -> str:
        body = _TYPE_LABELS.get(self.type, self.type)
        if self.type not in _VALUELESS and self.value is not _NO_VALUE:
            body += f": {_render(self.value)}"
        if self.detail:
            body += f": {self.detail}"
        return body

    def __str__(self) -> str:
        return f"{self.field_path}: {self.message()}"

    def cause(self) -> dict:
        return {"reason": self.type, "message": self.message(), "field": self.field_path}


def _child(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def crd_version(crd: dict, api_version: str | None = None) -> dict | None:
    """The CRD version an object's ``apiVersion`` names, else the storage version."""
    spec = crd.get("spec") or {}
    versions = spec.get("versions") or []
    if api_version:
        wanted = api_version.rpartition("/")[2]
        for ver in versions:
            if ver.get("name") == wanted:
                return ver
    return next((v for v in versions if v.get("storage")), versions[0] if versions else None)


def _schema_of(version: dict | None) -> dict:
    schema = ((version or {}).get("schema") or {}).get("openAPIV3Schema")
    return schema or {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


# Pruning ------------------------------------------------------------------------------------

def _coerce_scalar(value: Any, schema: dict) -> Any:
    # Go decodes 3.0 to the same number as 3; integer fields must stay ints (CEL int, not double).
    integral = isinstance(value, float) and value.is_integer()
    if integral and (schema.get("type") == "integer" or schema.get("x-kubernetes-int-or-string")):
        return int(value)
    return value


def _prune(value: Any, schema: dict | None) -> Any:
    if schema is None:
        return value
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        keep_unknown = schema.get("x-kubernetes-preserve-unknown-fields") or extra is True
        embedded = schema.get("x-kubernetes-embedded-resource")
        out = {}
        for key, item in value.items():
            if key in props:
                out[key] = _prune(item, props[key])
            elif isinstance(extra, dict):
                out[key] = _prune(item, extra)
            elif embedded and key in ("apiVersion", "kind"):
                out[key] = item
            elif embedded and key == "metadata" and isinstance(item, dict):
                out[key] = {k: v for k, v in item.items() if k in OBJECT_META_FIELDS}
            elif keep_unknown:
                out[key] = item
        return out
    if isinstance(value, list):
        items = schema.get("items")
        return [_prune(v, items) for v in value] if isinstance(items, dict) else value
    return _coerce_scalar(value, schema)


def _prune_root(obj: dict, schema: dict) -> dict:
    out = {k: obj[k] for k in ("apiVersion", "kind") if k in obj}
    if isinstance(obj.get("metadata"), dict):
        out["metadata"] = {k: v for k, v in obj["metadata"].items() if k in OBJECT_META_FIELDS}
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    out.update(_prune(body, schema))
    return out


# Defaulting ---------------------------------------------------------------------------------

def _default(value: Any, schema: dict | None, *, root: bool = False) -> None:
    if not schema:
        return
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for key, sub in props.items():
            if root and key in ("apiVersion", "kind", "metadata"):
                continue
            present = key in value
            if present and value[key] is not None:
                continue
            if present and sub.get("nullable"):
                continue
            if "default" in sub:
                value[key] = _prune(copy.deepcopy(sub["default"]), sub)
            elif present:
                del value[key]
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if root and key == "metadata":
                continue
            if key in props:
                _default(item, props[key])
            elif isinstance(extra, dict):
                _default(item, extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default(item, schema["items"])


# OpenAPI validation -------------------------------------------------------------------------

def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _type_ok(value: Any, kind: str) -> bool:
    actual = _json_type(value)
    return actual == kind or (kind == "number" and actual == "integer")


_DATE_TIME = re.compile(
    r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_DURATION = re.compile(r"^[-+]?((\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h|d|w))+$|^0$")
_UUID = re.compile(r"^[0-9a-fA-F]{8}-([0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}$")
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?)*$")
_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")


def _format_ok(value: Any, fmt: str) -> bool:
    checks = {
        "date-time": lambda v: bool(_DATE_TIME.match(v)),
        "datetime": lambda v: bool(_DATE_TIME.match(v)),
        "date": lambda v: bool(_DATE.match(v)),
        "duration": lambda v: bool(_DURATION.match(v)),
        "uuid": lambda v: bool(_UUID.match(v)),
        "hostname": lambda v: bool(_HOSTNAME.match(v)),
        "email": lambda v: bool(_EMAIL.match(v)),
        "ipv4": lambda v: isinstance(ipaddress.ip_address(v), ipaddress.IPv4Address),
        "ipv6": lambda v: isinstance(ipaddress.ip_address(v), ipaddress.IPv6Address),
        "cidr": lambda v: bool(ipaddress.ip_network(v, strict=False)),
        "byte": lambda v: bool(base64.b64decode(v, validate=True) or True),
    }
    if fmt in ("int32", "int64") and isinstance(value, int):
        bits = 31 if fmt == "int32" else 63
        return -(2 ** bits) <= value < 2 ** bits
    check = checks.get(fmt)
    if check is None or not isinstance(value, str):
        return True
    try:
        return check(value)
    except ValueError:
        return False


def _validate(value: Any, schema: dict, path: str, errors: list[FieldError]) -> None:
    shown = path or "<nil>"
    if value is None:
        if not schema.get("nullable") and schema.get("type"):
            errors.append(FieldError(path, "FieldValueTypeInvalid",
                                     f'{shown} in body must be of type {schema["type"]}: "null"',
                                     "null"))
        return
    kind = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        if _json_type(value) not in ("integer", "string"):
            actual = _json_type(value)
            errors.append(FieldError(path, "FieldValueTypeInvalid",
                                     f'{shown} in body must be of type integer,string: '
                                     f'"{actual}"', actual))
            return
    elif kind and not _type_ok(value, kind):
        actual = _json_type(value)
        errors.append(FieldError(path, "FieldValueTypeInvalid",
                                 f'{shown} in body must be of type {kind}: "{actual}"', actual))
        return

    if "enum" in schema and not any(json_equal(value, e) for e in schema["enum"]):
        supported = ", ".join(_render(e) for e in schema["enum"])
        errors.append(FieldError(path, "FieldValueNotSupported",
                                 f"supported values: {supported}", value))
    if isinstance(value, int | float) and not isinstance(value, bool):
        _validate_number(value, schema, path, errors)
    if isinstance(value, str):
        _validate_string(value, schema, path, errors)
    if isinstance(value, list):
        _validate_array(value, schema, path, errors)
    if isinstance(value, dict):
        _validate_object(value, schema, path, errors)
    if "format" in schema and not _format_ok(value, schema["format"]):
        errors.append(FieldError(path, "FieldValueInvalid",
                                 f'{shown} in body must be of type {schema["format"]}: '
                                 f'{_render(value)}', value))
    _validate_combinators(value, schema, path, errors)


def _validate_number(value: float, schema: dict, path: str, errors: list[FieldError]) -> None:
    shown = path or "<nil>"
    if "maximum" in schema:
        limit = schema["maximum"]
        if schema.get("exclusiveMaximum") and value >= limit:
            errors.append(FieldError(path, detail=f"{shown} in body should be less than {limit}",
                                     value=value))
        elif value > limit:
            errors.append(FieldError(
                path, detail=f"{shown} in body should be less than or equal to {limit}",
                value=value))
    if "minimum" in schema:
        limit = schema["minimum"]
        if schema.get("exclusiveMinimum") and value <= limit:
            errors.append(FieldError(
                path, detail=f"{shown} in body should be greater than {limit}", value=value))
        elif value < limit:
            errors.append(FieldError(
                path, detail=f"{shown} in body should be greater than or equal to {limit}",
                value=value))
    if schema.get("multipleOf"):
        ratio = value / schema["multipleOf"]
        if abs(ratio - round(ratio)) > 1e-9:
            errors.append(FieldError(
                path, detail=f"{shown} in body should be a multiple of {schema['multipleOf']}",
                value=value))


def _validate_string(value: str, schema: dict, path: str, errors: list[FieldError]) -> None:
    shown = path or "<nil>"
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        errors.append(FieldError(path, "FieldValueTooLong",
                                 f"may not be more than {schema['maxLength']} bytes", value))
    if "minLength" in schema and len(value) < schema["minLength"]:
        errors.append(FieldError(
            path, detail=f"{shown} in body should be at least {schema['minLength']} chars long",
            value=value))
    if "pattern" in schema:
        try:
            matched = re.search(schema["pattern"], value) is not None
        except re.error:
            matched = True  # Go's RE2 syntax that Python cannot compile: do not guess
        if not matched:
            errors.append(FieldError(
                path, detail=f"{shown} in body should match '{schema['pattern']}'", value=value))


def _validate_array(value: list, schema: dict, path: str, errors: list[FieldError]) -> None:
    shown = path or "<nil>"
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        errors.append(FieldError(path, "FieldValueTooMany",
                                 f"must have at most {schema['maxItems']} items", len(value)))
    if "minItems" in schema and len(value) < schema["minItems"]:
        errors.append(FieldError(
            path, detail=f"{shown} in body should have at least {schema['minItems']} items",
            value=len(value)))
    list_type = schema.get("x-kubernetes-list-type")
    if schema.get("uniqueItems") or list_type in ("set", "map"):
        keys = schema.get("x-kubernetes-list-map-keys") or []
        seen: list = []
        for i, item in enumerate(value):
            ident = ({k: item.get(k) for k in keys} if list_type == "map"
                     and isinstance(item, dict) else item)
            if any(json_equal(ident, s) for s in seen):
                if list_type:
                    errors.append(FieldError(f"{path}[{i}]", "FieldValueDuplicate", value=ident))
                else:
                    errors.append(FieldError(
                        path, detail=f"{shown} in body shouldn't contain duplicates", value=value))
                    break
            seen.append(ident)
    items = schema.get("items")
    if isinstance(items, dict):
        for i, item in enumerate(value):
            _validate(item, items, f"{path}[{i}]", errors)


def _validate_object(value: dict, schema: dict, path: str, errors: list[FieldError]) -> None:
    shown = path or "<nil>"
    for key in schema.get("required") or []:
        if key not in value:
            errors.append(FieldError(_child(path, key), "FieldValueRequired"))
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        errors.append(FieldError(path, "FieldValueTooMany",
                                 f"must have at most {schema['maxProperties']} items",
                                 len(value)))
    if "minProperties" in schema and len(value) < schema["minProperties"]:
        errors.append(FieldError(
            path, detail=f"{shown} in body should have at least "
                         f"{schema['minProperties']} properties", value=len(value)))
    props = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    for key, item in value.items():
        if not path and key in ("apiVersion", "kind", "metadata"):
            continue
        if key in props:
            _validate(item, props[key], _child(path, key), errors)
        elif isinstance(extra, dict):
            _validate(item, extra, f"{path}[{key}]" if path else key, errors)


def _validate_combinators(value: Any, schema: dict, path: str, errors: list[FieldError]) -> None:
    def ok(sub: dict) -> bool:
        found: list[FieldError] = []
        _validate(value, sub, path, found)
        return not found

    shown = path or "<nil>"
    for sub in schema.get("allOf") or []:
        _validate(value, sub, path, errors)
    if schema.get("anyOf") and not any(ok(s) for s in schema["anyOf"]):
        errors.append(FieldError(path, detail=f"{shown} in body must validate at least one "
                                              "schema (anyOf)", value=value))
    if schema.get("oneOf") and sum(ok(s) for s in schema["oneOf"]) != 1:
        errors.append(FieldError(path, detail=f"{shown} in body must validate one and only one "
                                              "schema (oneOf)", value=value))
    if isinstance(schema.get("not"), dict) and ok(schema["not"]):
        errors.append(FieldError(path, detail=f"{shown} in body must not validate the schema "
                                              "(not)", value=value))


# CEL ----------------------------------------------------------------------------------------

_RULE_REASONS = {"FieldValueInvalid", "FieldValueForbidden", "FieldValueRequired",
                 "FieldValueDuplicate"}


def _join_field_path(path: str, field_path: str | None) -> str:
    if not field_path:
        return path
    if field_path.startswith("["):
        return path + field_path.replace("'", "")
    return _child(path, field_path.lstrip(".")) if path else field_path.lstrip(".")


def _rule_message(rule: dict, self_cel: Any, old_cel: Any) -> str:
    message = rule.get("message") or f"failed rule: {rule.get('rule', '')}"
    expression = rule.get("messageExpression")
    if expression:
        try:
            result = crdcel.evaluate(expression, {"self": self_cel, "oldSelf": old_cel})
        except crdcel.CelError:
            return message
        if isinstance(result, str) and result.strip() and "\n" not in result:
            return str(result)
    return message


def _run_rules(value: Any, schema: dict, path: str, old: Any, has_old: bool,
               errors: list[FieldError], strict: bool) -> None:
    label = schema.get("type") or "object"
    self_cel = crdcel.to_cel(value, schema)
    old_cel = crdcel.to_cel(old, schema) if has_old else None
    for rule in schema.get("x-kubernetes-validations") or []:
        expr = rule.get("rule", "")
        transition = crdcel.uses_old_self(expr)
        if transition and not has_old:
            continue
        activation = {"self": self_cel}
        if transition:
            activation["oldSelf"] = old_cel
        try:
            result = crdcel.evaluate(expr, activation)
        except crdcel.CelUnsupported as exc:
            if strict:
                errors.append(FieldError(path, detail=f"{exc} evaluating rule: {expr}",
                                         value=label))
            else:
                log.warning("skipping CEL rule %r at %s: %s", expr, path or "<root>", exc)
            continue
        except crdcel.CelError as exc:
            errors.append(FieldError(path, detail=f"{exc} evaluating rule: {expr}", value=label))
            continue
        if isinstance(result, ct.BoolType) and bool(result):
            continue
        if not isinstance(result, ct.BoolType):
            errors.append(FieldError(path, detail=f"rule did not evaluate to a bool: {expr}",
                                     value=label))
            continue
        reason = rule.get("reason") if rule.get("reason") in _RULE_REASONS else \
            "FieldValueInvalid"
        field = _join_field_path(path, rule.get("fieldPath"))
        message = _rule_message(rule, self_cel, old_cel)
        if reason == "FieldValueDuplicate":
            errors.append(FieldError(field, reason, value=message))
        else:
            errors.append(FieldError(field, reason, message, label))


def _cel_walk(value: Any, schema: dict, path: str, old: Any, has_old: bool,
              errors: list[FieldError], strict: bool) -> None:
    if value is None or not isinstance(schema, dict):
        return
    if schema.get("x-kubernetes-validations"):
        _run_rules(value, schema, path, old, has_old, errors, strict)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key)
            child = _child(path, key)
            if sub is None and isinstance(extra, dict):
                sub, child = extra, (f"{path}[{key}]" if path else key)
            if sub is None or (not path and key == "metadata"):
                continue
            old_has = has_old and isinstance(old, dict) and key in old
            _cel_walk(item, sub, child, old.get(key) if old_has else None, old_has, errors,
                      strict)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        keys = schema.get("x-kubernetes-list-map-keys") or []
        old_items: dict = {}
        if has_old and isinstance(old, list) and schema.get("x-kubernetes-list-type") == "map":
            old_items = {json.dumps([o.get(k) for k in keys]): o
                         for o in old if isinstance(o, dict)}
        for i, item in enumerate(value):
            ident = json.dumps([item.get(k) for k in keys]) if isinstance(item, dict) else None
            old_item = old_items.get(ident) if ident is not None else None
            _cel_walk(item, schema["items"], f"{path}[{i}]", old_item, old_item is not None,
                      errors, strict)


# Entry points -------------------------------------------------------------------------------

def validate_custom_resource(
    crd: dict, obj: dict, old: dict | None = None, *, strict_cel: bool = False,
) -> tuple[dict, list[FieldError]]:
    """Prune + default ``obj`` with the schema of the CRD version its ``apiVersion`` names
    (storage version if none) and return it with all validation errors.

    ``old`` is the stored object on update (enables transition rules). ``strict_cel`` turns
    rules that use unsupported CEL functions into errors instead of skipping them."""
    schema = _schema_of(crd_version(crd, obj.get("apiVersion")))
    out = _prune_root(copy.deepcopy(obj), schema)
    _default(out, schema, root=True)
    errors: list[FieldError] = []
    _validate(out, schema, "", errors)
    if any(e.type in _BLOCKING for e in errors):
        errors.append(FieldError(
            "", detail="some validation rules were not checked because the object was invalid; "
                       "correct the existing errors to complete validation", value=None))
    else:
        _cel_walk(out, schema, "", old, old is not None, errors, strict_cel)
    return out, errors


def _walk_rules(schema: Any, path: str, out: list[tuple[str, dict]]) -> None:
    if not isinstance(schema, dict):
        return
    for i, rule in enumerate(schema.get("x-kubernetes-validations") or []):
        out.append((f"{path}.x-kubernetes-validations[{i}]", rule))
    for key, sub in (schema.get("properties") or {}).items():
        _walk_rules(sub, f"{path}.properties[{key}]", out)
    for key in ("items", "additionalProperties"):
        _walk_rules(schema.get(key), f"{path}.{key}", out)


def validate_crd(crd: dict) -> list[FieldError]:
    """The checks the apiserver does on a CustomResourceDefinition that matter in tests:
    naming, scope, versions/storage, presence of schemas, and that CEL rules compile."""
    errors: list[FieldError] = []
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group = spec.get("group") or ""
    if not group:
        errors.append(FieldError("spec.group", "FieldValueRequired"))
    for key in ("plural", "kind"):
        if not names.get(key):
            errors.append(FieldError(f"spec.names.{key}", "FieldValueRequired"))
    name = (crd.get("metadata") or {}).get("name")
    if names.get("plural") and group and name != f"{names['plural']}.{group}":
        errors.append(FieldError("metadata.name", detail='must be spec.names.plural+"."+'
                                                         "spec.group", value=name))
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        errors.append(FieldError("spec.scope", "FieldValueNotSupported",
                                 'supported values: "Cluster", "Namespaced"', spec.get("scope")))
    versions = spec.get("versions") or []
    if not versions:
        errors.append(FieldError("spec.versions", "FieldValueInvalid",
                                 "must have exactly one version marked as storage version", []))
    elif sum(bool(v.get("storage")) for v in versions) != 1:
        errors.append(FieldError("spec.versions", "FieldValueInvalid",
                                 "must have exactly one version marked as storage version",
                                 [v.get("name") for v in versions]))
    for i, ver in enumerate(versions):
        base = f"spec.versions[{i}].schema.openAPIV3Schema"
        schema = (ver.get("schema") or {}).get("openAPIV3Schema")
        if schema is None:
            errors.append(FieldError(base, "FieldValueRequired", "schemas are required"))
            continue
        rules: list[tuple[str, dict]] = []
        _walk_rules(schema, base, rules)
        for rule_path, rule in rules:
            for key in ("rule", "messageExpression"):
                if not rule.get(key):
                    continue
                try:
                    crdcel.compile_rule(rule[key])
                except crdcel.CelError as exc:
                    errors.append(FieldError(f"{rule_path}.{key}", detail=str(exc),
                                             value=rule[key]))
    return errors
