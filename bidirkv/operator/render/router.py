"""The router children of a DisaggregatedInference: its ConfigMap, Deployment and Service
(pure)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bidirkv.knobs import (
    TTL_SAFETY_MARGIN_SECONDS,
    KvKnobs,
    RouterKnobs,
    Section,
    TracingKnobs,
)
from bidirkv.operator.api import spec as api
from bidirkv.operator.render.autoscaling import role_replicas
from bidirkv.operator.render.engine import http_probe
from bidirkv.operator.render.handlekey import key_env
from bidirkv.operator.render.naming import (
    Owner,
    child_metadata,
    child_name,
    engine_endpoints,
    labels,
    selector_labels,
)
from bidirkv.roleconfig import kv_fingerprint, otlp_headers_env

ROUTER_CONFIG_KEY = "router.json"
ROUTER_CONFIG_DIR = "/etc/bidir-kv"
ROUTER_CONTAINER_PORT = 8000
# /metrics is served here, not on the client port: a scraper needs no access to the port
# conversations go through, and the NetworkPolicy can tell the two apart.
ROUTER_METRICS_PORT = 9090


# Router keys the CRD does not set, and what they are instead: derived from the resource,
# or fixed here (tests/test_knob_rules.py: every other key comes from a CRD field).
DERIVED_ROUTER_KEYS = {
    "prefill": "the prefill pods' addresses",
    "decode": "the decode pods' addresses",
    "model": "model.servedName, else model.name",
    "kvFingerprint": "the hash of what prefill and decode share (kv_fingerprint)",
    "handleStore": "router.handleStore.url",
}
FIXED_ROUTER_KEYS = {
    "safetyMarginSeconds": f"{TTL_SAFETY_MARGIN_SECONDS} s: prefill declines a read this "
    "close to decode's deadline, so a handle stops being handed out this much earlier",
    "tracing.file": "unset: a pod's spans go to monitoring.tracing.otlpEndpoint (the local "
    "stack writes them to a file)",
    "tracing.serviceName": "bidir-kv-router, as the engines are bidir-kv-prefill and "
    "bidir-kv-decode",
}


def _knobs(section: Section, knobs: type[Section]) -> dict[str, Any]:
    """The section's shared knobs under the router's keys, which are the CRD's."""
    return section.model_dump(mode="json", by_alias=True, include=set(knobs.model_fields),
                              exclude_none=True)


def listed_replicas(spec: api.DisaggregatedInferenceSpec, role: str,
                    observed: Mapping[str, int] | None = None) -> int:
    """The replicas of a role the router lists: those the role runs, and more while pods a
    scale-down removed are still there. A leaving pod drains (bidirkv/connector/drain.py);
    a router that no longer listed it would forget the conversations it holds before they
    could move."""
    return max(role_replicas(spec, role, observed), (observed or {}).get(role, 0))


def router_config(owner: Owner, spec: api.DisaggregatedInferenceSpec,
                  observed: Mapping[str, int] | None = None) -> dict[str, Any]:
    """What the router reads from its ConfigMap (reloaded on change, no restart).
    `observed`: the pods each role's StatefulSet was last seen with (listed_replicas)."""
    return {
        "prefill": engine_endpoints(owner, "prefill", listed_replicas(spec, "prefill", observed)),
        "decode": engine_endpoints(owner, "decode", listed_replicas(spec, "decode", observed)),
        "model": spec.model.served_name or spec.model.name,
        **_knobs(spec.router, RouterKnobs),
        **_knobs(spec.kv_transfer, KvKnobs),
        "safetyMarginSeconds": TTL_SAFETY_MARGIN_SECONDS,
        "kvFingerprint": kv_fingerprint(spec),
        **({"handleStore": spec.router.handle_store.url} if spec.router.handle_store else {}),
        **_tracing(spec),
    }


def _tracing(spec: api.DisaggregatedInferenceSpec) -> dict[str, Any]:
    tracing = spec.monitoring.tracing
    if tracing.otlp_endpoint is None:
        # No exporter: the router still passes a client's traceparent to the engines.
        return {}
    return {"tracing": _knobs(tracing, TracingKnobs)}


def router_configmap(owner: Owner, spec: api.DisaggregatedInferenceSpec,
                     observed: Mapping[str, int] | None = None) -> dict[str, Any]:
    body = json.dumps(router_config(owner, spec, observed), indent=2, sort_keys=True)
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
class RouterListen:
    """Where the router reads its config and listens (the local stack gives its own)."""

    config_path: str = f"{ROUTER_CONFIG_DIR}/{ROUTER_CONFIG_KEY}"
    bind_host: str = "0.0.0.0"
    port: int = ROUTER_CONTAINER_PORT
    # None: /metrics on the client port (the local stack: one user, one machine).
    metrics_port: int | None = ROUTER_METRICS_PORT


def router_deployment(owner: Owner, spec: api.DisaggregatedInferenceSpec,
                      listen: RouterListen = RouterListen()) -> dict[str, Any]:
    container = {
        "name": "router",
        "image": spec.router.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["bidir-kv", "router"],
        "args": [
            "--config", listen.config_path,
            "--host", listen.bind_host,
            "--port", str(listen.port),
        ],
        "ports": [{"name": "http", "containerPort": listen.port, "protocol": "TCP"}],
        # The key signs the router's proof on decode legs (bidirkv/proof.py).
        "env": key_env(owner) + _store_password_env(spec) + otlp_headers_env(spec),
        "readinessProbe": http_probe("/ready", 5, 2, 3),
        "livenessProbe": http_probe("/health", 10, 3, 5),
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
    if listen.metrics_port is not None:
        container["args"] += ["--metrics-port", str(listen.metrics_port)]
        container["ports"].append({"name": "metrics", "containerPort": listen.metrics_port,
                                   "protocol": "TCP"})
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
