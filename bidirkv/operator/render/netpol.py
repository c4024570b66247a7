"""NetworkPolicies that isolate a resource's engines (pure rendering).

- Engines accept HTTP (port 8000) only from this resource's router pods, the
  `metricsFrom` peers and the operator's pods: a forged handle or a direct request needs
  that port. The operator reads a draining decode pod's /metrics there, for the
  conversations it still holds (operator/reconcile/heldcount.py). Its pods are picked by
  the labels the chart gives them (charts/bidir-kv/templates/deployment.yaml) in the
  operator's own namespace, which the chart passes in (POD_NAMESPACE, operator/main.py);
  a podSelector alone would match only the engines' namespace, and beside an empty
  namespaceSelector any pod so labelled in any namespace. Not told its namespace (run
  by hand), the rule admits pods so labelled in the engines' namespace only.
- Engines accept anything from this resource's other engine pods: the NIXL side channel
  has a fixed port, but UCX (and libfabric over TCP) pick their transfer ports at run
  time, so the policy cannot name them.
- The router accepts its port from `routerFrom`, or from anyone when that is empty, and
  its metrics port from the `metricsFrom` peers only.
EFA (SRD) traffic bypasses the IP stack, so no NetworkPolicy sees it; on EFA, isolation
of the KV transport is the security groups' job.
"""

from __future__ import annotations

import re
from typing import Any

from bidirkv.operator.api import spec as api
from bidirkv.roleconfig import ENGINE_PORT, ROLES

# The operator's pods, as the chart labels them (whatever its name or release).
OPERATOR_POD_LABELS = {"app.kubernetes.io/part-of": "bidir-kv",
                       "app.kubernetes.io/component": "operator"}
# The label the API server gives every namespace (Kubernetes 1.22 on): its name.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
# A namespace name is a DNS-1123 label.
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def namespace_error(value: str) -> str | None:
    """Why `value` cannot be a namespace's name, or None."""
    if len(value) > 63 or not _NAMESPACE.match(value):
        return (f"{value!r} is not a namespace name (up to 63 of a-z 0-9 -, starting and "
                "ending alphanumeric)")
    return None


def operator_peer(operator_namespace: str | None) -> dict[str, Any]:
    """The operator's pods in `operator_namespace`; when None, in the engines' own."""
    peer: dict[str, Any] = {"podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}}
    if operator_namespace is not None:
        peer["namespaceSelector"] = {"matchLabels": {NAMESPACE_NAME_LABEL: operator_namespace}}
    return peer


def _peers(peers: list[api.PolicyPeer]) -> list[dict[str, Any]]:
    out = []
    for p in peers:
        d = p.model_dump(by_alias=True, exclude_none=True)
        for sel in d.values():
            for k in ("matchLabels", "matchExpressions"):
                if not sel.get(k):
                    sel.pop(k, None)
        out.append(d)
    return out


def engine_selector(instance_labels: dict[str, str]) -> dict[str, Any]:
    return {"matchLabels": instance_labels,
            "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                                  "values": list(ROLES)}]}


def network_policies(metadata: Any, instance_labels: dict[str, str],
                     router_labels: dict[str, str], router_port: int, metrics_port: int,
                     spec: api.DisaggregatedInferenceSpec, *,
                     operator_namespace: str | None) -> list[dict[str, Any]]:
    """`metadata(component)` gives a child's metadata; labels select this resource's pods;
    `operator_namespace`: where the operator's pods run (None: unknown)."""
    np = spec.network_policy
    if not np.enabled:
        return []
    engines = engine_selector(instance_labels)
    engine_policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata("engines"),
        "spec": {
            "podSelector": engines,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": engines}]},
                {"from": [{"podSelector": {"matchLabels": router_labels}},
                          *_peers(np.metrics_from), operator_peer(operator_namespace)],
                 "ports": [{"protocol": "TCP", "port": ENGINE_PORT}]},
            ],
        },
    }
    rule: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": router_port}]}
    if np.router_from:
        rule["from"] = _peers(np.router_from)
    rules = [rule]
    if np.metrics_from:
        rules.append({"from": _peers(np.metrics_from),
                      "ports": [{"protocol": "TCP", "port": metrics_port}]})
    router_policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata("router"),
        "spec": {
            "podSelector": {"matchLabels": router_labels},
            "policyTypes": ["Ingress"],
            "ingress": rules,
        },
    }
    return [engine_policy, router_policy]
