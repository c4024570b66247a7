"""A small typed door to the Kubernetes API through the official client.

The official client's per-kind methods would need one call site per kind; the operator
writes seven kinds the same way, so it goes through `ApiClient.call_api` with paths
built from a kind table. Calls run in a thread so the kopf event loop never blocks.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from dataclasses import dataclass
from typing import Any

import kubernetes

from bidirkv.operator.api import spec as api


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    @property
    def base(self) -> str:
        return "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"

    def path(self, namespace: str | None, name: str | None = None, sub: str | None = None):
        parts = [self.base]
        if self.namespaced and namespace:
            parts.append(f"namespaces/{namespace}")
        parts.append(self.plural)
        if name:
            parts.append(name)
        if sub:
            parts.append(sub)
        return "/".join(parts)


KINDS = {
    k.kind: k
    for k in [
        Kind("v1", "Service", "services"),
        Kind("v1", "ConfigMap", "configmaps"),
        Kind("v1", "Event", "events"),
        Kind("v1", "Pod", "pods"),
        Kind("apps/v1", "StatefulSet", "statefulsets"),
        Kind("apps/v1", "Deployment", "deployments"),
        Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
        Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
        Kind("v1", "Secret", "secrets"),
        Kind("monitoring.coreos.com/v1", "PodMonitor", "podmonitors"),
        Kind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
        Kind("keda.sh/v1alpha1", "ScaledObject", "scaledobjects"),
        Kind(f"{api.GROUP}/{api.VERSION}", api.KIND, api.PLURAL),
    ]
}


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


def request(api_client: kubernetes.client.ApiClient, method: str, path: str, body: Any = None,
            content_type: str | None = None) -> Any:
    """One request through the official client, authenticated as its generated methods
    are (bearer token, refreshed in-cluster tokens, client certificates); raises ApiError.

    `ApiClient.call_api` alone sends no credentials: they are added when a request is
    serialized (`param_serialize`)."""
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = content_type or "application/json"
    params = api_client.param_serialize(
        method=method, resource_path=path, header_params=headers, body=body,
        auth_settings=["BearerToken"],
    )
    resp = api_client.call_api(*params, _request_timeout=(5, 30))
    data = resp.read() if hasattr(resp, "read") else resp.data
    payload = json.loads(data) if data else {}
    if resp.status >= 400:
        raise ApiError(resp.status, payload.get("reason", ""), payload.get("message", str(payload)))
    return payload


class KubeClient:
    def __init__(self, configuration: kubernetes.client.Configuration):
        self.configuration = configuration
        self._client = kubernetes.client.ApiClient(configuration)
        self.writes = 0  # counted so a test or benchmark can see an idle pass write nothing

    def close(self) -> None:
        self._client.close()

    def _call(self, method: str, path: str, body: Any = None, content_type: str | None = None):
        return request(self._client, method, path, body, content_type)

    async def call(self, method: str, path: str, body: Any = None, content_type: str | None = None):
        if method != "GET":
            self.writes += 1
        return await asyncio.to_thread(self._call, method, path, body, content_type)

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.call("GET", KINDS[kind].path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str, label_selector: str
                   ) -> list[dict[str, Any]]:
        """The objects of `kind` in `namespace` that `label_selector` selects."""
        query = urllib.parse.urlencode({"labelSelector": label_selector})
        out = await self.call("GET", f"{KINDS[kind].path(namespace)}?{query}")
        return list(out.get("items") or [])

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        kind = KINDS[obj["kind"]]
        return await self.call("POST", kind.path(obj["metadata"]["namespace"]), obj)

    async def replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        kind, meta = KINDS[obj["kind"]], obj["metadata"]
        return await self.call("PUT", kind.path(meta["namespace"], meta["name"]), obj)

    async def delete(self, kind: str, namespace: str, name: str, uid: str) -> None:
        """Delete the object only while it is the one with `uid` (a precondition): one
        recreated under the same name by someone else is left alone."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}}
        try:
            await self.call("DELETE", KINDS[kind].path(namespace, name), body)
        except ApiError as exc:
            if exc.status not in (404, 409):
                raise

    async def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]):
        return await self.call(
            "PATCH",
            KINDS[kind].path(namespace, name, "status"),
            {"status": status},
            "application/merge-patch+json",
        )


def load_configuration(kubeconfig: str | None = None) -> kubernetes.client.Configuration:
    """In-cluster service account first (the normal case), else a kubeconfig file."""
    configuration = kubernetes.client.Configuration()
    if kubeconfig is None:
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
            return configuration
        except kubernetes.config.ConfigException:
            pass
    kubernetes.config.load_kube_config(
        config_file=kubeconfig, client_configuration=configuration
    )
    return configuration
