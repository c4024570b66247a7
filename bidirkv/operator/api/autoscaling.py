"""Autoscaling of a role: bounds, the signal and its target, and which autoscaler acts.

Field names are the HorizontalPodAutoscaler's (`minReplicas`, `maxReplicas`, a Pods
metric's `averageValue`) and, for KEDA, its prometheus trigger's (`serverAddress`,
`pollingInterval`), so the rendered objects read like the spec.
Each rule is in the CRD (CEL, `x-kubernetes-validations`) and in the model's validator,
so the API server and the operator refuse the same specs.
"""

from __future__ import annotations

from enum import StrEnum

from kubernetes.utils import parse_quantity
from pydantic import ConfigDict, Field, model_validator

from bidirkv.operator.api.base import Quantity, _Model

MAX_REPLICAS = 1024
# CRD rules: a quantity that is zero in any of its spellings ("0", "0.0", ".0", "0m",
# "0Gi", "0e3"); negative ones start with "-".
_ZERO_QUANTITY = r"^[+]?(0+[.]?0*|[.]0+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9.]+)?$"


class AutoscalingEngine(StrEnum):
    hpa = "hpa"
    keda = "keda"


class ScaleMetric(StrEnum):
    kv_working_set = "kvWorkingSet"
    queue = "queue"
    ttft = "ttft"


class KedaSpec(_Model):
    server_address: str = Field(
        min_length=1, max_length=512, pattern=r"^https?://[^\s/?#]+[^\s]*$",
        description="Prometheus that KEDA's prometheus trigger queries (its "
        "`serverAddress`), e.g. `http://prometheus-operated.monitoring:9090`. It must "
        "scrape the engines (see `monitoring.podMonitor`).",
    )
    polling_interval: int | None = Field(
        default=None, ge=1, le=3600,
        description="Seconds between KEDA's queries (ScaledObject `pollingInterval`; "
        "unset: KEDA's 30).",
    )


class AutoscalingSpec(_Model):
    model_config = ConfigDict(
        **_Model.model_config,
        json_schema_extra={"x-kubernetes-validations": [
            {"rule": "self.minReplicas <= self.maxReplicas",
             "message": "minReplicas must be at most maxReplicas", "fieldPath": ".minReplicas"},
            {"rule": "self.engine == 'keda' ? has(self.keda) : !has(self.keda)",
             "message": "keda (with its serverAddress) is needed when engine is keda and "
             "refused otherwise", "fieldPath": ".keda"},
            {"rule": "!has(self.metricName) || self.engine == 'hpa'",
             "message": "metricName is the HPA's metrics adapter name; KEDA queries "
             "Prometheus itself", "fieldPath": ".metricName"},
            {"rule": f"!has(self.averageValue) || (!self.averageValue.startsWith('-') && "
             f"!self.averageValue.matches('{_ZERO_QUANTITY}'))",
             "message": "averageValue must be greater than zero", "fieldPath": ".averageValue"},
        ]},
    )

    engine: AutoscalingEngine = Field(
        default=AutoscalingEngine.hpa,
        description="`hpa`: an autoscaling/v2 HorizontalPodAutoscaler on a Pods metric, "
        "served by a custom metrics adapter (e.g. prometheus-adapter). `keda`: a KEDA "
        "ScaledObject (keda.sh/v1alpha1) with a prometheus trigger; needs KEDA installed "
        "and `keda.serverAddress`.",
    )
    min_replicas: int = Field(
        default=1, ge=1, le=MAX_REPLICAS,
        description="Fewest pods of the role (HPA `minReplicas`, KEDA `minReplicaCount`).",
    )
    max_replicas: int = Field(
        ge=1, le=MAX_REPLICAS,
        description="Most pods of the role (HPA `maxReplicas`, KEDA `maxReplicaCount`); at "
        "least `minReplicas`.",
    )
    metric: ScaleMetric | None = Field(
        default=None,
        description="What the role scales on, per pod. `kvWorkingSet`: "
        "`vllm:bidirkv_kv_working_set_ratio`, the share of the pod's KV blocks in use minus "
        "retained blocks it would give up to new work (vLLM's `vllm:kv_cache_usage_perc` "
        "counts those too, and would scale decode up for conversations only kept for "
        "reuse). `queue`: `vllm:num_requests_waiting`. `ttft`: the mean of "
        "`vllm:time_to_first_token_seconds` over the last minute. Unset: `kvWorkingSet` "
        "on decode, `queue` on prefill.",
    )
    average_value: Quantity | None = Field(
        default=None, max_length=64,
        description="Target value of the metric per pod (HPA `averageValue`, KEDA "
        "`threshold`), a quantity: e.g. `700m` (70 % working set), `4` (waiting requests), "
        "`500m` (seconds). Unset: 700m for kvWorkingSet, 4 for queue, 1 for ttft.",
    )
    metric_name: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=r"^[A-Za-z_:][A-Za-z0-9_:]*$",
        description="Name under which the cluster's custom metrics adapter serves the "
        "metric to the HPA, when its rules rename it. Unset: the Prometheus series name "
        "(`vllm:bidirkv_kv_working_set_ratio`, `vllm:num_requests_waiting`, "
        "`vllm:time_to_first_token_seconds`). Only with engine hpa.",
    )
    keda: KedaSpec | None = Field(
        default=None, description="KEDA's settings; required with engine keda, refused "
        "otherwise.",
    )

    @model_validator(mode="after")
    def _rules(self) -> AutoscalingSpec:
        problem = autoscaling_error(self)
        if problem:
            raise ValueError(problem)
        return self


def autoscaling_error(spec: AutoscalingSpec) -> str | None:
    """The CRD rules of AutoscalingSpec, with the offending values (field names relative
    to the role's `autoscaling`)."""
    if spec.min_replicas > spec.max_replicas:
        return (f"minReplicas: {spec.min_replicas} must be at most maxReplicas "
                f"({spec.max_replicas})")
    if spec.engine == AutoscalingEngine.keda and spec.keda is None:
        return "keda: missing; engine keda needs keda.serverAddress (the Prometheus it queries)"
    if spec.engine != AutoscalingEngine.keda and spec.keda is not None:
        return f"keda: set, but engine is {spec.engine!r}; it is read only with engine keda"
    if spec.metric_name is not None and spec.engine != AutoscalingEngine.hpa:
        return (f"metricName: {spec.metric_name!r} is for engine hpa (the adapter's name); "
                "KEDA queries Prometheus itself")
    if spec.average_value is not None and parse_quantity(spec.average_value) <= 0:
        return f"averageValue: {spec.average_value!r} must be greater than zero"
    return None
