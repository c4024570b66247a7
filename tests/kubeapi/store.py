"""The in-memory object store behind :class:`kubeapi.server.KubeAPIServer`.

It implements the apiserver's write semantics (metadata ownership, resourceVersion optimistic
concurrency, generation, status/scale subresources, finalizers, namespace termination, CRD
registration and custom-resource admission, optional ownerReference garbage collection) and
the watch event history. It is synchronous: every operation runs to completion under one lock,
so the HTTP layer and direct test access from another thread see consistent states.

Stored objects are never mutated in place; every write stores a fresh dict, so history events
can share them and callers always get deep copies.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime
import functools
import json
import random
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

from kubeapi.admission import (
    GENERATE_ALPHABET,
    IMMUTABLE_META,
    SERVER_META,
    builtin_defaults,
    check_kind,
    crd_status,
    metadata_errors,
    now_rfc3339,
    prepare_create_status,
)
from kubeapi.crdschema import FieldError, validate_crd, validate_custom_resource
from kubeapi.errors import (
    ApiError,
    already_exists,
    bad_request,
    conflict,
    expired,
    invalid,
    method_not_allowed,
    not_found,
    resource_details,
    unsupported_media_type,
)
from kubeapi.labelselectors import FieldSelector, LabelSelector, selector_to_string
from kubeapi.patch import (
    APPLY_PATCH,
    JSON_PATCH,
    MERGE_PATCH,
    STRATEGIC_PATCH,
    PatchError,
    json_equal,
    json_patch,
    merge_patch,
    strategic_merge_patch,
)
from kubeapi.resources import (
    CRD_KEY,
    NAMESPACES_KEY,
    Registry,
    ResourceType,
    resource_types_from_crd,
)

Key = tuple[str, str]


def _get_path(obj: Any, path: str) -> Any:
    cur = obj
    for part in [p for p in path.split(".") if p]:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def _set_path(obj: dict, path: str, value: Any) -> None:
    parts = [p for p in path.split(".") if p]
    cur = obj
    for part in parts[:-1]:
        cur = cur.setdefault(part, {})
    cur[parts[-1]] = value


def _content(obj: dict) -> dict:
    """What ``metadata.generation`` tracks: everything except metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


def _without_rv(obj: dict) -> dict:
    out = dict(obj)
    out["metadata"] = {k: v for k, v in (obj.get("metadata") or {}).items()
                       if k not in ("resourceVersion", "managedFields")}
    return out


@dataclass
class Event:
    rv: int
    key: Key
    type: str
    obj: dict
    old: dict | None = None


