"""Resource types known to the in-memory Kubernetes API server, and their discovery documents.

A :class:`ResourceType` is one (group, version, plural). Objects are stored per (group, plural),
so every served version of a CRD sees the same objects (the apiserver's ``None`` conversion
strategy: only ``apiVersion`` is rewritten).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
SUBRESOURCE_VERBS = ("get", "patch", "update")


@dataclass(frozen=True)
class ScaleSpec:
    """Where the ``/scale`` subresource reads and writes replicas (CRD ``subresources.scale``)."""

    spec_replicas_path: str = ".spec.replicas"
    status_replicas_path: str = ".status.replicas"
    # CRs point at a string field; built-in workloads render ``.spec.selector`` instead.
    label_selector_path: str | None = None
    builtin_selector: bool = False


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    singular: str = ""
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    status: bool = False
    scale: ScaleSpec | None = None
    crd: str | None = None  # name of the defining CustomResourceDefinition
    list_kind: str = ""
    # Selectable fields beyond metadata.name/metadata.namespace, as dotted paths.
    field_selectors: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return (self.group, self.plural)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_resource(self) -> str:
        """``deployments.apps`` / ``configmaps``: the form used in error messages."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def singular_name(self) -> str:
        return self.singular or self.kind.lower()

    @property
    def list_kind_name(self) -> str:
        return self.list_kind or f"{self.kind}List"

    @property
    def subresources(self) -> tuple[str, ...]:
        return tuple(s for s, on in (("status", self.status), ("scale", self.scale)) if on)

    def discovery_entries(self) -> list[dict]:
        main: dict = {
            "name": self.plural,
            "singularName": self.singular_name,
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": list(VERBS),
        }
        if self.short_names:
            main["shortNames"] = list(self.short_names)
        if self.categories:
            main["categories"] = list(self.categories)
        entries = [main]
        if self.status:
            entries.append({
                "name": f"{self.plural}/status", "singularName": "", "namespaced": self.namespaced,
                "kind": self.kind, "verbs": list(SUBRESOURCE_VERBS),
            })
        if self.scale:
            entries.append({
                "name": f"{self.plural}/scale", "singularName": "", "namespaced": self.namespaced,
                "group": "autoscaling", "version": "v1", "kind": "Scale",
                "verbs": list(SUBRESOURCE_VERBS),
            })
        return entries


_WORKLOAD_SCALE = ScaleSpec(builtin_selector=True)
_POD_FIELDS = (
    "spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName",
    "status.phase", "status.podIP", "status.nominatedNodeName",
)
_EVENT_FIELDS = (
    "involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
    "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.resourceVersion",
    "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type",
)


def _rt(gv: str, plural: str, kind: str, **kwargs) -> ResourceType:
    group, _, version = gv.rpartition("/")
    return ResourceType(group=group, version=version, plural=plural, kind=kind, **kwargs)


BUILTINS: tuple[ResourceType, ...] = (
    _rt("v1", "namespaces", "Namespace", namespaced=False, short_names=("ns",), status=True,
        field_selectors=("status.phase",)),
    _rt("v1", "nodes", "Node", namespaced=False, short_names=("no",), status=True,
        field_selectors=("spec.unschedulable",)),
    _rt("v1", "pods", "Pod", short_names=("po",), categories=("all",), status=True,
        field_selectors=_POD_FIELDS),
    _rt("v1", "services", "Service", short_names=("svc",), categories=("all",), status=True),
    _rt("v1", "endpoints", "Endpoints", short_names=("ep",)),
    _rt("v1", "configmaps", "ConfigMap", short_names=("cm",)),
    _rt("v1", "secrets", "Secret", field_selectors=("type",)),
    _rt("v1", "serviceaccounts", "ServiceAccount", short_names=("sa",)),
    _rt("v1", "persistentvolumeclaims", "PersistentVolumeClaim", short_names=("pvc",),
        status=True),
    _rt("v1", "events", "Event", short_names=("ev",), field_selectors=_EVENT_FIELDS),
    _rt("events.k8s.io/v1", "events", "Event", short_names=("ev",),
        field_selectors=("reason", "type", "regarding.kind", "regarding.name",
                         "regarding.namespace", "regarding.uid")),
    _rt("apps/v1", "deployments", "Deployment", short_names=("deploy",), categories=("all",),
        status=True, scale=_WORKLOAD_SCALE),
    _rt("apps/v1", "statefulsets", "StatefulSet", short_names=("sts",), categories=("all",),
        status=True, scale=_WORKLOAD_SCALE),
    _rt("apps/v1", "replicasets", "ReplicaSet", short_names=("rs",), categories=("all",),
        status=True, scale=_WORKLOAD_SCALE),
    _rt("apps/v1", "daemonsets", "DaemonSet", short_names=("ds",), categories=("all",),
        status=True),
    _rt("apps/v1", "controllerrevisions", "ControllerRevision"),
    _rt("batch/v1", "jobs", "Job", categories=("all",), status=True),
    _rt("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget", short_names=("pdb",),
        status=True),
    _rt("networking.k8s.io/v1", "networkpolicies", "NetworkPolicy", short_names=("netpol",)),
    _rt("rbac.authorization.k8s.io/v1", "roles", "Role"),
    _rt("rbac.authorization.k8s.io/v1", "rolebindings", "RoleBinding"),
    _rt("rbac.authorization.k8s.io/v1", "clusterroles", "ClusterRole", namespaced=False),
    _rt("rbac.authorization.k8s.io/v1", "clusterrolebindings", "ClusterRoleBinding",
        namespaced=False),
    _rt("coordination.k8s.io/v1", "leases", "Lease"),
    _rt("apiextensions.k8s.io/v1", "customresourcedefinitions", "CustomResourceDefinition",
        namespaced=False, short_names=("crd", "crds"), categories=("api-extensions",),
        status=True),
    _rt("autoscaling/v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler",
        short_names=("hpa",), categories=("all",), status=True),
)

