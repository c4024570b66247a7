"""`bidir-kv crd --apply`: create or replace the CRD in a cluster.

`helm upgrade` never updates files under a chart's `crds/`; the chart's hook Job runs
this instead. A full replace (PUT with the stored resourceVersion, retried on a
conflict) so fields this version removed go too; labels and annotations others added are
kept. Needs `get` and `update` on this one CRD (and `create` only where it is missing).
"""

from __future__ import annotations

import sys

import kubernetes

from bidirkv.operator.crd.schema import build_crd
from bidirkv.operator.kube import ApiError, load_configuration, request

CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def apply_crd(api: kubernetes.client.ApiClient, attempts: int = 5) -> str:
    """'created', 'configured' or 'unchanged'."""
    crd = build_crd()
    name = crd["metadata"]["name"]
    for _ in range(attempts):
        try:
            current = request(api, "GET", f"{CRD_PATH}/{name}")
        except ApiError as exc:
            if exc.status != 404:
                raise
            request(api, "POST", CRD_PATH, crd)
            return "created"
        meta = current["metadata"]
        body = {**crd, "metadata": {
            **crd["metadata"],
            "labels": {**(meta.get("labels") or {}), **crd["metadata"].get("labels", {})},
            "annotations": meta.get("annotations") or {},
            "resourceVersion": meta["resourceVersion"],
        }}
        body["metadata"] = {k: v for k, v in body["metadata"].items() if v != {}}
        try:
            updated = request(api, "PUT", f"{CRD_PATH}/{name}", body)
        except ApiError as exc:
            if exc.status == 409:
                continue
            raise
        same = updated["metadata"]["resourceVersion"] == meta["resourceVersion"]
        return "unchanged" if same else "configured"
    raise ApiError(409, "Conflict", "the CRD kept changing; try again")


def apply_crd_cli(kubeconfig: str | None) -> int:
    name = build_crd()["metadata"]["name"]
    try:
        with kubernetes.client.ApiClient(load_configuration(kubeconfig)) as api:
            result = apply_crd(api)
    except ApiError as exc:
        print(f"bidir-kv crd --apply: {name}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - no kubeconfig, unreachable server, ...
        print(f"bidir-kv crd --apply: {exc}", file=sys.stderr)
        return 1
    print(f"customresourcedefinition.apiextensions.k8s.io/{name} {result}")
    return 0
