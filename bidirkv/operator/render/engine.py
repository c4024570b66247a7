"""The engine children of a DisaggregatedInference: per role a headless Service, a
StatefulSet of vLLM pods and a PodDisruptionBudget (pure)."""

from __future__ import annotations

import json
from typing import Any

from bidirkv.operator.api import spec as api
from bidirkv.operator.api.pod import ModelCacheSpec
from bidirkv.operator.render.drain import UPDATE_STRATEGY, drain_env, grace_seconds
from bidirkv.operator.render.handlekey import key_env
from bidirkv.operator.render.naming import (
    Owner,
    child_metadata,
    child_name,
    config_hash,
    labels,
    selector_labels,
)
from bidirkv.roleconfig import (
    ENGINE_PORT,
    POD,
    Listen,
    RoleConfigError,
    build_role_config,
    kv_fingerprint,
)

FINGERPRINT_LABEL = "bidirkv.io/kv-fingerprint"
CONFIG_HASH_ANNOTATION = "bidirkv.io/config-hash"

# Model loads of large checkpoints take many minutes; the startup probe must outlast
# them (here up to 60 min) while liveness stays quick once the server is up.
STARTUP_PERIOD_SECONDS = 10
STARTUP_FAILURE_THRESHOLD = 360


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


def http_probe(path: str, period: int, failures: int, timeout: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def _model_cache_env(spec: api.DisaggregatedInferenceSpec, role: str,
                     cache: ModelCacheSpec | None) -> list[dict[str, Any]]:
    if cache is None:
        return []
    for where, env in (("engine", spec.engine.extra_env), (role, getattr(spec, role).extra_env)):
        for i, var in enumerate(env):
            if var.name == "HF_HOME":
                raise api.SpecError(
                    f"spec.{where}.extraEnv[{i}].name: 'HF_HOME' is set by modelCache (to "
                    f"{cache.mount_path!r}); change modelCache.mountPath instead")
    return [{"name": "HF_HOME", "value": cache.mount_path}]


def _volumes(spec: api.DisaggregatedInferenceSpec, role: str,
             cache: ModelCacheSpec | None) -> tuple[list[dict], list[dict]]:
    """The pod's volumes and the engine container's mounts."""
    volumes: list[dict[str, Any]] = [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.efa.shm_size}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "shm", "mountPath": "/dev/shm"}]
    if spec.efa.enabled and spec.efa.hugepages_2mi:
        volumes.append({"name": "hugepages", "emptyDir": {"medium": "HugePages-2Mi"}})
        mounts.append({"name": "hugepages", "mountPath": "/hugepages"})
    if cache is not None:
        volumes.append({"name": "model-cache", **cache.volume_source()})
        mounts.append({"name": "model-cache", "mountPath": cache.mount_path})
    volumes += [dict(v) for v in spec.engine.extra_volumes]
    mounts += [dict(m) for m in spec.engine.extra_volume_mounts]
    paths = [m["mountPath"].rstrip("/") or "/" for m in mounts]
    for path in paths:
        if paths.count(path) > 1:
            raise api.SpecError(f"spec.engine.extraVolumeMounts: {path!r} is mounted twice "
                                "(by the model cache or another mount)")
    return volumes, mounts


def _pod_settings(spec: api.DisaggregatedInferenceSpec, role: str) -> dict[str, Any]:
    """Pod-level fields the spec passes through as the user wrote them."""
    engine, role_spec = spec.engine, getattr(spec, role)
    out: dict[str, Any] = {}
    if engine.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": s.name} for s in engine.image_pull_secrets]
    if engine.service_account_name:
        out["serviceAccountName"] = engine.service_account_name
    if engine.priority_class_name:
        out["priorityClassName"] = engine.priority_class_name
    if role_spec.node_selector:
        out["nodeSelector"] = dict(role_spec.node_selector)
    if role_spec.tolerations:
        out["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in role_spec.tolerations
        ]
    if role_spec.topology_spread_constraints:
        out["topologySpreadConstraints"] = [dict(c) for c in role_spec.topology_spread_constraints]
    return out


