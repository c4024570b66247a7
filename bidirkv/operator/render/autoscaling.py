"""The autoscaler of each autoscaled role: an autoscaling/v2 HorizontalPodAutoscaler or a
KEDA ScaledObject on the role's StatefulSet, and how many pods such a role runs (pure).

Decode scales on its KV working set (`vllm:bidirkv_kv_working_set_ratio`, exported by the
engines: vLLM's KV usage counts the retained blocks decode would give up to new work, and
would scale decode up for conversations only kept for reuse). Prefill scales on its queue
or its TTFT. A decode pod that leaves drains what it holds, so decode scales down one pod
per grace period at most, and only on a need that stayed lower for a grace period.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

from bidirkv.operator.api import spec as api
from bidirkv.operator.api.autoscaling import AutoscalingEngine, AutoscalingSpec, ScaleMetric
from bidirkv.operator.render.drain import grace_seconds
from bidirkv.operator.render.naming import Owner, child_metadata, child_name

HPA_API_VERSION = "autoscaling/v2"
# A role has at most one of them, both named after the role's StatefulSet.
AUTOSCALER_KINDS = ("HorizontalPodAutoscaler", "ScaledObject")
SCALED_OBJECT_API_VERSION = "keda.sh/v1alpha1"
# The engines' gauge (bidirkv/connector/core/workingset.py; the operator may not import
# the connector, tests/test_autoscaling.py checks the two names agree).
KV_WORKING_SET_METRIC = "vllm:bidirkv_kv_working_set_ratio"
QUEUE_METRIC = "vllm:num_requests_waiting"
TTFT_METRIC = "vllm:time_to_first_token_seconds"
SERIES = {ScaleMetric.kv_working_set: KV_WORKING_SET_METRIC, ScaleMetric.queue: QUEUE_METRIC,
          ScaleMetric.ttft: TTFT_METRIC}
DEFAULT_TARGET = {ScaleMetric.kv_working_set: "700m", ScaleMetric.queue: "4",
                  ScaleMetric.ttft: "1"}
DEFAULT_METRIC = {"prefill": ScaleMetric.queue, "decode": ScaleMetric.kv_working_set}
# The HPA's bounds on a scaling policy's period.
MIN_SCALE_DOWN_PERIOD_S, MAX_SCALE_DOWN_PERIOD_S = 60, 1800
# The HPA's own scale-down stabilisation window, and its bound on any window.
DEFAULT_SCALE_DOWN_WINDOW_S, MAX_STABILIZATION_WINDOW_S = 300, 3600
TTFT_WINDOW = "1m"


def autoscaling_of(spec: api.DisaggregatedInferenceSpec, role: str) -> AutoscalingSpec | None:
    return getattr(spec, role).autoscaling


def metric_of(auto: AutoscalingSpec, role: str) -> ScaleMetric:
    return ScaleMetric(auto.metric) if auto.metric is not None else DEFAULT_METRIC[role]


def target_of(auto: AutoscalingSpec, role: str) -> str:
    return auto.average_value or DEFAULT_TARGET[metric_of(auto, role)]


def role_replicas(spec: api.DisaggregatedInferenceSpec, role: str,
                  observed: Mapping[str, int] | None = None) -> int:
    """Pods the role runs: the fixed count, or, when autoscaled, the pods its StatefulSet
    was last seen with (`observed`, by role: controller.py counts a leaving pod until it
    is gone), at least the autoscaler's minimum (all of it before the StatefulSet was
    seen)."""
    role_spec = getattr(spec, role)
    fixed = role_spec.fixed_replicas()
    if fixed is not None:
        return fixed
    auto = role_spec.autoscaling
    assert auto is not None
    return max(auto.min_replicas, (observed or {}).get(role, 0))


def _scale_target(owner: Owner, role: str) -> dict[str, str]:
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": child_name(owner, role)}


def behavior(spec: api.DisaggregatedInferenceSpec, role: str) -> dict[str, Any] | None:
    """Decode leaves one pod per grace period (drain.py): overlapping drains would move
    conversations onto pods that leave next. It scales down only on a need that stayed
    lower for a grace period: a StatefulSet makes no pod of an ordinal whose old pod
    still terminates, and a dip shorter than a drain should not remove a pod."""
    if role != "decode":
        return None
    grace = grace_seconds(spec, role)
    period = min(MAX_SCALE_DOWN_PERIOD_S, max(MIN_SCALE_DOWN_PERIOD_S, grace))
    window = min(MAX_STABILIZATION_WINDOW_S, max(DEFAULT_SCALE_DOWN_WINDOW_S, grace))
    return {"scaleDown": {"stabilizationWindowSeconds": window,
                          "policies": [{"type": "Pods", "value": 1, "periodSeconds": period}]}}


def horizontal_pod_autoscaler(owner: Owner, spec: api.DisaggregatedInferenceSpec,
                              role: str) -> dict[str, Any]:
    auto = autoscaling_of(spec, role)
    assert auto is not None
    name = auto.metric_name or SERIES[metric_of(auto, role)]
    hpa_spec: dict[str, Any] = {
        "scaleTargetRef": _scale_target(owner, role),
        "minReplicas": auto.min_replicas,
        "maxReplicas": auto.max_replicas,
        "metrics": [{"type": "Pods", "pods": {
            "metric": {"name": name},
            "target": {"type": "AverageValue", "averageValue": target_of(auto, role)},
        }}],
    }
    if (b := behavior(spec, role)) is not None:
        hpa_spec["behavior"] = b
    return {"apiVersion": HPA_API_VERSION, "kind": "HorizontalPodAutoscaler",
            "metadata": child_metadata(owner, role), "spec": hpa_spec}


def _selector(owner: Owner, role: str) -> str:
    # StatefulSet pods are NAME-ROLE-ORDINAL; names may hold dots, which the regex escapes
    # (a PromQL string needs the backslash doubled).
    pods = child_name(owner, role).replace(".", "\\\\.") + "-[0-9]+"
    return f'namespace="{owner.namespace}",pod=~"{pods}"'


def prometheus_query(owner: Owner, metric: ScaleMetric, role: str) -> tuple[str, str]:
    """(query, KEDA metricType): gauges summed over the role's pods against a per-pod
    target (AverageValue); TTFT as the role's mean over the last minute against the
    target itself (Value), 0 while no request arrived (the ratio is NaN then)."""
    sel = _selector(owner, role)
    if metric == ScaleMetric.ttft:
        sums, counts = (f"sum(rate({TTFT_METRIC}_{part}{{{sel}}}[{TTFT_WINDOW}]))"
                        for part in ("sum", "count"))
        return f"(({sums} / {counts}) > 0) or vector(0)", "Value"
    return f"sum({SERIES[metric]}{{{sel}}})", "AverageValue"


def threshold(quantity: str) -> str:
    """A quantity as the decimal KEDA's metadata takes ("700m" -> "0.7")."""
    value = Decimal(str(parse_quantity(quantity))).normalize()
    return format(value, "f")


