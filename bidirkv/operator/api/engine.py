"""The model and the engines of a DisaggregatedInference: image, arguments, environment,
pod settings, and the two roles."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import ConfigDict, Field, StringConstraints, field_validator, model_validator

from bidirkv.operator.api.autoscaling import MAX_REPLICAS, AutoscalingSpec
from bidirkv.operator.api.base import DnsName, _Model, check_annotations, check_labels
from bidirkv.operator.api.pod import (
    EnvFromSource,
    EnvVar,
    LocalObjectReference,
    ModelCacheSpec,
    ResourceRequirements,
    Toleration,
    TopologySpreadConstraint,
    Volume,
    VolumeMount,
)
from bidirkv.roleconfig import ROLE_ARG_PATTERN, ROLE_ARGS, ROLE_ENV, ROLE_ENV_CEL

# Volume names and paths the operator itself uses in engine pods.
RESERVED_VOLUMES = ("shm", "hugepages", "model-cache")
RESERVED_PATHS = ("/dev/shm", "/hugepages")
# Label and annotation prefixes the operator owns (selectors, fingerprint, config hash).
_MANAGED_KEY_PREFIXES = ("app.kubernetes.io/", "bidirkv.io/")


def _not_managed(values: dict[str, str]) -> dict[str, str]:
    for key in values:
        if key.startswith(_MANAGED_KEY_PREFIXES):
            raise ValueError(f"{key!r} is managed by the operator (keys starting with "
                             f"{' or '.join(_MANAGED_KEY_PREFIXES)} are refused)")
    return values


def volume_errors(volumes: list[dict[str, Any]], mounts: list[dict[str, Any]]) -> str | None:
    names = [v["name"] for v in volumes]
    for name in names:
        if name in RESERVED_VOLUMES:
            return f"extraVolumes: {name!r} is a volume name the operator uses " \
                   f"({', '.join(RESERVED_VOLUMES)})"
        if names.count(name) > 1:
            return f"extraVolumes: {name!r} appears twice"
    for mount in mounts:
        if mount["name"] not in names:
            return f"extraVolumeMounts: {mount['name']!r} is not in extraVolumes " \
                   f"({', '.join(names) or 'none'})"
        if mount["mountPath"].rstrip("/") in RESERVED_PATHS:
            return f"extraVolumeMounts: {mount['mountPath']!r} is a path the operator " \
                   "mounts"
    return None


class DType(StrEnum):
    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class PullPolicy(StrEnum):
    Always = "Always"
    IfNotPresent = "IfNotPresent"
    Never = "Never"


class ModelSpec(_Model):
    name: str = Field(
        min_length=1, max_length=512,
        description="Model to serve: a Hugging Face id or a path inside the engine image or a "
        "mounted volume (vLLM `--model`). Prefill and decode always serve the same model.",
    )
    served_name: str | None = Field(
        default=None, min_length=1, max_length=256,
        description="Name clients use in the `model` field (vLLM `--served-model-name`). "
        "Defaults to `name`.",
    )
    max_model_len: int | None = Field(
        default=None, ge=1, le=10_000_000,
        description="Maximum context length in tokens (vLLM `--max-model-len`). Unset: the "
        "model's own limit.",
    )
    dtype: DType = Field(
        default=DType.auto,
        description="Weight and activation dtype (vLLM `--dtype`). Part of the KV "
        "compatibility fingerprint: prefill and decode must match.",
    )


class EngineSpec(_Model):
    image: str = Field(
        default="bidir-kv-vllm:0.1.0",
        min_length=1,
        description="Container image of the engine: an official vLLM image with the "
        "bidir-kv connector package added (see connector/Dockerfile).",
    )
    image_pull_policy: PullPolicy = Field(
        default=PullPolicy.IfNotPresent, description="Kubernetes image pull policy."
    )
    extra_args: list[Annotated[str, StringConstraints(max_length=4096)]] = Field(
        default_factory=list, max_length=128,
        description="Extra vLLM server arguments appended to the generated ones. Arguments "
        "the operator manages (model, port, parallelism, kv-transfer-config, prefix caching) "
        "are refused here: set the matching field instead.",
    )
    extra_env: list[EnvVar] = Field(
        default_factory=list, max_length=128,
        description="Extra environment for both roles. Variables the operator manages "
        "(VLLM_NIXL_SIDE_CHANNEL_*, FI_*) are refused here.",
    )
    env_from: list[EnvFromSource] = Field(
        default_factory=list, max_length=32,
        description="Whole Secrets or ConfigMaps as environment of both roles (EnvFromSource, "
        "e.g. `secretRef: {name: hf-token}`).",
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=16,
        description="Secrets for pulling the engine image from a private registry.",
    )
    service_account_name: DnsName | None = Field(
        default=None, description="ServiceAccount of the engine pods (e.g. for IRSA / Pod "
        "Identity access to S3). Its token is still not mounted.",
    )
    priority_class_name: DnsName | None = Field(
        default=None, description="PriorityClass of the engine pods.")
    termination_grace_period_seconds: int = Field(
        default=60, ge=0, le=3600,
        description="How long an engine pod may take to drain in-flight requests on stop.",
    )
    pod_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Extra labels of the engine pods (the operator's own keys are refused).",
    )
    pod_annotations: dict[str, str] = Field(
        default_factory=dict,
        description="Extra annotations of the engine pods (the operator's own are refused).",
    )
    model_cache: ModelCacheSpec | None = Field(
        default=None,
        description="A volume for model downloads, shared by both roles unless a role sets "
        "its own: without one, every pod start downloads the model again into the "
        "container's disk.",
    )
    extra_volumes: list[Volume] = Field(
        default_factory=list, max_length=32,
        description="More volumes of the engine pods (Kubernetes Volume objects).",
    )
    extra_volume_mounts: list[VolumeMount] = Field(
        default_factory=list, max_length=32,
        description="Mounts of `extraVolumes` in the engine container (VolumeMount objects).",
    )

    @field_validator("pod_labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        return check_labels(_not_managed(value))

    @field_validator("pod_annotations")
    @classmethod
    def _annotations(cls, value: dict[str, str]) -> dict[str, str]:
        return check_annotations(_not_managed(value))

    @model_validator(mode="after")
    def _volumes(self) -> EngineSpec:
        problem = volume_errors(self.extra_volumes, self.extra_volume_mounts)
        if problem:
            raise ValueError(problem)
        return self


ROLE_ARG_MAX_LENGTH = 256
# Pods of a role that sets neither `replicas` nor `autoscaling`.
DEFAULT_REPLICAS = 1


class RoleSpec(_Model):
    model_config = ConfigDict(
        **_Model.model_config,
        json_schema_extra={"x-kubernetes-validations": [{
            "rule": "!has(self.autoscaling) || !has(self.replicas)",
            "message": "replicas must be unset when autoscaling is set: the autoscaler "
            "decides the number of pods", "fieldPath": ".replicas"}]},
    )

    replicas: int | None = Field(
        default=None, ge=1, le=MAX_REPLICAS,
        description=f"Number of engine pods of this role (each one vLLM server); unset: "
        f"{DEFAULT_REPLICAS}, or what the autoscaler decides when `autoscaling` is set "
        "(the two are refused together).",
    )
    autoscaling: AutoscalingSpec | None = Field(
        default=None,
        description="Scale this role with a HorizontalPodAutoscaler or a KEDA ScaledObject "
        "(one per role, owned by this resource and deleted when this is removed). The "
        "operator then leaves the StatefulSet's replicas to the autoscaler and lists the "
        "pods it runs in the router's config.",
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=64,
        description="Tensor parallel degree of each pod (vLLM `--tensor-parallel-size`).",
    )
    drain_seconds: int = Field(
        default=120, ge=0, le=3600,
        description="How long a leaving pod (rollout, scale-down, node drain, eviction) "
        "waits before vLLM stops. Decode waits while it still holds conversations for "
        "their next turn, each moving to another replica as it comes back; prefill waits "
        "for its legs in flight. Either stops at once when it holds nothing. The pod's "
        "grace period is this plus `engine.terminationGracePeriodSeconds`; a rollout of N "
        "pods takes at most N times it. Shorter than `kvTransfer.decoderKvBlocksTtlSeconds` "
        "is allowed (conversations not back by then recompute) and said in the status.",
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Container resources. EFA devices and hugepages are added from `efa`.",
    )
    efa_devices: int = Field(
        default=0, ge=0, le=32,
        description="`vpc.amazonaws.com/efa` devices per pod (requests = limits). Needs "
        "`efa.enabled`.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the pods must match."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=64, description="Tolerations of the pods."
    )
    affinity: dict[str, Any] = Field(
        default_factory=dict,
        description="Pod affinity as in a pod spec (validated by the API server when the "
        "StatefulSet is written). With EFA the operator adds an anti-affinity that keeps "
        "prefill and decode on different nodes.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    enable_prefix_caching: bool = Field(
        default=True,
        description="Local prefix caching of this role (vLLM `--enable-prefix-caching` / "
        "`--no-enable-prefix-caching`).",
    )
    # Items short enough that the API server's cost estimate of the CEL rules below
    # stays far under its limit; what a role may set alone is a number or a word.
    extra_args: list[Annotated[str, StringConstraints(max_length=ROLE_ARG_MAX_LENGTH)]] = Field(
        default_factory=list, max_length=64,
        description="Extra vLLM server arguments of this role only, after `engine.extraArgs` "
        "(vLLM takes the last value of a repeated flag), e.g. a smaller "
        "`--max-num-batched-tokens` on prefill so its first prompt is done before the whole "
        "batch. Only arguments that change how much work a server takes on or what it "
        f"logs, never its tokens or KV: {', '.join(f'`{a}`' for a in ROLE_ARGS)}, each "
        "value right after its argument; anything else goes in `engine.extraArgs`.",
        json_schema_extra={"x-kubernetes-validations": [
            {"rule": f"self.all(a, !a.startsWith('-') || a.matches('{ROLE_ARG_PATTERN}'))",
             "message": "a role may set alone only arguments that leave its tokens and KV "
             "as the other role's (the others go in engine.extraArgs): "
             f"{', '.join(ROLE_ARGS)}",
             "messageExpression": "self.filter(a, a.startsWith('-') && "
             f"!a.matches('{ROLE_ARG_PATTERN}'))[0] + ' is not an argument a role may set "
             "alone (it could change the tokens or the KV one role computes for the other): "
             f"set it in engine.extraArgs, or use one of {', '.join(ROLE_ARGS)}'"},
            {"rule": "size(self) == 0 || self[0].startsWith('-')",
             "message": "a role's extraArgs start with an argument (a value first would "
             "complete engine.extraArgs' last one on this role only)"},
        ]},
    )
    extra_env: list[EnvVar] = Field(
        default_factory=list, max_length=64,
        description="Extra environment of this role only, after `engine.extraEnv` (e.g. a "
        "CPU core binding per role on a local machine). Only names that leave its weights, "
        f"tokens and KV as the other role's: {', '.join(f'`{n}`' for n in ROLE_ENV)}; "
        "anything else (`HF_ENDPOINT`, `HF_HOME`, `VLLM_USE_MODELSCOPE`, an attention "
        "backend) goes in `engine.extraEnv`.",
        json_schema_extra={"x-kubernetes-validations": [
            {"rule": f"self.all(e, e.name in {ROLE_ENV_CEL})",
             "message": "a role may set alone only environment that leaves its weights, "
             "tokens and KV as the other role's (the rest goes in engine.extraEnv): "
             f"{', '.join(ROLE_ENV)}",
             "messageExpression": f"self.filter(e, !(e.name in {ROLE_ENV_CEL}))[0].name + "
             "' is not an environment variable a role may set alone (it could change the "
             "weights, tokens or KV one role computes for the other): set it in "
             f"engine.extraEnv, or use one of {', '.join(ROLE_ENV)}'"},
        ]},
    )
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(
        default_factory=list, max_length=16,
        description="How the role's pods spread over zones or nodes (TopologySpreadConstraint "
        "objects; select the role's pods with `app.kubernetes.io/component`).",
    )
    model_cache: ModelCacheSpec | None = Field(
        default=None, description="This role's model cache, instead of `engine.modelCache`.")

    @model_validator(mode="after")
    def _fixed_or_autoscaled(self) -> RoleSpec:
        if self.autoscaling is not None and self.replicas is not None:
            raise ValueError(f"replicas: {self.replicas} is a fixed count; leave it unset when "
                             "autoscaling is set (the autoscaler decides the number of pods)")
        return self

    def fixed_replicas(self) -> int | None:
        """The pods the spec asks for; None when the autoscaler decides."""
        if self.autoscaling is not None:
            return None
        return DEFAULT_REPLICAS if self.replicas is None else self.replicas

    def initial_replicas(self) -> int:
        """The pods to start with: the fixed count, or the autoscaler's minimum."""
        fixed = self.fixed_replicas()
        if fixed is not None:
            return fixed
        assert self.autoscaling is not None
        return self.autoscaling.min_replicas
