"""Pure rendering: a DisaggregatedInference -> every child object the operator owns.

No I/O here, so every rendering rule is tested without an API server and
`bidir-kv render -f FILE` prints exactly what the operator would write.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from bidirkv.roleconfig import (
    ENGINE_PORT,
    POD,
    ROLES,
    Placement,
    RoleConfigError,
    build_role_config,
    kv_fingerprint,
)

from . import spec as api
from .crd import MAX_NAME_LENGTH
from .handlekey import key_env
from .netpol import network_policies

APP = "bidir-kv"
MANAGED_BY = "bidir-kv-operator"
FINGERPRINT_LABEL = "bidirkv.io/kv-fingerprint"
CONFIG_HASH_ANNOTATION = "bidirkv.io/config-hash"
ROUTER_CONFIG_KEY = "router.json"
ROUTER_CONFIG_DIR = "/etc/bidir-kv"
ROUTER_CONTAINER_PORT = 8000

# Model loads of large checkpoints take many minutes; the startup probe must outlast
# them (here up to 60 min) while liveness stays quick once the server is up.
STARTUP_PERIOD_SECONDS = 10
STARTUP_FAILURE_THRESHOLD = 360


@dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str


def _hash(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def selector_labels(owner: Owner, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": APP,
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/component": component,
    }


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


def _resources(spec: api.DisaggregatedInferenceSpec, role: str) -> dict[str, Any]:
    role_spec = getattr(spec, role)
    requests = {k: v for k, v in role_spec.resources.requests.items()}
    limits = {k: v for k, v in role_spec.resources.limits.items()}
    if role_spec.efa_devices:
        requests["vpc.amazonaws.com/efa"] = limits["vpc.amazonaws.com/efa"] = (
            role_spec.efa_devices
        )
    if spec.efa.enabled and spec.efa.hugepages_2mi:
        # Hugepages must be requested and limited alike.
        requests["hugepages-2Mi"] = limits["hugepages-2Mi"] = spec.efa.hugepages_2mi
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _affinity(owner: Owner, spec: api.DisaggregatedInferenceSpec, role: str) -> dict[str, Any]:
    affinity = json.loads(json.dumps(getattr(spec, role).affinity))
    if not spec.efa.enabled:
        return affinity
    # EFA has no same-host loopback: a prefill and a decode pod of one instance must not
    # share a node.
    other = "decode" if role == "prefill" else "prefill"
    term = {
        "labelSelector": {"matchLabels": selector_labels(owner, other)},
        "topologyKey": "kubernetes.io/hostname",
    }
    anti = affinity.setdefault("podAntiAffinity", {})
    anti.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(term)
    return affinity


def _http_probe(path: str, period: int, failures: int, timeout: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def engine_pod_template(
    owner: Owner, spec: api.DisaggregatedInferenceSpec, role: str, placement: Placement = POD
) -> dict[str, Any]:
    role_spec = getattr(spec, role)
    try:
        rc = build_role_config(spec, role, placement)
    except RoleConfigError as exc:
        raise api.SpecError(str(exc)) from None
    container: dict[str, Any] = {
        "name": "vllm",
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["bidir-kv", "serve", "--role", role, "--"],
        "args": rc.args,
        "env": [*rc.env, *key_env(owner.name)],
        "ports": [
            {"name": name, "containerPort": port, "protocol": "TCP"}
            for name, port in rc.ports.items()
        ],
        "startupProbe": _http_probe(
            "/health", STARTUP_PERIOD_SECONDS, STARTUP_FAILURE_THRESHOLD, 5
        ),
        # /v1/models answers only once the engine serves the model.
        "readinessProbe": _http_probe("/v1/models", 10, 3, 5),
        "livenessProbe": _http_probe("/health", 20, 3, 10),
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
    }
    resources = _resources(spec, role)
    if resources:
        container["resources"] = resources
    volumes: list[dict[str, Any]] = [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.efa.shm_size}}
    ]
    if spec.efa.enabled:
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
        if spec.efa.hugepages_2mi:
            volumes.append({"name": "hugepages", "emptyDir": {"medium": "HugePages-2Mi"}})
            container["volumeMounts"].append({"name": "hugepages", "mountPath": "/hugepages"})
    pod_spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 60,
        # Engines never call the Kubernetes API: no token to steal from them.
        "automountServiceAccountToken": False,
        "containers": [container],
        "volumes": volumes,
    }
    if role_spec.node_selector:
        pod_spec["nodeSelector"] = dict(role_spec.node_selector)
    if role_spec.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in role_spec.tolerations
        ]
    affinity = _affinity(owner, spec, role)
    if affinity:
        pod_spec["affinity"] = affinity
    pod_labels = {**labels(owner, role), FINGERPRINT_LABEL: kv_fingerprint(spec)}
    return {
        "metadata": {
            "labels": pod_labels,
            "annotations": {CONFIG_HASH_ANNOTATION: _hash([pod_labels, pod_spec])},
        },
        "spec": pod_spec,
    }


def engine_statefulset(
    owner: Owner, spec: api.DisaggregatedInferenceSpec, role: str, placement: Placement = POD
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": child_metadata(owner, role),
        "spec": {
            "serviceName": child_name(owner, role),
            "replicas": getattr(spec, role).replicas,
            # Engines load independently; ordered start would serialise model loads.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector_labels(owner, role)},
            "template": engine_pod_template(owner, spec, role, placement),
        },
    }


def engine_service(owner: Owner, spec: api.DisaggregatedInferenceSpec, role: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, role),
        "spec": {
            "clusterIP": "None",
            # Peers handshake over the NIXL side channel while a pod is not yet Ready.
            "publishNotReadyAddresses": True,
            "selector": selector_labels(owner, role),
            "ports": [
                {"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"},
                {
                    "name": "nixl",
                    "port": spec.kv_transfer.side_channel_port,
                    "targetPort": "nixl",
                    "protocol": "TCP",
                },
            ],
        },
    }


def pod_disruption_budget(owner: Owner, role: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(owner, role),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner, role)}},
    }


def router_config(owner: Owner, spec: api.DisaggregatedInferenceSpec) -> dict[str, Any]:
    """What the router reads from its ConfigMap (reloaded on change, no restart)."""
    return {
        "prefill": engine_endpoints(owner, "prefill", spec.prefill.replicas),
        "decode": engine_endpoints(owner, "decode", spec.decode.replicas),
        "model": spec.model.served_name or spec.model.name,
        "bidirectional": spec.kv_transfer.bidirectional,
        "conversationTtlSeconds": spec.router.conversation_ttl_seconds,
        "decoderKvBlocksTtlSeconds": spec.kv_transfer.decoder_kv_blocks_ttl_seconds,
        "safetyMarginSeconds": api.TTL_SAFETY_MARGIN_SECONDS,
        "maxConversations": spec.router.max_conversations,
        "kvRecomputeThreshold": spec.kv_transfer.kv_recompute_threshold,
        "retentionWatermark": spec.kv_transfer.retention_watermark,
        "ownerLeaseSeconds": spec.kv_transfer.owner_lease_seconds,
        "kvFingerprint": kv_fingerprint(spec),
        **({"handleStore": spec.router.handle_store.url} if spec.router.handle_store else {}),
    }


def router_configmap(owner: Owner, spec: api.DisaggregatedInferenceSpec) -> dict[str, Any]:
    body = json.dumps(router_config(owner, spec), indent=2, sort_keys=True)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(owner, "router"),
        "data": {ROUTER_CONFIG_KEY: body + "\n"},
    }


def _store_password_env(spec: api.DisaggregatedInferenceSpec) -> list[dict[str, Any]]:
    store = spec.router.handle_store
    if store is None or store.password_secret_ref is None:
        return []
    ref = store.password_secret_ref
    return [{"name": "BIDIRKV_HANDLE_STORE_PASSWORD",
             "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


@dataclass(frozen=True)
class RouterPlacement:
    """Where the router reads its config and listens (the local stack gives its own)."""

    config_path: str = f"{ROUTER_CONFIG_DIR}/{ROUTER_CONFIG_KEY}"
    bind_host: str = "0.0.0.0"
    port: int = ROUTER_CONTAINER_PORT


def router_deployment(owner: Owner, spec: api.DisaggregatedInferenceSpec,
                      placement: RouterPlacement = RouterPlacement()) -> dict[str, Any]:
    container = {
        "name": "router",
        "image": spec.router.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["bidir-kv", "router"],
        "args": [
            "--config", placement.config_path,
            "--host", placement.bind_host,
            "--port", str(placement.port),
        ],
        "ports": [{"name": "http", "containerPort": placement.port, "protocol": "TCP"}],
        # The key signs the router's proof on decode legs (bidirkv/proof.py).
        "env": key_env(owner.name) + _store_password_env(spec),
        "readinessProbe": _http_probe("/ready", 5, 2, 3),
        "livenessProbe": _http_probe("/health", 10, 3, 5),
        "resources": {
            "requests": {"cpu": "500m", "memory": "256Mi"},
            "limits": {"memory": "1Gi"},
        },
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "config", "mountPath": ROUTER_CONFIG_DIR, "readOnly": True}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(owner, "router"),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": selector_labels(owner, "router")},
            "template": {
                "metadata": {"labels": labels(owner, "router")},
                "spec": {
                    "automountServiceAccountToken": False,
                    "containers": [container],
                    "volumes": [
                        {"name": "config",
                         "configMap": {"name": child_name(owner, "router")}}
                    ],
                },
            },
        },
    }


def router_service(owner: Owner, spec: api.DisaggregatedInferenceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, "router"),
        "spec": {
            "type": spec.router.service_type,
            "selector": selector_labels(owner, "router"),
            "ports": [
                {"name": "http", "port": spec.router.port, "targetPort": "http",
                 "protocol": "TCP"}
            ],
        },
    }


def name_errors(owner: Owner) -> list[str]:
    if len(owner.name) > MAX_NAME_LENGTH:
        return [
            f"metadata.name: {owner.name!r} has {len(owner.name)} characters; at most "
            f"{MAX_NAME_LENGTH} are allowed"
        ]
    return []


def render(owner: Owner, spec: api.DisaggregatedInferenceSpec) -> list[dict[str, Any]]:
    """Every child object, in the order they are best created (config before users)."""
    errors = name_errors(owner)
    if errors:
        raise api.SpecError("; ".join(errors))
    children: list[dict[str, Any]] = []
    for role in ROLES:
        children += [
            engine_service(owner, spec, role),
            engine_statefulset(owner, spec, role),
            pod_disruption_budget(owner, role),
        ]
    children += [
        router_configmap(owner, spec),
        router_deployment(owner, spec),
        router_service(owner, spec),
    ]
    instance = {k: v for k, v in selector_labels(owner, "router").items()
                if k != "app.kubernetes.io/component"}
    children += network_policies(lambda c: child_metadata(owner, c), instance,
                                 selector_labels(owner, "router"), ROUTER_CONTAINER_PORT, spec)
    return children


def render_resource(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """Render from a whole DisaggregatedInference object (as read from a file or the API)."""
    meta = obj.get("metadata") or {}
    if not meta.get("name"):
        raise api.SpecError("metadata.name: missing; a DisaggregatedInference needs a name")
    owner = Owner(
        name=meta["name"],
        namespace=meta.get("namespace") or "default",
        uid=meta.get("uid") or "00000000-0000-0000-0000-000000000000",
    )
    return render(owner, api.parse_spec(obj.get("spec") or {}))
