"""Names, labels and owner references of the children of a DisaggregatedInference (pure)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from bidirkv.operator.api import spec as api
from bidirkv.roleconfig import ENGINE_PORT

APP = "bidir-kv"
MANAGED_BY = "bidir-kv-operator"


@dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str
    # The Secret holding the handle key, as the status records it (handlekey.py); None
    # until the operator created one.
    handle_key: str | None = None


def config_hash(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def instance_labels(owner: Owner) -> dict[str, str]:
    """What every pod of the resource carries, whatever its component."""
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/instance": owner.name}


def selector_labels(owner: Owner, component: str) -> dict[str, str]:
    return {**instance_labels(owner), "app.kubernetes.io/component": component}


def labels(owner: Owner, component: str) -> dict[str, str]:
    return {**selector_labels(owner, component), "app.kubernetes.io/managed-by": MANAGED_BY}


def selector_string(owner: Owner, component: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(owner, component).items())


def child_name(owner: Owner, component: str) -> str:
    return f"{owner.name}-{component}"


def child_metadata(owner: Owner, component: str, name: str | None = None) -> dict[str, Any]:
    return {
        "name": name or child_name(owner, component),
        "namespace": owner.namespace,
        "labels": labels(owner, component),
        "ownerReferences": [
            {
                "apiVersion": f"{api.GROUP}/{api.VERSION}",
                "kind": api.KIND,
                "name": owner.name,
                "uid": owner.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def engine_endpoints(owner: Owner, role: str, replicas: int) -> list[str]:
    svc = child_name(owner, role)
    return [
        f"http://{svc}-{i}.{svc}.{owner.namespace}.svc:{ENGINE_PORT}" for i in range(replicas)
    ]


def router_url(owner: Owner, spec: api.DisaggregatedInferenceSpec) -> str:
    return f"http://{child_name(owner, 'router')}.{owner.namespace}.svc:{spec.router.port}"