def engine_security_context(efa: bool) -> dict[str, Any]:
    """No capability but what EFA needs (IPC_LOCK: registering memory with the device),
    no privilege escalation. Not runAsNonRoot: vLLM's official image, the engine image's
    base, runs as root and writes its caches (Hugging Face, torch compile) under /root."""
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if efa:
        caps["add"] = ["IPC_LOCK"]
    return {"allowPrivilegeEscalation": False, "capabilities": caps}


def engine_pod_template(
    owner: Owner, spec: api.DisaggregatedInferenceSpec, role: str, listen: Listen = POD
) -> dict[str, Any]:
    role_spec = getattr(spec, role)
    try:
        rc = build_role_config(spec, role, listen)
    except RoleConfigError as exc:
        raise api.SpecError(str(exc)) from None
    cache = role_spec.model_cache or spec.engine.model_cache
    volumes, mounts = _volumes(spec, role, cache)
    container: dict[str, Any] = {
        "name": "vllm",
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["bidir-kv", "serve", "--role", role, "--"],
        "args": rc.args,
        "env": [*rc.env, *drain_env(spec, role), *_model_cache_env(spec, role, cache),
                *key_env(owner)],
        "ports": [
            {"name": name, "containerPort": port, "protocol": "TCP"}
            for name, port in rc.ports.items()
        ],
        "startupProbe": http_probe(
            "/health", STARTUP_PERIOD_SECONDS, STARTUP_FAILURE_THRESHOLD, 5
        ),
        # /v1/models answers only once the engine serves the model.
        "readinessProbe": http_probe("/v1/models", 10, 3, 5),
        "livenessProbe": http_probe("/health", 20, 3, 10),
        "volumeMounts": mounts,
    }
    if spec.engine.env_from:
        container["envFrom"] = [dict(e) for e in spec.engine.env_from]
    resources = _resources(spec, role)
    if resources:
        container["resources"] = resources
    container["securityContext"] = engine_security_context(spec.efa.enabled)
    pod_spec: dict[str, Any] = {
        # The launcher drains first (render/drain.py), then vLLM stops.
        "terminationGracePeriodSeconds": grace_seconds(spec, role),
        # Engines never call the Kubernetes API: no token to steal from them.
        "automountServiceAccountToken": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
        **_pod_settings(spec, role),
    }
    affinity = _affinity(owner, spec, role)
    if affinity:
        pod_spec["affinity"] = affinity
    pod_labels = {**spec.engine.pod_labels, **labels(owner, role),
                  FINGERPRINT_LABEL: kv_fingerprint(spec)}
    annotations = {**spec.engine.pod_annotations,
                   CONFIG_HASH_ANNOTATION: config_hash([pod_labels, pod_spec])}
    return {"metadata": {"labels": pod_labels, "annotations": annotations}, "spec": pod_spec}


def engine_statefulset(
    owner: Owner, spec: api.DisaggregatedInferenceSpec, role: str, listen: Listen = POD
) -> dict[str, Any]:
    replicas = getattr(spec, role).fixed_replicas()
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": child_metadata(owner, role),
        "spec": {
            "serviceName": child_name(owner, role),
            # Autoscaled: left out, so the operator never writes over the autoscaler's
            # choice (reconcile/diff.py keeps the live value on a replace).
            **({"replicas": replicas} if replicas is not None else {}),
            # Engines load independently; ordered start would serialise model loads.
            "podManagementPolicy": "Parallel",
            # Updates are not affected by Parallel: one pod at a time, each drained.
            "updateStrategy": UPDATE_STRATEGY,
            "selector": {"matchLabels": selector_labels(owner, role)},
            "template": engine_pod_template(owner, spec, role, listen),
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
