"""The patch formats the apiserver accepts: JSON merge patch (RFC 7386), JSON patch (RFC 6902)
and an approximation of Kubernetes strategic merge patch.

Strategic merge approximation: the real merge keys come from Go struct tags per type. Here they
are looked up by field name (and, for ``ports``, by the parent field), which covers the common
pod/workload/service shapes:

* ``containers``/``initContainers``/``ephemeralContainers``/``volumes``/``env``/
  ``imagePullSecrets``/``resourceClaims`` merge by ``name``; ``volumeMounts`` by ``mountPath``;
  ``volumeDevices`` by ``devicePath``; ``ports`` by ``containerPort`` inside containers and by
  ``port`` elsewhere (services); ``conditions`` by ``type``; ``ownerReferences`` by ``uid``;
  ``hostAliases`` by ``ip``; ``topologySpreadConstraints`` by ``topologyKey``.
* ``metadata.finalizers`` merges as a set of strings.
* every other list (``tolerations``, ``args``, ``command``, ``envFrom``, RBAC rules...) is replaced.
* directives: ``$patch: replace|delete`` (maps and list items), ``$deleteFromPrimitiveList/<f>``,
  ``$setElementOrder/<f>`` and ``$retainKeys``; ``null`` deletes a key.
"""

from __future__ import annotations

import copy
from typing import Any

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"


class PatchError(Exception):
    """``code`` is the HTTP status the apiserver uses: 400 malformed, 422 cannot apply."""

    def __init__(self, message: str, code: int = 422) -> None:
        super().__init__(message)
        self.code = code