class Watch:
    """One watch stream's subscription: filters events and queues ``(type, object)`` pairs.

    ``None`` in the queue means the stream must end (server stop, resource removed)."""

    def __init__(self, rt: ResourceType, namespace: str | None, labels: LabelSelector,
                 fields: FieldSelector, loop: asyncio.AbstractEventLoop | None) -> None:
        self.rt, self.namespace, self.labels, self.fields = rt, namespace, labels, fields
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    def matches(self, obj: dict | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata") or {}
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return self.labels.matches(meta.get("labels")) and self.fields.matches(obj)

    def translate(self, ev: Event) -> tuple[str, dict] | None:
        """Selector transitions become ADDED/DELETED like on a real apiserver."""
        now = self.matches(ev.obj)
        if ev.type != "MODIFIED":
            return (ev.type, ev.obj) if now else None
        before = self.matches(ev.old)
        if now and before:
            return ("MODIFIED", ev.obj)
        if now:
            return ("ADDED", ev.obj)
        if before:
            return ("DELETED", ev.obj)
        return None

    def _put(self, item: Any) -> None:
        loop = self.loop
        if loop is None or loop.is_closed():
            self.queue.put_nowait(item)
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self.queue.put_nowait(item)
        else:
            loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def offer(self, ev: Event) -> None:
        if not self.closed and (out := self.translate(ev)) is not None:
            self._put(out)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._put(None)


def _locked(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class Store:
    def __init__(self, *, gc: bool = False, history: int = 10_000) -> None:
        self.gc = gc
        self.registry = Registry()
        self._lock = threading.RLock()
        self._objects: dict[Key, dict[tuple[str, str], dict]] = {}
        self._rv = 0
        self._history: deque[Event] = deque(maxlen=history)
        self._floor = 0  # events after this resourceVersion are all still in history
        self._watches: set[Watch] = set()
        self._service_ips = 10
        for ns in ("default", "kube-system"):
            self.create(self.rt("", "v1", "namespaces"), None, {"metadata": {"name": ns}})

    # Lookups -------------------------------------------------------------------------------

    def rt(self, group: str, version: str, plural: str) -> ResourceType:
        rt = self.registry.find(group, version, plural)
        if rt is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return rt

    @property
    def resource_version(self) -> int:
        return self._rv

    def _bucket(self, key: Key) -> dict[tuple[str, str], dict]:
        return self._objects.setdefault(key, {})

    def _existing(self, rt: ResourceType, ns: str | None, name: str) -> dict:
        obj = self._bucket(rt.key).get((ns or "", name))
        if obj is None:
            raise not_found(rt, name)
        return obj

    @staticmethod
    def present(rt: ResourceType, obj: dict) -> dict:
        out = {"apiVersion": rt.api_version, "kind": rt.kind}
        out.update((k, copy.deepcopy(v)) for k, v in obj.items() if k not in out)
        return out

    def _crd_for(self, rt: ResourceType) -> dict | None:
        return self._bucket(CRD_KEY).get(("", rt.crd)) if rt.crd else None

    # Reads ---------------------------------------------------------------------------------

    @_locked
    def get(self, rt: ResourceType, ns: str | None, name: str) -> dict:
        return self.present(rt, self._existing(rt, ns, name))

    @_locked
    def list(self, rt: ResourceType, ns: str | None, labels: LabelSelector | None = None,
             fields: FieldSelector | None = None, limit: int | None = None,
             continue_token: str | None = None) -> tuple[list[dict], int, str | None, int]:
        """Items sorted by (namespace, name), the list resourceVersion, the continue token and
        the remaining item count."""
        start: tuple[str, str] | None = None
        if continue_token:
            try:
                start = tuple(json.loads(base64.urlsafe_b64decode(continue_token))["start"])
            except (ValueError, KeyError, TypeError) as exc:
                raise bad_request(f"continue key is not valid: {exc}") from exc
        matched = []
        for (obj_ns, name), obj in sorted(self._bucket(rt.key).items()):
            if ns is not None and obj_ns != ns:
                continue
            if start is not None and (obj_ns, name) <= start:
                continue
            meta = obj.get("metadata") or {}
            if labels and not labels.matches(meta.get("labels")):
                continue
            if fields and not fields.matches(obj):
                continue
            matched.append(((obj_ns, name), obj))
        token = None
        remaining = 0
        if limit and len(matched) > limit:
            remaining = len(matched) - limit
            matched = matched[:limit]
            token = base64.urlsafe_b64encode(
                json.dumps({"rv": self._rv, "start": list(matched[-1][0])}).encode()).decode()
        return [self.present(rt, obj) for _, obj in matched], self._rv, token, remaining

    # Event plumbing ------------------------------------------------------------------------

    def _emit(self, key: Key, kind: str, obj: dict, old: dict | None = None) -> None:
        if len(self._history) == self._history.maxlen:
            self._floor = self._history[0].rv
        ev = Event(self._rv, key, kind, obj, old)
        self._history.append(ev)
        for watch in list(self._watches):
            if watch.rt.key == key:
                watch.offer(ev)

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    @_locked
    def watch(self, rt: ResourceType, ns: str | None, labels: LabelSelector,
              fields: FieldSelector, since: str | None, send_initial: bool,
              loop: asyncio.AbstractEventLoop | None) -> tuple[list[tuple[str, dict]], Watch]:
        """Subscribe; returns the events to send first (synthetic ADDED or replayed history)."""
        watch = Watch(rt, ns, labels, fields, loop)
        initial: list[tuple[str, dict]] = []
        if since in (None, "", "0") or send_initial:
            for _, obj in sorted(self._bucket(rt.key).items()):
                if watch.matches(obj):
                    initial.append(("ADDED", obj))
        else:
            try:
                after = int(since)
            except ValueError as exc:
                raise bad_request(f"invalid resource version: {since!r}") from exc
            if after < self._floor:
                raise expired(after, self._floor + 1)
            for ev in self._history:
                if ev.rv > after and ev.key == rt.key and (out := watch.translate(ev)):
                    initial.append(out)
        self._watches.add(watch)
        return [(kind, self.present(rt, obj)) for kind, obj in initial], watch

    @_locked
    def unwatch(self, watch: Watch) -> None:
        self._watches.discard(watch)
        watch.close()

    @_locked
    def close_watches(self, key: Key | None = None) -> None:
        for watch in list(self._watches):
            if key is None or watch.rt.key == key:
                self.unwatch(watch)

    # Admission -----------------------------------------------------------------------------

    def _admit(self, rt: ResourceType, obj: dict, old: dict | None) -> dict:
        errors = metadata_errors(rt, obj, old)
        if rt.crd:
            crd = self._crd_for(rt)
            if crd is not None:
                obj, cr_errors = validate_custom_resource(crd, obj, old)
                errors += cr_errors
        if rt.key == CRD_KEY:
            errors += validate_crd(obj)
            if old is not None and (old.get("spec") or {}).get("scope") != \
                    (obj.get("spec") or {}).get("scope"):
                errors.append(FieldError("spec.scope", detail="field is immutable",
                                         value=(obj.get("spec") or {}).get("scope")))
        if errors:
            raise invalid(rt, obj["metadata"].get("name", ""), errors)
        return obj

    def _allocate_ip(self) -> str:
        self._service_ips += 1
        return f"10.96.{self._service_ips // 250}.{self._service_ips % 250}"

    # Create --------------------------------------------------------------------------------

    def _generate_name(self, rt: ResourceType, ns: str, prefix: str) -> str:
        bucket = self._bucket(rt.key)
        while True:
            name = prefix + "".join(random.choice(GENERATE_ALPHABET) for _ in range(5))
            if (ns, name) not in bucket:
                return name

    def _check_namespace(self, rt: ResourceType, ns: str, name: str) -> None:
        ns_obj = self._bucket(NAMESPACES_KEY).get(("", ns))
        if ns_obj is None:
            raise ApiError(404, "NotFound", f'namespaces "{ns}" not found',
                           {"name": ns, "kind": "namespaces"})
        if ns_obj["metadata"].get("deletionTimestamp"):
            raise ApiError(403, "Forbidden",
                           f'{rt.group_resource} "{name}" is forbidden: unable to create new '
                           f"content in namespace {ns} because it is being terminated",
                           resource_details(rt, name))

    @_locked
    def create(self, rt: ResourceType, ns: str | None, body: Any, *,
               dry_run: bool = False) -> dict:
        obj = copy.deepcopy(check_kind(rt, body))
        obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
        meta = obj.setdefault("metadata", {})
        if rt.namespaced:
            if ns is None:
                raise method_not_allowed()
            if meta.get("namespace") and meta["namespace"] != ns:
                raise bad_request("the namespace of the provided object does not match the "
                                  "namespace sent on the request")
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        if meta.get("resourceVersion"):
            raise bad_request("resourceVersion should not be set on objects to be created")
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise invalid(rt, "", [FieldError("metadata.name", "FieldValueRequired",
                                                  "name or generateName is required")])
            meta["name"] = self._generate_name(rt, ns or "", meta["generateName"])
        name = meta["name"]
        if rt.namespaced:
            self._check_namespace(rt, ns, name)
        for field in SERVER_META:
            meta.pop(field, None)
        prepare_create_status(rt, obj)
        builtin_defaults(rt, obj, None, self._allocate_ip)
        obj = self._admit(rt, obj, None)
        if (ns or "", name) in self._bucket(rt.key):
            raise already_exists(rt, name)
        meta = obj["metadata"]
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_rfc3339(), generation=1)
        if rt.key == CRD_KEY:
            obj["status"] = self._crd_status(obj, None)
        if dry_run:
            return self.present(rt, obj)
        meta["resourceVersion"] = self._next_rv()
        self._bucket(rt.key)[(ns or "", name)] = obj
        if rt.key == CRD_KEY:
            self._crd_changed(obj)
        self._emit(rt.key, "ADDED", obj)
        return self.present(rt, obj)

    # Update --------------------------------------------------------------------------------

    @_locked
    def update(self, rt: ResourceType, ns: str | None, name: str, body: Any, *,
               subresource: str | None = None, dry_run: bool = False) -> dict:
        body = copy.deepcopy(check_kind(rt, body))
        old = self._existing(rt, ns, name)
        meta = body.setdefault("metadata", {})
        if meta.get("name") and meta["name"] != name:
            raise bad_request(f"the name of the object ({meta['name']}) does not match the name "
                              f"on the URL ({name})")
        if rt.namespaced and meta.get("namespace") and meta["namespace"] != ns:
            raise bad_request("the namespace of the provided object does not match the "
                              "namespace sent on the request")
        rv = meta.get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise conflict(rt, name)
        return self.present(rt, self._commit_update(rt, old, body, subresource, dry_run))

    def _commit_update(self, rt: ResourceType, old: dict, new: dict, subresource: str | None,
                       dry_run: bool) -> dict:
        if subresource == "status":
            candidate = copy.deepcopy(old)
            if "status" in new:
                candidate["status"] = copy.deepcopy(new["status"])
            else:
                candidate.pop("status", None)
            new = candidate
        else:
            new = copy.deepcopy(new)
            if rt.status:
                if "status" in old:
                    new["status"] = copy.deepcopy(old["status"])
                else:
                    new.pop("status", None)
            meta = new.setdefault("metadata", {})
            meta.pop("managedFields", None)
            for field in IMMUTABLE_META:
                if field in old["metadata"]:
                    meta[field] = old["metadata"][field]
                else:
                    meta.pop(field, None)
            builtin_defaults(rt, new, old, self._allocate_ip)
        new["apiVersion"], new["kind"] = rt.api_version, rt.kind
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        new = self._admit(rt, new, old)
        if rt.key == CRD_KEY:
            new["status"] = self._crd_status(new, old.get("status"))
        if json_equal(_without_rv(new), _without_rv({**old, "apiVersion": rt.api_version})):
            return old  # a no-op write changes nothing, not even the resourceVersion
        if not json_equal(_content(new), _content(old)):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        if dry_run:
            return new
        return self._store_modified(rt, old, new)

    def _store_modified(self, rt: ResourceType, old: dict, new: dict) -> dict:
        meta = new["metadata"]
        meta["resourceVersion"] = self._next_rv()
        self._bucket(rt.key)[(meta.get("namespace", ""), meta["name"])] = new
        if rt.key == CRD_KEY:
            self._crd_changed(new)
        self._emit(rt.key, "MODIFIED", new, old)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            if rt.key != NAMESPACES_KEY or not self._namespace_has_content(meta["name"]):
                self._remove(rt, new, "Background")
        return new

    # Patch ---------------------------------------------------------------------------------

    @_locked
    def patch(self, rt: ResourceType, ns: str | None, name: str, content_type: str,
              patch: Any, *, subresource: str | None = None, dry_run: bool = False,
              field_manager: str | None = None) -> tuple[dict, bool]:
        """Returns the patched object and whether it was created (server-side apply)."""
        bucket = self._bucket(rt.key)
        if content_type == APPLY_PATCH:
            if not field_manager:
                raise ApiError(422, "Invalid", 'PatchOptions.meta.k8s.io "" is invalid: '
                                               "fieldManager: Required value: is required for "
                                               "apply patch")
            check_kind(rt, patch)
            pname = (patch.get("metadata") or {}).get("name")
            if pname and pname != name:
                raise bad_request(f"the name of the object ({pname}) does not match the name on "
                                  f"the URL ({name})")
            if (ns or "", name) not in bucket and subresource is None:
                body = copy.deepcopy(patch)
                body.setdefault("metadata", {})["name"] = name
                return self.create(rt, ns, body, dry_run=dry_run), True
        old = self._existing(rt, ns, name)
        current = self.present(rt, old)
        candidate = self._apply_patch(rt, current, content_type, patch)
        if not isinstance(candidate, dict):
            raise ApiError(422, "Invalid", "the patch replaced the object with a non-object")
        rv = (candidate.get("metadata") or {}).get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise conflict(rt, name)
        return self.present(rt, self._commit_update(rt, old, candidate, subresource,
                                                    dry_run)), False

    def _apply_patch(self, rt: ResourceType | None, current: dict, content_type: str,
                     patch: Any) -> Any:
        custom = rt is not None and rt.crd is not None
        try:
            if content_type == MERGE_PATCH:
                if not isinstance(patch, dict):
                    raise bad_request("merge patch must be a JSON object")
                return merge_patch(current, patch)
            if content_type == JSON_PATCH:
                return json_patch(current, patch)
            if content_type == STRATEGIC_PATCH and not custom:
                return strategic_merge_patch(current, patch)
            if content_type == APPLY_PATCH:
                # Server-side apply approximated as a merge: no field ownership, no conflicts,
                # and fields missing from the applied config are never removed.
                return merge_patch(current, patch) if custom else \
                    strategic_merge_patch(current, patch)
        except PatchError as exc:
            if exc.code == 400:
                raise bad_request(str(exc)) from exc
            raise ApiError(422, "Invalid", str(exc), {
                "causes": [{"reason": "FieldValueInvalid", "message": str(exc),
                            "field": "patch"}]}) from exc
        raise unsupported_media_type(content_type)

    # Scale ---------------------------------------------------------------------------------

    def _scale_of(self, rt: ResourceType, obj: dict) -> dict:
        spec = rt.scale
        assert spec is not None
        meta = obj["metadata"]
        if spec.builtin_selector:
            selector = selector_to_string(_get_path(obj, ".spec.selector"))
        else:
            selector = _get_path(obj, spec.label_selector_path) if spec.label_selector_path \
                else None
        status = {"replicas": _get_path(obj, spec.status_replicas_path) or 0}
        if selector:
            status["selector"] = selector
        return {
            "kind": "Scale", "apiVersion": "autoscaling/v1",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion",
                                               "creationTimestamp") if k in meta},
            "spec": {"replicas": _get_path(obj, spec.spec_replicas_path) or 0},
            "status": status,
        }

    @_locked
    def get_scale(self, rt: ResourceType, ns: str | None, name: str) -> dict:
        return self._scale_of(rt, self._existing(rt, ns, name))

    @_locked
    def update_scale(self, rt: ResourceType, ns: str | None, name: str, body: Any, *,
                     dry_run: bool = False) -> dict:
        old = self._existing(rt, ns, name)
        if not isinstance(body, dict) or body.get("kind", "Scale") != "Scale":
            raise bad_request("the body of a scale request must be a Scale object")
        rv = (body.get("metadata") or {}).get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise conflict(rt, name)
        replicas = (body.get("spec") or {}).get("replicas", 0)
        if isinstance(replicas, float) and replicas.is_integer():
            replicas = int(replicas)
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            scale_rt = ResourceType("autoscaling", "v1", "scale", "Scale")
            raise invalid(scale_rt, name, [FieldError(
                "spec.replicas", detail="must be greater than or equal to 0", value=replicas)])
        new = copy.deepcopy(old)
        assert rt.scale is not None
        _set_path(new, rt.scale.spec_replicas_path, replicas)
        return self._scale_of(rt, self._commit_update(rt, old, new, "scale", dry_run))

    @_locked
    def patch_scale(self, rt: ResourceType, ns: str | None, name: str, content_type: str,
                    patch: Any, *, dry_run: bool = False) -> dict:
        scale = self._scale_of(rt, self._existing(rt, ns, name))
        patched = self._apply_patch(None, scale, content_type, patch)
        return self.update_scale(rt, ns, name, patched, dry_run=dry_run)

    # Delete --------------------------------------------------------------------------------

    @_locked
    def delete(self, rt: ResourceType, ns: str | None, name: str, options: dict | None = None,
               *, dry_run: bool = False) -> tuple[dict, bool]:
        """Returns the object (as deleted, or as marked for deletion) and whether it is gone."""
        options = options or {}
        obj = self._existing(rt, ns, name)
        pre = options.get("preconditions") or {}
        meta = obj["metadata"]
        if pre.get("uid") and pre["uid"] != meta["uid"]:
            raise conflict(rt, name, f"Precondition failed: UID in precondition: {pre['uid']}, "
                                     f"UID in object meta: {meta['uid']}")
        if pre.get("resourceVersion") and pre["resourceVersion"] != meta["resourceVersion"]:
            raise conflict(rt, name, "Precondition failed: ResourceVersion in precondition: "
                                     f"{pre['resourceVersion']}, ResourceVersion in object "
                                     f"meta: {meta['resourceVersion']}")
        policy = options.get("propagationPolicy") or (
            "Orphan" if options.get("orphanDependents") else "Background")
        if dry_run:
            return self.present(rt, obj), not meta.get("finalizers")
        if grace := _pod_grace(rt, obj, options):
            # A pod on a node stops gracefully: marked with the time its grace period
            # ends, and left to its kubelet, which removes it (a DELETE with grace 0).
            return self.present(rt, self._mark_deleting(rt, obj, grace)), False
        if meta.get("finalizers") or rt.key == NAMESPACES_KEY:
            obj = self._mark_deleting(rt, obj)
            if rt.key == NAMESPACES_KEY:
                self._empty_namespace(meta["name"])
                obj = self._bucket(rt.key).get(("", name), obj)
                if ("", name) in self._bucket(rt.key) and not obj["metadata"].get("finalizers"):
                    if not self._namespace_has_content(name):
                        return self.present(rt, self._remove(rt, obj, policy)), True
            return self.present(rt, obj), ("", name) not in self._bucket(rt.key)
        return self.present(rt, self._remove(rt, obj, policy)), True

    def _mark_deleting(self, rt: ResourceType, obj: dict, grace: int = 0) -> dict:
        if obj["metadata"].get("deletionTimestamp"):
            return obj
        new = copy.deepcopy(obj)
        meta = new["metadata"]
        meta["deletionTimestamp"] = (
            datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=grace)
        ).strftime("%Y-%m-%dT%H:%M:%SZ")
        meta["deletionGracePeriodSeconds"] = grace
        meta["generation"] = meta.get("generation", 1) + 1
        if rt.key == NAMESPACES_KEY:
            new["status"] = {**(new.get("status") or {}), "phase": "Terminating"}
        meta["resourceVersion"] = self._next_rv()
        self._bucket(rt.key)[(meta.get("namespace", ""), meta["name"])] = new
        self._emit(rt.key, "MODIFIED", new, obj)
        return new

    def _remove(self, rt: ResourceType, obj: dict, policy: str) -> dict:
        meta = obj["metadata"]
        ns = meta.get("namespace", "")
        if (ns, meta["name"]) not in self._bucket(rt.key):
            return obj
        if rt.key == CRD_KEY:
            self._crd_removed(obj)  # instances go first, as with the apiserver's cleanup finalizer
        del self._bucket(rt.key)[(ns, meta["name"])]
        final = copy.deepcopy(obj)
        final["metadata"]["resourceVersion"] = self._next_rv()
        self._emit(rt.key, "DELETED", final, obj)
        if self.gc:
            self._collect_dependents(meta["uid"], policy)
        if ns:
            self._maybe_finish_namespace(ns)
        return final

    @_locked
    def delete_collection(self, rt: ResourceType, ns: str | None, labels: LabelSelector,
                          fields: FieldSelector, options: dict | None = None, *,
                          dry_run: bool = False) -> list[dict]:
        items, _, _, _ = self.list(rt, ns, labels, fields)
        out = []
        for item in items:
            meta = item["metadata"]
            out.append(self.delete(rt, meta.get("namespace"), meta["name"], options,
                                   dry_run=dry_run)[0])
        return out

    # Namespaces ----------------------------------------------------------------------------

    def _namespace_has_content(self, ns: str) -> bool:
        return any(obj_ns == ns for bucket in self._objects.values() for obj_ns, _ in bucket)

    def _empty_namespace(self, ns: str) -> None:
        for key, bucket in list(self._objects.items()):
            types = self.registry.by_key(key)
            if not types:
                continue
            for (obj_ns, name), obj in list(bucket.items()):
                if obj_ns == ns and (obj_ns, name) in bucket:
                    if obj["metadata"].get("finalizers"):
                        self._mark_deleting(types[0], obj)
                    else:
                        self._remove(types[0], obj, "Background")

    def _maybe_finish_namespace(self, ns: str) -> None:
        ns_obj = self._bucket(NAMESPACES_KEY).get(("", ns))
        if ns_obj is None or not ns_obj["metadata"].get("deletionTimestamp"):
            return
        if ns_obj["metadata"].get("finalizers") or self._namespace_has_content(ns):
            return
        self._remove(self.rt("", "v1", "namespaces"), ns_obj, "Background")

    # Garbage collection --------------------------------------------------------------------

    def _uid_exists(self, uid: str) -> bool:
        return any(obj["metadata"].get("uid") == uid
                   for bucket in self._objects.values() for obj in bucket.values())

    def _collect_dependents(self, uid: str, policy: str) -> None:
        # Background propagation, synchronously; Foreground is treated like Background.
        for key, bucket in list(self._objects.items()):
            types = self.registry.by_key(key)
            if not types:
                continue
            for obj in list(bucket.values()):
                meta = obj["metadata"]
                if bucket.get((meta.get("namespace", ""), meta["name"])) is not obj:
                    continue  # already changed or removed by a nested collection
                refs = meta.get("ownerReferences") or []
                if not any(r.get("uid") == uid for r in refs):
                    continue
                remaining = [r for r in refs if r.get("uid") != uid]
                if policy == "Orphan" or any(self._uid_exists(r.get("uid")) for r in remaining):
                    new = copy.deepcopy(obj)
                    if remaining:
                        new["metadata"]["ownerReferences"] = remaining
                    else:
                        new["metadata"].pop("ownerReferences", None)
                    self._store_modified(types[0], obj, new)
                elif obj["metadata"].get("finalizers"):
                    self._mark_deleting(types[0], obj)
                else:
                    self._remove(types[0], obj, "Background")

    # CustomResourceDefinitions -------------------------------------------------------------

    def _crd_status(self, crd: dict, old_status: dict | None) -> dict:
        spec = crd.get("spec") or {}
        key = (spec.get("group", ""), (spec.get("names") or {}).get("plural", ""))
        return crd_status(crd, old_status, clash=key in self.registry.builtin_keys())

    def _crd_changed(self, crd: dict) -> None:
        name = crd["metadata"]["name"]
        types = resource_types_from_crd(crd)
        if any(rt.key in self.registry.builtin_keys() for rt in types):
            return
        self.registry.register_crd(name, types)
        served = {rt.version for rt in types}
        for watch in list(self._watches):
            if watch.rt.crd == name and watch.rt.version not in served:
                self.unwatch(watch)

    def _crd_removed(self, crd: dict) -> None:
        types = self.registry.unregister_crd(crd["metadata"]["name"])
        if not types:
            return
        rt = types[0]
        for obj in list(self._bucket(rt.key).values()):
            self._remove(rt, obj, "Background")
        self._objects.pop(rt.key, None)
        self.close_watches(rt.key)

    # Direct access for tests ---------------------------------------------------------------

    @_locked
    def find(self, group_version: str, resource: str, namespace: str | None,
             name: str) -> dict | None:
        group, _, version = group_version.rpartition("/")
        rt = self.registry.find(group, version, resource)
        if rt is None:
            return None
        obj = self._bucket(rt.key).get((namespace or "", name))
        return self.present(rt, obj) if obj is not None else None

    @_locked
    def find_all(self, group_version: str, resource: str,
                 namespace: str | None = None) -> list[dict]:
        group, _, version = group_version.rpartition("/")
        rt = self.registry.find(group, version, resource)
        if rt is None:
            return []
        return self.list(rt, namespace)[0]


def _pod_grace(rt: ResourceType, obj: dict, options: dict) -> int:
    """The grace period a DELETE gives a pod (0: it goes now). As kube-apiserver does: a
    pod bound to a node and not finished gets the request's gracePeriodSeconds, else its
    spec's terminationGracePeriodSeconds (default 30 s); a pod already being deleted keeps
    its deadline until a DELETE with grace 0 (its kubelet's) removes it."""
    if rt.key != ("", "pods"):
        return 0
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    if not spec.get("nodeName") or status.get("phase") in ("Succeeded", "Failed"):
        return 0
    grace = options.get("gracePeriodSeconds")
    if grace is None and obj["metadata"].get("deletionTimestamp"):
        return 1  # still stopping: it stays marked as it is
    if grace is None:
        grace = spec.get("terminationGracePeriodSeconds", 30)
    return max(0, int(grace))