CRD_KEY = ("apiextensions.k8s.io", "customresourcedefinitions")
NAMESPACES_KEY = ("", "namespaces")

_VERSION_RE = re.compile(r"^v(\d+)(?:(alpha|beta)(\d+))?$")


def version_priority(version: str) -> tuple:
    """Sort key implementing Kubernetes' version priority: v2 > v1 > v1beta2 > v1beta1 > v1alpha1,
    then anything non-conforming alphabetically."""
    m = _VERSION_RE.match(version)
    if not m:
        return (3, 0, 0, version)
    major, stage, minor = int(m.group(1)), m.group(2), int(m.group(3) or 0)
    rank = {None: 0, "beta": 1, "alpha": 2}[stage]
    return (rank, -major, -minor, version)


def resource_types_from_crd(crd: dict) -> list[ResourceType]:
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    types = []
    for ver in spec.get("versions") or []:
        if not ver.get("served", True):
            continue
        subs = ver.get("subresources") or {}
        scale = None
        if "scale" in subs:
            sc = subs["scale"] or {}
            scale = ScaleSpec(
                spec_replicas_path=sc.get("specReplicasPath", ".spec.replicas"),
                status_replicas_path=sc.get("statusReplicasPath", ".status.replicas"),
                label_selector_path=sc.get("labelSelectorPath"),
            )
        selectable = tuple(
            f["jsonPath"].lstrip(".") for f in ver.get("selectableFields") or [] if "jsonPath" in f
        )
        types.append(ResourceType(
            group=spec.get("group", ""),
            version=ver["name"],
            plural=names.get("plural", ""),
            kind=names.get("kind", ""),
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            singular=names.get("singular") or names.get("kind", "").lower(),
            short_names=tuple(names.get("shortNames") or ()),
            categories=tuple(names.get("categories") or ()),
            status="status" in subs,
            scale=scale,
            crd=(crd.get("metadata") or {}).get("name"),
            list_kind=names.get("listKind") or "",
            field_selectors=selectable,
        ))
    return types


class Registry:
    """The set of served resource types, built-in and CRD-defined."""

    def __init__(self, builtins: Iterable[ResourceType] = BUILTINS) -> None:
        self._types: dict[tuple[str, str, str], ResourceType] = {}
        for rt in builtins:
            self._types[(rt.group, rt.version, rt.plural)] = rt

    def find(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self._types.get((group, version, plural))

    def by_key(self, key: tuple[str, str]) -> list[ResourceType]:
        return [rt for rt in self._types.values() if rt.key == key]

    def all(self) -> list[ResourceType]:
        return list(self._types.values())

    def builtin_keys(self) -> set[tuple[str, str]]:
        return {rt.key for rt in self._types.values() if rt.crd is None}

    def register_crd(self, crd_name: str, types: list[ResourceType]) -> None:
        self.unregister_crd(crd_name)
        for rt in types:
            self._types[(rt.group, rt.version, rt.plural)] = rt

    def unregister_crd(self, crd_name: str) -> list[ResourceType]:
        gone = [k for k, rt in self._types.items() if rt.crd == crd_name]
        return [self._types.pop(k) for k in gone]

    def group_versions(self) -> dict[str, list[str]]:
        """group -> versions, highest priority first (the first one is the preferred version)."""
        out: dict[str, set[str]] = {}
        for rt in self._types.values():
            out.setdefault(rt.group, set()).add(rt.version)
        return {g: sorted(vs, key=version_priority) for g, vs in out.items()}

    # Discovery documents --------------------------------------------------------------------

    def api_versions(self, server_address: str) -> dict:
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": server_address},
            ],
        }

    def api_group(self, group: str) -> dict | None:
        versions = self.group_versions().get(group)
        if not versions or not group:
            return None
        entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {
            "kind": "APIGroup", "apiVersion": "v1", "name": group,
            "versions": entries, "preferredVersion": entries[0],
        }

    def api_group_list(self) -> dict:
        groups = []
        for group in sorted(g for g in self.group_versions() if g):
            doc = self.api_group(group)
            assert doc is not None
            del doc["kind"], doc["apiVersion"]
            groups.append(doc)
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}

    def api_resource_list(self, group: str, version: str) -> dict | None:
        types = sorted(
            (rt for rt in self._types.values() if rt.group == group and rt.version == version),
            key=lambda rt: rt.plural,
        )
        if not types:
            return None
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": [entry for rt in types for entry in rt.discovery_entries()],
        }