def json_equal(a: Any, b: Any) -> bool:
    """JSON equality: unlike ``==``, ``true`` is not ``1``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


# RFC 7386 -----------------------------------------------------------------------------------

def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# RFC 6902 -----------------------------------------------------------------------------------

def _pointer(path: Any) -> list[str]:
    if not isinstance(path, str) or (path and not path.startswith("/")):
        raise PatchError(f"invalid JSON pointer: {path!r}")
    if path == "":
        return []
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _index(container: list, token: str, *, for_add: bool = False) -> int:
    if for_add and token == "-":
        return len(container)
    if not token.isdigit() or (token != "0" and token.startswith("0")):
        raise PatchError(f"invalid array index: {token!r}")
    idx = int(token)
    if idx > len(container) or (idx == len(container) and not for_add):
        raise PatchError(f"array index out of bounds: {idx}")
    return idx


def _walk(doc: Any, parts: list[str]) -> Any:
    cur = doc
    for part in parts:
        if isinstance(cur, dict):
            if part not in cur:
                raise PatchError(f"missing path: /{'/'.join(parts)}")
            cur = cur[part]
        elif isinstance(cur, list):
            cur = cur[_index(cur, part)]
        else:
            raise PatchError(f"missing path: /{'/'.join(parts)}")
    return cur


def _add(doc: Any, parts: list[str], value: Any) -> Any:
    if not parts:
        return value
    parent = _walk(doc, parts[:-1])
    last = parts[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, for_add=True), value)
    else:
        raise PatchError(f"cannot add to a scalar at /{'/'.join(parts[:-1])}")
    return doc


def _remove(doc: Any, parts: list[str]) -> Any:
    if not parts:
        raise PatchError("cannot remove the document root")
    parent = _walk(doc, parts[:-1])
    last = parts[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"unable to remove nonexistent key: {last}: missing value")
        return parent.pop(last)
    if isinstance(parent, list):
        return parent.pop(_index(parent, last))
    raise PatchError(f"missing path: /{'/'.join(parts)}")


def json_patch(doc: Any, ops: Any) -> Any:
    if not isinstance(ops, list):
        raise PatchError("json patch must be a list of operations", code=400)
    doc = copy.deepcopy(doc)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"invalid operation: {op!r}")
        kind, parts = op["op"], _pointer(op["path"])
        if kind in ("add", "replace", "test") and "value" not in op:
            raise PatchError(f"missing value for {kind} operation")
        if kind == "add":
            doc = _add(doc, parts, copy.deepcopy(op["value"]))
        elif kind == "remove":
            _remove(doc, parts)
        elif kind == "replace":
            _walk(doc, parts)  # must exist
            if parts:
                _remove(doc, parts)
            doc = _add(doc, parts, copy.deepcopy(op["value"]))
        elif kind in ("move", "copy"):
            src = _pointer(op.get("from"))
            value = copy.deepcopy(_walk(doc, src))
            if kind == "move":
                if parts[: len(src)] == src and len(parts) > len(src):
                    raise PatchError("cannot move a value into one of its children")
                _remove(doc, src)
            doc = _add(doc, parts, value)
        elif kind == "test":
            try:
                ok = json_equal(_walk(doc, parts), op["value"])
            except PatchError:
                ok = False
            if not ok:
                raise PatchError(f"testing value {op['path']} failed: test failed")
        else:
            raise PatchError(f"unexpected kind of operation: {kind!r}")
    return doc


# Strategic merge patch ----------------------------------------------------------------------

_MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "volumes": "name", "env": "name", "imagePullSecrets": "name", "resourceClaims": "name",
    "volumeMounts": "mountPath", "volumeDevices": "devicePath", "conditions": "type",
    "ownerReferences": "uid", "hostAliases": "ip", "topologySpreadConstraints": "topologyKey",
}
_CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")
_DELETE = object()


def _merge_key(path: tuple[str, ...]) -> str | None:
    field = path[-1]
    if field == "ports":
        return "containerPort" if len(path) > 1 and path[-2] in _CONTAINER_LISTS else "port"
    return _MERGE_KEYS.get(field)


def _strip_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_directives(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return value


def _smp_map(orig: dict, patch: dict, path: tuple[str, ...]) -> Any:
    patch = dict(patch)
    directive = patch.pop("$patch", None)
    if directive == "replace":
        return _strip_directives(patch)
    if directive == "delete":
        return _DELETE
    if directive is not None:
        raise PatchError(f"unknown patch directive: {directive!r}", code=400)
    retain = patch.pop("$retainKeys", None)
    orders = {}
    result = copy.deepcopy(orig)
    for key in [k for k in patch if k.startswith("$")]:
        value = patch.pop(key)
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            result[field] = [x for x in result.get(field) or [] if x not in value]
        elif key.startswith("$setElementOrder/"):
            orders[key.split("/", 1)[1]] = value
    for key, value in patch.items():
        current = result.get(key)
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            merged = _smp_map(current if isinstance(current, dict) else {}, value, (*path, key))
            if merged is _DELETE:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list):
            result[key] = _smp_list(current if isinstance(current, list) else [], value,
                                    (*path, key))
        else:
            result[key] = value
    for field, order in orders.items():
        if isinstance(result.get(field), list):
            result[field] = _reorder(result[field], order, _merge_key((*path, field)))
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _reorder(items: list, order: list, key: str | None) -> list:
    def ident(item: Any) -> Any:
        return item.get(key) if key and isinstance(item, dict) else item

    wanted = [ident(o) for o in order]
    ranked = [i for w in wanted for i in items if ident(i) == w]
    return ranked + [i for i in items if ident(i) not in wanted]


def _smp_list(orig: list, patch: list, path: tuple[str, ...]) -> list:
    if any(isinstance(i, dict) and i.get("$patch") == "replace" for i in patch):
        return [_strip_directives(i) for i in patch
                if not (isinstance(i, dict) and i.get("$patch") == "replace")]
    if path[-1] == "finalizers" and len(path) >= 2 and path[-2] == "metadata":
        return list(orig) + [x for x in patch if x not in orig]
    key = _merge_key(path)
    if key is None:
        return _strip_directives(patch)
    result = copy.deepcopy(orig)
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise PatchError(f"map: {item!r} does not contain declared merge key: {key}",
                             code=400)
        pos = next((i for i, o in enumerate(result)
                    if isinstance(o, dict) and o.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if pos is not None:
                del result[pos]
            continue
        merged = _smp_map(result[pos] if pos is not None else {}, item, path)
        if pos is None:
            result.append(merged)
        else:
            result[pos] = merged
    return result


def strategic_merge_patch(doc: dict, patch: Any) -> dict:
    if not isinstance(patch, dict):
        raise PatchError("strategic merge patch must be a JSON object", code=400)
    merged = _smp_map(doc, patch, ())
    return {} if merged is _DELETE else merged
