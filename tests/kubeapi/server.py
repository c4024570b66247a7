"""An in-memory Kubernetes API server over real HTTP, for tests.

Real clients work against it unmodified: kopf (log in with a ``@kopf.on.login`` handler
returning ``kopf.ConnectionInfo(server=server.url, insecure=True)``), the official
``kubernetes`` client (``Configuration(host=server.url)``), and raw aiohttp::

    async with KubeAPIServer() as server:          # or: await server.start() / server.stop()
        ...  # talk to server.url
        assert not server.writes()

    with running_kubeapi(gc=True) as server:       # sync code: server in a background thread
        server.write_kubeconfig(tmp_path / "kubeconfig")

This module is the HTTP layer. Semantics live in :mod:`kubeapi.store` (objects,
write rules, watch history, GC), :mod:`~kubeapi.admission` (metadata validation,
built-in defaults), :mod:`~kubeapi.resources` (built-in types, discovery),
:mod:`~kubeapi.patch` (patch formats, incl. the strategic-merge approximation),
:mod:`~kubeapi.labelselectors`, :mod:`~kubeapi.errors` and
:mod:`~kubeapi.crdschema` / :mod:`~kubeapi.crdcel` (custom-resource validation).

Faithful on purpose, so tests catch what a real cluster would reject: status is dropped on
create and ignored by main-resource writes for every resource with a status subresource;
no-op writes keep the resourceVersion and emit nothing; ``generation`` also bumps when
``deletionTimestamp`` is set; strategic merge on custom resources is 415; server-side apply
requires ``fieldManager``; objects sent with a ``resourceVersion`` to create are a 400; labels,
annotation keys and names are validated; immediate deletes answer with a ``Status`` (the object
for pods and service accounts, and always while finalizers are pending).

What kubectl reads is served as kube-apiserver serves it (:mod:`~kubeapi.openapi`,
:mod:`~kubeapi.gnostic`, :mod:`~kubeapi.table`): ``/openapi/v2`` as JSON or as gnostic's
protobuf (kubectl validates and explains from it), with the built-in kinds' upstream
definitions, each CRD's schema converted for v2 and each resource's PATCH operation (where
kubectl learns that ``--dry-run=server`` is served); Table output for get and list (a CRD's
``additionalPrinterColumns``; built-in kinds get the generic ``Name``/``Created At``);
a get that asks for ``PartialObjectMetadata`` gets the object's metadata alone.

Not modelled: authentication/authorization (every request is allowed), admission webhooks,
schema validation of built-in kinds (only their metadata is checked), protobuf/CBOR
encodings of objects, ``/openapi/v3`` (kubectl 1.27+ falls back to v2), server-side
field validation (``fieldValidation`` is not listed, so kubectl validates on the client),
the v2 document's other operations, per-kind printers of built-in kinds, Table output of
watches (``kubectl get -w``), aggregated discovery, field managers (server-side apply is a
create-or-merge that never removes fields), resourceVersion semantics on list (always the
latest state), controllers (no pods are made for deployments; only namespace cleanup and the
optional ownerReference garbage collector run; ``Foreground`` propagation behaves like
``Background``), CRD conversion (served versions share objects, only ``apiVersion``
changes), default service accounts and ``kube-root-ca.crt`` config maps.

CLI for manual poking (from tests/): ``python -m kubeapi.server --port 8001``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from aiohttp import web

from kubeapi import gnostic, openapi
from kubeapi.errors import (
    ApiError,
    bad_request,
    method_not_allowed,
    unsupported_media_type,
)
from kubeapi.labelselectors import FieldSelector, LabelSelector
from kubeapi.patch import APPLY_PATCH, JSON_PATCH, MERGE_PATCH, STRATEGIC_PATCH
from kubeapi.resources import CRD_KEY, ResourceType
from kubeapi.store import Store
from kubeapi.table import table, table_version

__all__ = ["KubeAPIServer", "Request", "running_kubeapi"]

log = logging.getLogger(__name__)

VERSION_INFO = {
    "major": "1", "minor": "33", "emulationMajor": "1", "emulationMinor": "33",
    "minCompatibilityMajor": "1", "minCompatibilityMinor": "32", "gitVersion": "v1.33.0",
    "gitCommit": "60a317eadfcb839692a68eab88b2096f4d708f4f", "gitTreeState": "clean",
    "buildDate": "2025-04-23T13:07:00Z", "goVersion": "go1.24.2", "compiler": "gc",
    "platform": "linux/amd64",
}
READ_VERBS = frozenset({"get", "list", "watch"})
_TRUE = {"1", "t", "T", "true", "TRUE", "True"}
_FALSE = {"0", "f", "F", "false", "FALSE", "False"}
_NOT_FOUND = ApiError(404, "NotFound", "the server could not find the requested resource",
                      {"causes": [{"reason": "UnexpectedServerResponse",
                                   "message": "404 page not found"}]})
# Immediate deletes answer with a Status except for these (genericregistry ReturnDeletedObject).
_RETURNS_DELETED_OBJECT = {("", "pods"), ("", "serviceaccounts")}


_FAULT_REASONS = {409: "Conflict", 429: "TooManyRequests", 500: "InternalError",
                  503: "ServiceUnavailable"}


@dataclass
class Fault:
    """The next `times` requests with this verb on this resource fail with `status`."""

    verb: str
    resource: str
    status: int
    subresource: str = ""
    times: int = 1

    def matches(self, r: Request) -> bool:
        return self.times > 0 and (r.verb, r.resource, r.subresource) == (
            self.verb, self.resource, self.subresource)


class Request(NamedTuple):
    """One resource request, with Kubernetes RBAC attributes ("" where not applicable).

    As in RBAC, ``name`` is "" for create, list, watch and deletecollection. Only resource
    requests are logged: discovery, ``/version`` and health checks are not."""

    verb: str
    group: str
    version: str
    resource: str
    subresource: str
    namespace: str
    name: str
    label_selector: str = ""  # of a list or watch


def _parse_bool(params: Any, key: str) -> bool:
    value = params.get(key)
    if value is None or value == "":
        return False
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise bad_request(f"invalid value for {key}: {value!r}: invalid syntax")


def _metadata_only(accept: str) -> bool:
    """Whether `accept` asks first for PartialObjectMetadata (a get of metadata alone)."""
    first = accept.split(",")[0].replace(" ", "").split(";")
    return "as=PartialObjectMetadata" in first[1:] and "g=meta.k8s.io" in first[1:]


def _json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=json.dumps(body, separators=(",", ":")),
                        content_type="application/json")


class KubeAPIServer:
    """``gc`` enables the ownerReference garbage collector; ``history`` is how many events are
    kept for watch resumption (older resourceVersions get 410 Expired); ``bookmark_interval``
    is how often watches with ``allowWatchBookmarks`` get a BOOKMARK."""

    def __init__(self, *, gc: bool = False, host: str = "127.0.0.1", port: int = 0,
                 history: int = 10_000, bookmark_interval: float = 30.0) -> None:
        self.store = Store(gc=gc, history=history)
        self.host, self.port = host, port
        self.bookmark_interval = bookmark_interval
        self.url = ""
        self.requests: list[Request] = []
        # The gets answered with metadata only (PartialObjectMetadata): no data, no spec.
        self.metadata_reads: list[Request] = []
        self.faults: list[Fault] = []
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        # The OpenAPI document as JSON and protobuf, for the CRDs' resourceVersions it was
        # built from.
        self._openapi: tuple[tuple, bytes, bytes] | None = None

    # Lifecycle -----------------------------------------------------------------------------

    async def start(self) -> str:
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # handler_cancellation: a client hanging up a watch must end its handler promptly.
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None,
                                     handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        sockets = site._server.sockets if site._server else []  # type: ignore[union-attr]
        self.port = sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        self._stopping = True
        self.store.close_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> KubeAPIServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # Test helpers --------------------------------------------------------------------------

    def inject(self, verb: str, resource: str, status: int, *, subresource: str = "",
               times: int = 1) -> Fault:
        """Make the next `times` matching requests fail (e.g. a 409 on a StatefulSet update,
        a 500 on a status patch); the request is still logged, nothing is stored."""
        fault = Fault(verb, resource, status, subresource, times)
        self.faults.append(fault)
        return fault

    def drop_watches(self, resource: str | None = None) -> None:
        """End open watch streams (of one plural, or all) as a restarting apiserver would."""
        keys = {rt.key for rt in self.store.registry.all() if resource in (None, rt.plural)}
        for key in keys:
            self.store.close_watches(key)

    def _inject_fault(self, r: Request) -> None:
        for fault in self.faults:
            if fault.matches(r):
                fault.times -= 1
                reason = _FAULT_REASONS.get(fault.status, "InternalError")
                raise ApiError(fault.status, reason,
                               f"injected {fault.status} on {r.verb} {r.resource}")

    def writes(self) -> list[Request]:
        """Requests with a mutating verb (whether or not they succeeded)."""
        return [r for r in self.requests if r.verb not in READ_VERBS]

    @property
    def resource_version(self) -> int:
        """The global resourceVersion counter: unchanged means nothing was stored."""
        return self.store.resource_version

    def get(self, group_version: str, resource: str, namespace: str | None,
            name: str) -> dict | None:
        """Direct store read, no HTTP: ``server.get("apps/v1", "statefulsets", "ns", "x")``."""
        return self.store.find(group_version, resource, namespace, name)

    def list(self, group_version: str, resource: str,
             namespace: str | None = None) -> list[dict]:
        return self.store.find_all(group_version, resource, namespace)

    def write_kubeconfig(self, path: str | Path, namespace: str = "default") -> Path:
        path = Path(path)
        config = {
            "apiVersion": "v1", "kind": "Config", "preferences": {},
            "clusters": [{"name": "kubeapi", "cluster": {"server": self.url}}],
            "users": [{"name": "kubeapi", "user": {"token": "kubeapi-test-token"}}],
            "contexts": [{"name": "kubeapi", "context": {
                "cluster": "kubeapi", "user": "kubeapi", "namespace": namespace}}],
            "current-context": "kubeapi",
        }
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    # HTTP ----------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._route(request)
        except ApiError as exc:
            return _json_response(exc.status(), exc.code)
        except Exception as exc:  # a bug in the emulator: answer like the apiserver would
            log.exception("kubeapi: internal error on %s %s", request.method, request.path_qs)
            error = ApiError(500, "InternalError", f"Internal error occurred: {exc!r}")
            return _json_response(error.status(), 500)

    async def _route(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path.rstrip("/") == "/version":
            return _json_response(VERSION_INFO)
        if path.rstrip("/") in ("/healthz", "/livez", "/readyz"):
            return web.Response(text="ok")
        if path.rstrip("/") == "/openapi/v2":
            return self._openapi_v2(request.headers.get("Accept", ""))
        segs = [s for s in path.split("/") if s]
        registry = self.store.registry
        if segs == ["api"]:
            return _json_response(registry.api_versions(f"{self.host}:{self.port}"))
        if segs == ["apis"]:
            return _json_response(registry.api_group_list())
        if len(segs) >= 2 and segs[0] == "api":
            group, version, rest = "", segs[1], segs[2:]
        elif len(segs) == 2 and segs[0] == "apis":
            doc = registry.api_group(segs[1])
            if doc is None:
                raise _NOT_FOUND
            return _json_response(doc)
        elif len(segs) >= 3 and segs[0] == "apis":
            group, version, rest = segs[1], segs[2], segs[3:]
        else:
            raise _NOT_FOUND
        if not rest:
            doc = registry.api_resource_list(group, version)
            if doc is None:
                raise _NOT_FOUND
            return _json_response(doc)
        return await self._resource(request, group, version, rest)

    def _crds(self) -> list[dict]:
        group, plural = CRD_KEY
        return self.store.find_all(f"{group}/v1", plural)

    def _openapi_v2(self, accept: str) -> web.Response:
        crds = self._crds()
        key = tuple((c["metadata"]["name"], c["metadata"]["resourceVersion"]) for c in crds)
        if self._openapi is None or self._openapi[0] != key:
            doc = openapi.document(self.store.registry.all(), crds)
            self._openapi = (key, json.dumps(doc, separators=(",", ":")).encode(),
                             gnostic.document(doc))
        _, as_json, as_proto = self._openapi
        if gnostic.CONTENT_TYPE in accept:
            # As kube-openapi's handler: the media type asked for has an "@", which is no
            # valid media type to answer with.
            return web.Response(body=as_proto, content_type="application/octet-stream")
        return web.Response(body=as_json, content_type="application/json")

    def _printer_columns(self, rt: ResourceType) -> list[dict] | None:
        """The CRD version's additionalPrinterColumns ([] when it has none); None for
        built-in kinds."""
        if rt.crd is None:
            return None
        crd = self.store.find(f"{CRD_KEY[0]}/v1", CRD_KEY[1], None, rt.crd) or {}
        for ver in (crd.get("spec") or {}).get("versions") or ():
            if ver.get("name") == rt.version:
                return list(ver.get("additionalPrinterColumns") or ())
        return []

    def _table(self, rt: ResourceType, version: str, objects: list[dict], params: Any,
               metadata: dict) -> web.Response:
        return _json_response(table(
            objects, self._printer_columns(rt), version=version,
            include_object=params.get("includeObject"), metadata=metadata,
            now=dt.datetime.now(dt.UTC)))

    async def _resource(self, request: web.Request, group: str, version: str,
                        rest: list[str]) -> web.StreamResponse:
        registry = self.store.registry
        legacy_watch = rest[0] == "watch"
        if legacy_watch:
            rest = rest[1:]
        namespace: str | None = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            inner = registry.find(group, version, rest[2])
            if inner is not None and inner.namespaced:
                namespace, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3:
            raise _NOT_FOUND
        plural = rest[0]
        name = rest[1] if len(rest) > 1 else ""
        sub = rest[2] if len(rest) > 2 else ""
        rt = registry.find(group, version, plural)
        if rt is None or (rt.namespaced and namespace is None and name):
            raise _NOT_FOUND
        params = request.query
        verb = self._verb(request.method, name, legacy_watch or _parse_bool(params, "watch"))
        self.requests.append(Request(verb, group, version, plural, sub, namespace or "", name,
                                     params.get("labelSelector", "")))
        self._inject_fault(self.requests[-1])
        if sub and sub not in rt.subresources:
            raise _NOT_FOUND
        if sub and verb not in ("get", "update", "patch"):
            raise method_not_allowed()
        if verb == "watch":
            return await self._watch(request, rt, namespace, name)
        as_table = table_version(request.headers.get("Accept", ""))
        if verb == "list":
            return self._list(rt, namespace, params, as_table)
        if verb == "get" and not sub and as_table:
            obj = self.store.get(rt, namespace, name)
            return self._table(rt, as_table, [obj], params,
                               {"resourceVersion": obj["metadata"].get("resourceVersion", "")})
        if verb == "get" and not sub and _metadata_only(request.headers.get("Accept", "")):
            self.metadata_reads.append(self.requests[-1])
            return _json_response({"kind": "PartialObjectMetadata",
                                   "apiVersion": "meta.k8s.io/v1",
                                   "metadata": self.store.get(rt, namespace, name)["metadata"]})
        return await self._write_or_get(request, verb, rt, namespace, name, sub)

    @staticmethod
    def _verb(method: str, name: str, watch: bool) -> str:
        if method == "GET":
            return "watch" if watch else ("get" if name else "list")
        verbs = {("POST", False): "create", ("PUT", True): "update", ("PATCH", True): "patch",
                 ("DELETE", True): "delete", ("DELETE", False): "deletecollection"}
        verb = verbs.get((method, bool(name)))
        if verb is None:
            raise method_not_allowed()
        return verb

    @staticmethod
    def _selectors(rt: ResourceType, params: Any) -> tuple[LabelSelector, FieldSelector]:
        try:
            return (LabelSelector.parse(params.get("labelSelector")),
                    FieldSelector.parse(params.get("fieldSelector"), rt.field_selectors))
        except ValueError as exc:
            raise bad_request(str(exc)) from exc

    def _list(self, rt: ResourceType, namespace: str | None, params: Any,
              as_table: str | None = None) -> web.Response:
        labels, fields = self._selectors(rt, params)
        try:
            limit = int(params["limit"]) if params.get("limit") else None
        except ValueError as exc:
            raise bad_request(f"invalid limit: {params['limit']!r}") from exc
        items, rv, token, remaining = self.store.list(rt, namespace, labels, fields, limit,
                                                      params.get("continue"))
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if token:
            meta["continue"] = token
            meta["remainingItemCount"] = remaining
        if as_table:
            return self._table(rt, as_table, items, params, meta)
        return _json_response({"kind": rt.list_kind_name, "apiVersion": rt.api_version,
                               "metadata": meta, "items": items})

    async def _body(self, request: web.Request, *, required: bool = True) -> Any:
        raw = await request.read()
        if not raw.strip():
            if required:
                raise bad_request("the request body is empty")
            return None
        try:
            if "yaml" in request.content_type:
                return yaml.safe_load(raw)
            return json.loads(raw)
        except (ValueError, yaml.YAMLError) as exc:
            raise bad_request(f"the request body could not be decoded: {exc}") from exc

    async def _write_or_get(self, request: web.Request, verb: str, rt: ResourceType,
                            namespace: str | None, name: str, sub: str) -> web.Response:
        store, params = self.store, request.query
        dry_run = params.get("dryRun") == "All"
        if verb == "get":
            return _json_response(store.get_scale(rt, namespace, name) if sub == "scale"
                                  else store.get(rt, namespace, name))
        if verb == "create":
            body = await self._body(request)
            return _json_response(store.create(rt, namespace, body, dry_run=dry_run), 201)
        if verb == "update":
            body = await self._body(request)
            if sub == "scale":
                return _json_response(store.update_scale(rt, namespace, name, body,
                                                         dry_run=dry_run))
            return _json_response(store.update(rt, namespace, name, body,
                                               subresource=sub or None, dry_run=dry_run))
        if verb == "patch":
            return await self._patch(request, rt, namespace, name, sub, dry_run)
        options = await self._body(request, required=False) or {}
        if params.get("propagationPolicy"):
            options.setdefault("propagationPolicy", params["propagationPolicy"])
        if verb == "deletecollection":
            labels, fields = self._selectors(rt, params)
            items = store.delete_collection(rt, namespace, labels, fields, options,
                                            dry_run=dry_run)
            return _json_response({"kind": rt.list_kind_name, "apiVersion": rt.api_version,
                                   "metadata": {"resourceVersion": str(store.resource_version)},
                                   "items": items})
        obj, gone = store.delete(rt, namespace, name, options, dry_run=dry_run)
        if gone and rt.key not in _RETURNS_DELETED_OBJECT:
            details = {"name": name, "kind": rt.plural, "uid": obj["metadata"].get("uid")}
            if rt.group:
                details["group"] = rt.group
            return _json_response({"kind": "Status", "apiVersion": "v1", "metadata": {},
                                   "status": "Success", "details": details})
        return _json_response(obj)

    async def _patch(self, request: web.Request, rt: ResourceType, namespace: str | None,
                     name: str, sub: str, dry_run: bool) -> web.Response:
        content_type = request.content_type
        if content_type not in (MERGE_PATCH, JSON_PATCH, STRATEGIC_PATCH, APPLY_PATCH):
            raise unsupported_media_type(content_type)
        raw = await request.read()
        try:
            patch = yaml.safe_load(raw) if content_type == APPLY_PATCH else json.loads(raw)
        except (ValueError, yaml.YAMLError) as exc:
            raise bad_request(f"the patch could not be decoded: {exc}") from exc
        if sub == "scale":
            return _json_response(self.store.patch_scale(rt, namespace, name, content_type,
                                                         patch, dry_run=dry_run))
        obj, created = self.store.patch(rt, namespace, name, content_type, patch,
                                        subresource=sub or None, dry_run=dry_run,
                                        field_manager=request.query.get("fieldManager"))
        return _json_response(obj, 201 if created else 200)

    # Watch ---------------------------------------------------------------------------------

    def _bookmark(self, rt: ResourceType, initial_end: bool = False) -> dict:
        meta: dict[str, Any] = {"resourceVersion": str(self.store.resource_version)}
        if initial_end:
            meta["annotations"] = {"k8s.io/initial-events-end": "true"}
        return {"type": "BOOKMARK",
                "object": {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta}}

    async def _watch(self, request: web.Request, rt: ResourceType, namespace: str | None,
                     name: str) -> web.StreamResponse:
        params = request.query
        labels, fields = self._selectors(rt, params)
        if name:  # the legacy /watch/.../{name} form
            fields = FieldSelector.parse(f"metadata.name={name},{fields.text}".rstrip(","),
                                         rt.field_selectors)
        bookmarks = _parse_bool(params, "allowWatchBookmarks")
        send_initial = _parse_bool(params, "sendInitialEvents")
        try:
            timeout = float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None
        except ValueError as exc:
            raise bad_request(f"invalid timeoutSeconds: {params['timeoutSeconds']!r}") from exc
        if self._stopping:
            raise ApiError(503, "ServiceUnavailable", "the server is shutting down")
        error: ApiError | None = None
        try:
            initial, watch = self.store.watch(rt, namespace, labels, fields,
                                              params.get("resourceVersion"), send_initial,
                                              asyncio.get_running_loop())
        except ApiError as exc:
            if exc.code != 410:
                raise
            initial, watch, error = [], None, exc

        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)

        async def send(event: dict) -> None:
            await response.write(json.dumps(event, separators=(",", ":")).encode() + b"\n")

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout is not None else None
        try:
            if error is not None or watch is None:
                await send({"type": "ERROR", "object": error.status() if error else {}})
                return response
            for kind, obj in initial:
                await send({"type": kind, "object": obj})
            if send_initial and bookmarks:
                await send(self._bookmark(rt, initial_end=True))
            next_bookmark = loop.time() + self.bookmark_interval
            while True:
                now = loop.time()
                wake = next_bookmark if deadline is None else min(deadline, next_bookmark)
                try:
                    item = await asyncio.wait_for(watch.queue.get(), max(0.0, wake - now))
                except TimeoutError:
                    if deadline is not None and loop.time() >= deadline:
                        if bookmarks:
                            await send(self._bookmark(rt))
                        break
                    if bookmarks:
                        await send(self._bookmark(rt))
                    next_bookmark = loop.time() + self.bookmark_interval
                    continue
                if item is None:
                    break
                kind, obj = item
                await send({"type": kind, "object": self.store.present(rt, obj)})
        except (ConnectionResetError, ConnectionError):
            return response
        finally:
            if watch is not None:
                self.store.unwatch(watch)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await response.write_eof()
        return response


@contextlib.contextmanager
def running_kubeapi(
    server_cls: type[KubeAPIServer] | None = None, **kwargs: Any
) -> Iterator[KubeAPIServer]:
    """Run a :class:`KubeAPIServer` (or a subclass) in a background thread with its own
    event loop, for synchronous tests and tools. Direct store access (``server.get``/
    ``list``) is thread-safe."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="kubeapi", daemon=True)
    thread.start()
    server = (server_cls or KubeAPIServer)(**kwargs)
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=30)
        yield server
    finally:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="In-memory Kubernetes API server for tests.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--gc", action="store_true", help="garbage-collect owned objects")
    parser.add_argument("--kubeconfig", help="write a kubeconfig pointing at the server here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)

    async def serve() -> None:
        server = KubeAPIServer(gc=args.gc, host=args.host, port=args.port)
        url = await server.start()
        if args.kubeconfig:
            server.write_kubeconfig(args.kubeconfig)
        print(f"kube API server listening on {url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await server.stop()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
