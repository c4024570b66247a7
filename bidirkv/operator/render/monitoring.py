"""The PodMonitor that scrapes a DisaggregatedInference's engines (pure)."""

from __future__ import annotations

from typing import Any

from bidirkv.operator.api import spec as api
from bidirkv.operator.render.naming import Owner, child_metadata, instance_labels
from bidirkv.operator.render.netpol import engine_selector

POD_MONITOR_API_VERSION = "monitoring.coreos.com/v1"
POD_MONITOR_COMPONENT = "engines"


def pod_monitor(owner: Owner, spec: api.DisaggregatedInferenceSpec) -> dict[str, Any] | None:
    """None unless spec.monitoring.podMonitor.enabled."""
    pm = spec.monitoring.pod_monitor
    if not pm.enabled:
        return None
    meta = child_metadata(owner, POD_MONITOR_COMPONENT)
    meta["labels"] = {**pm.labels, **meta["labels"]}
    endpoint: dict[str, Any] = {
        "port": "http",
        "path": "/metrics",
        "interval": pm.interval,
        # Dashboards and alerts split engines by role: the pod's component label.
        "relabelings": [{
            "sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"],
            "targetLabel": "role",
        }],
    }
    if pm.scrape_timeout is not None:
        endpoint["scrapeTimeout"] = pm.scrape_timeout
    return {
        "apiVersion": POD_MONITOR_API_VERSION,
        "kind": "PodMonitor",
        "metadata": meta,
        "spec": {
            "selector": engine_selector(instance_labels(owner)),
            "namespaceSelector": {"matchNames": [owner.namespace]},
            "podMetricsEndpoints": [endpoint],
        },
    }
