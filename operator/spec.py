"""The DisaggregatedInference API: pydantic models that are the one source of the CRD schema.

Field names are the CRD's (camelCase); where a field maps to a vLLM knob its description
names the vLLM setting, so the CRD reference and vLLM's docs can be read side by side.
Cross-field rules live here too (as CEL, see `CEL_RULES`), so the CRD and the operator
enforce the same invariants.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from pydantic.alias_generators import to_camel

GROUP = "bidirkv.io"
VERSION = "v1alpha1"
KIND = "DisaggregatedInference"
PLURAL = "disaggregatedinferences"
SINGULAR = "disaggregatedinference"
SHORT_NAMES = ["di"]

# P declines a remote read this close to D's deadline, so a router handle must expire
# at least this much earlier than the decoder blocks it points at.
TTL_SAFETY_MARGIN_SECONDS = 10

Quantity = Annotated[
    str,
    StringConstraints(pattern=r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"),
]
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$", max_length=253)]


class _Model(BaseModel):
    # forbid: a misspelt field is an error, not silently ignored (the CRD prunes; the
    # operator and local stack see the same rule through these models).
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_enum_values=True,
        validate_default=True,
    )


class DType(StrEnum):
    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class PullPolicy(StrEnum):
    Always = "Always"
    IfNotPresent = "IfNotPresent"
    Never = "Never"


class Backend(StrEnum):
    UCX = "UCX"
    LIBFABRIC = "LIBFABRIC"


class KvBufferDevice(StrEnum):
    cuda = "cuda"
    cpu = "cpu"


class LoadFailurePolicy(StrEnum):
    fail = "fail"
    recompute = "recompute"


class ServiceType(StrEnum):
    ClusterIP = "ClusterIP"
    NodePort = "NodePort"
    LoadBalancer = "LoadBalancer"


class ModelSpec(_Model):
    name: str = Field(
        min_length=1,
        max_length=512,
        description="Model to serve: a Hugging Face id or a path inside the engine image or a "
        "mounted volume (vLLM `--model`). Prefill and decode always serve the same model.",
    )
    served_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="Name clients use in the `model` field (vLLM `--served-model-name`). "
        "Defaults to `name`.",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="Maximum context length in tokens (vLLM `--max-model-len`). Unset: the "
        "model's own limit.",
    )
    dtype: DType = Field(
        default=DType.auto,
        description="Weight and activation dtype (vLLM `--dtype`). Part of the KV "
        "compatibility fingerprint: prefill and decode must match.",
    )


class EnvVar(_Model):
    name: EnvName = Field(description="Environment variable name.")
    value: str = Field(default="", max_length=32768, description="Value.")


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
        default_factory=list,
        max_length=128,
        description="Extra vLLM server arguments appended to the generated ones. Arguments "
        "the operator manages (model, port, parallelism, kv-transfer-config, prefix caching) "
        "are refused here: set the matching field instead.",
    )
    extra_env: list[EnvVar] = Field(
        default_factory=list,
        max_length=128,
        description="Extra environment for both roles. Variables the operator manages "
        "(VLLM_NIXL_SIDE_CHANNEL_*, FI_*) are refused here.",
    )


class ResourceRequirements(_Model):
    requests: dict[str, Quantity | int] = Field(
        default_factory=dict, description="Resource requests, as in a container spec."
    )
    limits: dict[str, Quantity | int] = Field(
        default_factory=dict,
        description="Resource limits, as in a container spec (e.g. `nvidia.com/gpu: 8`).",
    )


class Toleration(_Model):
    key: str | None = Field(default=None, description="Taint key to tolerate.")
    operator: str | None = Field(
        default=None,
        pattern="^(Exists|Equal)$",
        description="`Exists` or `Equal` (default `Equal`).",
    )
    value: str | None = Field(default=None, description="Taint value for `Equal`.")
    effect: str | None = Field(
        default=None,
        pattern="^(NoSchedule|PreferNoSchedule|NoExecute)?$",
        description="Taint effect to tolerate; empty matches all.",
    )
    toleration_seconds: int | None = Field(
        default=None, description="For NoExecute: how long the pod stays bound."
    )


class RoleSpec(_Model):
    replicas: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Number of engine pods of this role (each one vLLM server).",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Tensor parallel degree of each pod (vLLM `--tensor-parallel-size`).",
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Container resources. EFA devices and hugepages are added from `efa`.",
    )
    efa_devices: int = Field(
        default=0,
        ge=0,
        le=32,
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
    extra_env: list[EnvVar] = Field(
        default_factory=list,
        max_length=64,
        description="Extra environment of this role only, after `engine.extraEnv` (e.g. a "
        "CPU core binding per role on a local machine). Managed names are refused.",
    )


class KvTransferSpec(_Model):
    bidirectional: bool = Field(
        default=True,
        description="Decode keeps each finished request's KV and prefill reads it back on the "
        "next turn (vLLM `bidirectional_kv_xfer`, set identically on both roles).",
    )
    decoder_kv_blocks_ttl_seconds: int = Field(
        default=480,
        ge=10,
        le=86400,
        description="How long decode pins a finished request's blocks for reuse; fixed, not "
        "renewed (vLLM `decoder_kv_blocks_ttl`).",
    )
    kv_recompute_threshold: int = Field(
        default=64,
        ge=0,
        le=10_000_000,
        description="Prefill reads decode's KV only when at least this many tokens are "
        "reusable; shorter prefixes are recomputed (vLLM `kv_recompute_threshold`).",
    )
    backend: Backend = Field(
        default=Backend.UCX,
        description="NIXL backend (vLLM `kv_connector_extra_config.backends`): UCX, or "
        "LIBFABRIC on EFA (UCX over EFA silently falls back to TCP).",
    )
    kv_buffer_device: KvBufferDevice | None = Field(
        default=None,
        description="Where the connector stages KV (vLLM `kv_buffer_device`): `cuda` on "
        "GPUs; `cpu` for the CPU build of vLLM. Unset: vLLM's default for the platform.",
    )
    load_failure_policy: LoadFailurePolicy = Field(
        default=LoadFailurePolicy.recompute,
        description="What prefill does when a KV read fails or expires (vLLM "
        "`kv_load_failure_policy`). vLLM's own default is `fail`; `recompute` serves the "
        "request from scratch instead of erroring.",
    )
    retention_watermark: float = Field(
        default=0.9,
        ge=0.05,
        le=1,
        description="Share of each decode replica's KV blocks that retained conversations may "
        "pin. Above it the router releases the least recently stored ones, and decode "
        "enforces the same bound itself. Whatever the value, a request waiting for blocks "
        "takes retained ones first: retention never makes new work wait. Lower values "
        "release conversations that would have come back (measured: 0.5 lost most reuse "
        "under pressure, 0.9 and 1.0 kept it).",
    )
    owner_lease_seconds: int = Field(
        default=30,
        ge=10,
        le=3600,
        description="Decode frees the retained blocks of a router that has not renewed its "
        "lease for this long (the router renews every 5 s; a router that is gone or "
        "restarted stops). Must not exceed `decoderKvBlocksTtlSeconds`.",
    )
    side_channel_port: int = Field(
        default=5600,
        ge=1024,
        le=65535,
        description="NIXL handshake port in every engine pod (VLLM_NIXL_SIDE_CHANNEL_PORT).",
    )


class EfaSpec(_Model):
    enabled: bool = Field(
        default=False,
        description="Run the KV transfer over AWS EFA: FI_* environment, IPC_LOCK, "
        "memory-backed /dev/shm, prefill and decode on different nodes. Needs backend "
        "LIBFABRIC and `efaDevices` >= 1 on both roles.",
    )
    hugepages_2mi: Quantity | None = Field(
        default=None,
        alias="hugepages2Mi",
        description="hugepages-2Mi per engine pod (e.g. `5Gi`); sets FI_EFA_USE_HUGE_PAGE=1.",
    )
    shm_size: Quantity = Field(
        default="16Gi", description="Size limit of the memory-backed /dev/shm of engine pods."
    )


class LabelSelectorRequirement(_Model):
    key: str = Field(min_length=1, max_length=317, description="Label key.")
    operator: str = Field(
        pattern="^(In|NotIn|Exists|DoesNotExist)$",
        description="`In`, `NotIn`, `Exists` or `DoesNotExist`.",
    )
    values: list[str] = Field(
        default_factory=list, description="Values for `In` and `NotIn`; empty otherwise."
    )


class LabelSelector(_Model):
    match_labels: dict[str, str] = Field(
        default_factory=dict, description="Labels the selected objects carry."
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, description="Label requirements, all of which must hold."
    )


class PolicyPeer(_Model):
    namespace_selector: LabelSelector | None = Field(
        default=None,
        description="Namespaces whose pods may connect (`{}`: every namespace). Without "
        "it, pods of this resource's namespace.",
    )
    pod_selector: LabelSelector | None = Field(
        default=None, description="Pods that may connect (`{}`: all pods of the namespaces)."
    )


class NetworkPolicySpec(_Model):
    enabled: bool = Field(
        default=True,
        description="Render NetworkPolicies: engine HTTP only from this resource's router "
        "(and `metricsFrom`), the NIXL side channel and KV transport only between this "
        "resource's engine pods, router ingress from `routerFrom` (open when empty). "
        "They take effect only with a CNI that enforces NetworkPolicy; EFA traffic does "
        "not pass through IP and is not covered (security groups govern it).",
    )
    metrics_from: list[PolicyPeer] = Field(
        default_factory=list,
        description="Who may also reach the engines' HTTP port (e.g. Prometheus scrapers).",
    )
    router_from: list[PolicyPeer] = Field(
        default_factory=list,
        description="Who may reach the router; empty: anyone that can route to it.",
    )


class SecretKeyRef(_Model):
    name: str = Field(min_length=1, max_length=253, description="Secret name.")
    key: str = Field(min_length=1, max_length=253, description="Key in the Secret.")


class HandleStoreSpec(_Model):
    url: str = Field(
        pattern=r"^rediss?://[^/@\s]+(/[0-9]{1,2})?$",
        max_length=512,
        description="Redis-protocol server shared by the router replicas (Valkey, Redis, "
        "ElastiCache without cluster mode): `redis://HOST:PORT/DB`, `rediss://` for TLS. "
        "No password here: use `passwordSecretRef`.",
    )
    password_secret_ref: SecretKeyRef | None = Field(
        default=None, description="Where the store's password is (read by the router pods)."
    )


class RouterSpec(_Model):
    replicas: int = Field(default=1, ge=1, le=64, description="Router pods.")
    image: str = Field(
        default="bidir-kv:0.1.0",
        min_length=1,
        description="Router image (the bidir-kv image; command `bidir-kv router`).",
    )
    port: int = Field(default=8000, ge=1, le=65535, description="Router service port.")
    service_type: ServiceType = Field(
        default=ServiceType.ClusterIP, description="Kubernetes Service type of the router."
    )
    conversation_ttl_seconds: int = Field(
        default=420,
        ge=1,
        le=86400,
        description="How long the router keeps a conversation's decode handle. Must be at "
        f"least {TTL_SAFETY_MARGIN_SECONDS} s below `kvTransfer.decoderKvBlocksTtlSeconds`, "
        "so the router never hands out blocks decode is about to free.",
    )
    max_conversations: int = Field(
        default=100_000,
        ge=1,
        le=10_000_000,
        description="Most conversation handles kept per router (least recently used dropped).",
    )
    handle_store: HandleStoreSpec | None = Field(
        default=None,
        description="Share conversation handles between router replicas (and across router "
        "restarts) through a Redis-protocol store. Required when `replicas` > 1.",
    )


# (rule, message, fieldPath) evaluated on `.spec` by the API server and by the operator.
CEL_RULES: list[tuple[str, str, str]] = [
    (
        f"self.router.conversationTtlSeconds + {TTL_SAFETY_MARGIN_SECONDS} <= "
        "self.kvTransfer.decoderKvBlocksTtlSeconds",
        "router.conversationTtlSeconds must be at least "
        f"{TTL_SAFETY_MARGIN_SECONDS} s below kvTransfer.decoderKvBlocksTtlSeconds",
        ".router.conversationTtlSeconds",
    ),
    (
        "self.router.replicas <= 1 || has(self.router.handleStore)",
        "router.replicas > 1 needs router.handleStore: without a shared store, turns of one "
        "conversation reach different routers and miss their decode KV",
        ".router.replicas",
    ),
    (
        "self.kvTransfer.ownerLeaseSeconds <= self.kvTransfer.decoderKvBlocksTtlSeconds",
        "kvTransfer.ownerLeaseSeconds must not exceed kvTransfer.decoderKvBlocksTtlSeconds",
        ".kvTransfer.ownerLeaseSeconds",
    ),
    (
        "(!has(self.networkPolicy.metricsFrom) || self.networkPolicy.metricsFrom.all(p, "
        "has(p.namespaceSelector) || has(p.podSelector))) && "
        "(!has(self.networkPolicy.routerFrom) || self.networkPolicy.routerFrom.all(p, "
        "has(p.namespaceSelector) || has(p.podSelector)))",
        "every networkPolicy.metricsFrom and routerFrom entry needs namespaceSelector or "
        "podSelector",
        ".networkPolicy",
    ),
    (
        "!self.efa.enabled || self.kvTransfer.backend == 'LIBFABRIC'",
        "kvTransfer.backend must be LIBFABRIC when efa.enabled is true "
        "(UCX over EFA falls back to TCP)",
        ".kvTransfer.backend",
    ),
    (
        "!self.efa.enabled || (self.prefill.efaDevices >= 1 && self.decode.efaDevices >= 1)",
        "prefill.efaDevices and decode.efaDevices must be at least 1 when efa.enabled is true",
        ".efa.enabled",
    ),
    (
        "self.efa.enabled || (self.prefill.efaDevices == 0 && self.decode.efaDevices == 0)",
        "efaDevices must be 0 on both roles unless efa.enabled is true",
        ".efa.enabled",
    ),
]


class DisaggregatedInferenceSpec(_Model):
    model: ModelSpec = Field(description="The model both roles serve.")
    engine: EngineSpec = Field(
        default_factory=EngineSpec, description="Engine image, extra arguments and env."
    )
    prefill: RoleSpec = Field(default_factory=RoleSpec, description="The prefill pool.")
    decode: RoleSpec = Field(
        default_factory=RoleSpec,
        description="The decode replicas (scalable with `kubectl scale di/NAME --replicas=N`).",
    )
    kv_transfer: KvTransferSpec = Field(
        default_factory=KvTransferSpec, description="NIXL KV transfer settings."
    )
    efa: EfaSpec = Field(default_factory=EfaSpec, description="AWS EFA settings.")
    router: RouterSpec = Field(default_factory=RouterSpec, description="The router.")
    network_policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec, description="Network isolation of the pods."
    )

    @model_validator(mode="after")
    def _cross_field(self) -> DisaggregatedInferenceSpec:
        errors = cross_field_errors(self)
        if errors:
            raise ValueError("; ".join(errors))
        return self


def cross_field_errors(spec: DisaggregatedInferenceSpec) -> list[str]:
    """The CEL rules of `CEL_RULES`, in Python, with the offending values in the message."""
    errors = []
    ttl, router_ttl = spec.kv_transfer.decoder_kv_blocks_ttl_seconds, (
        spec.router.conversation_ttl_seconds
    )
    if router_ttl + TTL_SAFETY_MARGIN_SECONDS > ttl:
        errors.append(
            f"spec.router.conversationTtlSeconds: {router_ttl} must be at most "
            f"{ttl - TTL_SAFETY_MARGIN_SECONDS} (kvTransfer.decoderKvBlocksTtlSeconds {ttl} "
            f"minus a {TTL_SAFETY_MARGIN_SECONDS} s margin)"
        )
    if spec.router.replicas > 1 and spec.router.handle_store is None:
        errors.append(
            f"spec.router.replicas: {spec.router.replicas} needs spec.router.handleStore: "
            "without a shared store, turns of one conversation reach different routers and "
            "miss their decode KV"
        )
    lease = spec.kv_transfer.owner_lease_seconds
    if lease > ttl:
        errors.append(
            f"spec.kvTransfer.ownerLeaseSeconds: {lease} must be at most "
            f"kvTransfer.decoderKvBlocksTtlSeconds ({ttl})"
        )
    for field in ("metrics_from", "router_from"):
        for i, peer in enumerate(getattr(spec.network_policy, field)):
            if peer.namespace_selector is None and peer.pod_selector is None:
                name = "metricsFrom" if field == "metrics_from" else "routerFrom"
                errors.append(f"spec.networkPolicy.{name}[{i}]: needs namespaceSelector or "
                              "podSelector (an empty entry would admit everyone)")
    if spec.efa.enabled and spec.kv_transfer.backend != Backend.LIBFABRIC.value:
        errors.append(
            f"spec.kvTransfer.backend: {spec.kv_transfer.backend!r} must be 'LIBFABRIC' when "
            "efa.enabled is true"
        )
    for role in ("prefill", "decode"):
        devices = getattr(spec, role).efa_devices
        if spec.efa.enabled and devices < 1:
            errors.append(f"spec.{role}.efaDevices: {devices} must be >= 1 when efa.enabled")
        if not spec.efa.enabled and devices > 0:
            errors.append(
                f"spec.{role}.efaDevices: {devices} must be 0 unless efa.enabled is true"
            )
        resources = getattr(spec, role).resources
        if spec.efa.enabled and spec.efa.hugepages_2mi and not (
            {"cpu", "memory"} & (set(resources.requests) | set(resources.limits))
        ):
            # The API server refuses hugepages without a cpu or memory request.
            errors.append(
                f"spec.{role}.resources: efa.hugepages2Mi needs a cpu or memory request "
                "or limit on the role"
            )
    return errors


class RoleStatus(_Model):
    desired: int = Field(default=0, description="Pods the spec asks for.")
    replicas: int = Field(default=0, description="Pods that exist.")
    ready: int = Field(default=0, description="Pods whose engine serves the model.")
    summary: str = Field(default="0/0", description="`ready/desired`, for printer columns.")
    selector: str = Field(default="", description="Label selector of the pods (for HPA).")


class Condition(_Model):
    type: str = Field(description="Condition type.")
    status: str = Field(pattern="^(True|False|Unknown)$", description="True, False, Unknown.")
    reason: str = Field(description="CamelCase reason.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: str = Field(description="When the status last changed (RFC 3339).")
    observed_generation: int | None = Field(default=None, description="Generation seen.")


class Phase(StrEnum):
    Pending = "Pending"
    Progressing = "Progressing"
    Ready = "Ready"
    Degraded = "Degraded"
    Invalid = "Invalid"


class DisaggregatedInferenceStatus(_Model):
    observed_generation: int | None = Field(default=None, description="Last generation seen.")
    phase: Phase | None = Field(default=None, description="Summary state.")
    prefill: RoleStatus | None = Field(default=None, description="Prefill pool.")
    decode: RoleStatus | None = Field(default=None, description="Decode replicas.")
    router_ready: int | None = Field(default=None, description="Ready router pods.")
    router_url: str | None = Field(default=None, description="In-cluster URL of the router.")
    kv_fingerprint: str | None = Field(
        default=None, description="Hash of what prefill and decode must share."
    )
    conditions: list[Condition] = Field(default_factory=list, description="Conditions.")


def parse_spec(spec: dict[str, Any]) -> DisaggregatedInferenceSpec:
    """Validate a `.spec` dict; raises SpecError naming each bad field."""
    from pydantic import ValidationError

    try:
        return DisaggregatedInferenceSpec.model_validate(spec)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc)) from None


class SpecError(ValueError):
    """A spec that cannot be reconciled; the message names field, value and what is allowed."""


def format_validation_error(exc: Any) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        path = "spec" + ("." + loc if loc else "")
        if err["type"] == "value_error" and not loc:
            parts.append(str(err["ctx"]["error"]) if "ctx" in err else err["msg"])
            continue
        value = err.get("input")
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        parts.append(f"{path}: {shown}: {err['msg']}")
    return "; ".join(parts)