def scaled_object(owner: Owner, spec: api.DisaggregatedInferenceSpec,
                  role: str) -> dict[str, Any]:
    auto = autoscaling_of(spec, role)
    assert auto is not None and auto.keda is not None
    query, metric_type = prometheus_query(owner, metric_of(auto, role), role)
    so_spec: dict[str, Any] = {
        "scaleTargetRef": _scale_target(owner, role),
        "minReplicaCount": auto.min_replicas,
        "maxReplicaCount": auto.max_replicas,
    }
    if auto.keda.polling_interval is not None:
        so_spec["pollingInterval"] = auto.keda.polling_interval
    if (b := behavior(spec, role)) is not None:
        so_spec["advanced"] = {"horizontalPodAutoscalerConfig": {"behavior": b}}
    so_spec["triggers"] = [{
        "type": "prometheus",
        "metricType": metric_type,
        "metadata": {"serverAddress": auto.keda.server_address, "query": query,
                     "threshold": threshold(target_of(auto, role))},
    }]
    return {"apiVersion": SCALED_OBJECT_API_VERSION, "kind": "ScaledObject",
            "metadata": child_metadata(owner, role), "spec": so_spec}


def autoscalers(owner: Owner, spec: api.DisaggregatedInferenceSpec,
                roles: tuple[str, ...]) -> list[dict[str, Any]]:
    """One autoscaler per autoscaled role."""
    out = []
    for role in roles:
        auto = autoscaling_of(spec, role)
        if auto is None:
            continue
        if auto.engine == AutoscalingEngine.keda:
            out.append(scaled_object(owner, spec, role))
        else:
            out.append(horizontal_pod_autoscaler(owner, spec, role))
    return out


def autoscaler_keys(owner: Owner, roles: tuple[str, ...]) -> list[tuple[str, str]]:
    """(kind, name) of every autoscaler a role may have: the ones not rendered are
    deleted (autoscaling turned off, or the engine changed)."""
    return [(kind, child_name(owner, role)) for role in roles for kind in AUTOSCALER_KINDS]
