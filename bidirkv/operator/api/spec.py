"""The DisaggregatedInference API: pydantic models that are the one source of the CRD schema.

Field names are the CRD's (camelCase); where a field maps to a vLLM knob its description
names the vLLM setting, so the CRD reference and vLLM's docs can be read side by side.
The knobs the router and the engines read too are defined once in bidirkv/knobs.py (the
`router` and `kvTransfer` sections build on them). Rules across sections live here, as
CEL (`CEL_RULES`) and in Python (`cross_field_errors`), so the CRD and the operator
enforce the same invariants. The parts live in the modules beside this one by subject;
this module is the whole and what the rest of the code imports.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from bidirkv.knobs import LEASE_OUTLIVES_RENEWALS, TTL_SAFETY_MARGIN_SECONDS, shown_input
from bidirkv.operator.api.base import _Model
from bidirkv.operator.api.engine import EngineSpec, ModelSpec, RoleSpec
from bidirkv.operator.api.monitoring import MonitoringSpec
from bidirkv.operator.api.network import (
    ADMITS_EVERYONE_CEL,
    NetworkPolicySpec,
    PolicyPeer,
    admits_everyone,
)
from bidirkv.operator.api.router import RouterSpec, ServiceType
from bidirkv.operator.api.status import DisaggregatedInferenceStatus
from bidirkv.operator.api.transfer import EfaSpec, KvTransferSpec, NixlBackend

__all__ = [
    "CEL_RULES", "DisaggregatedInferenceSpec", "DisaggregatedInferenceStatus", "PolicyPeer",
    "SpecError", "TTL_SAFETY_MARGIN_SECONDS", "cross_field_errors", "parse_spec",
]

GROUP = "bidirkv.io"
VERSION = "v1alpha1"
KIND = "DisaggregatedInference"
PLURAL = "disaggregatedinferences"
SINGULAR = "disaggregatedinference"
SHORT_NAMES = ["di"]

# (rule, message, fieldPath) evaluated on `.spec` by the API server; `cross_field_errors`
# is their Python form (tests/test_knob_rules.py holds the two equal). Rules inside one
# section of knobs sit on that section's node (bidirkv/knobs.py).
CEL_RULES: list[tuple[str, str, str]] = [
    (
        f"self.router.conversationTtlSeconds + double({TTL_SAFETY_MARGIN_SECONDS}) <= "
        "double(self.kvTransfer.decoderKvBlocksTtlSeconds)",
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
        LEASE_OUTLIVES_RENEWALS.cel_at("self.kvTransfer.ownerLeaseSeconds",
                                       "self.router.healthCheckIntervalSeconds"),
        LEASE_OUTLIVES_RENEWALS.message("kvTransfer.ownerLeaseSeconds",
                                        "router.healthCheckIntervalSeconds"),
        ".kvTransfer.ownerLeaseSeconds",
    ),
    (
        # The header is believed from whoever reaches the router: only the gateway may.
        "!has(self.router.trustedTenantHeader) || (self.networkPolicy.enabled && "
        "has(self.networkPolicy.routerFrom) && size(self.networkPolicy.routerFrom) > 0 && "
        f"!self.networkPolicy.routerFrom.exists(p, {ADMITS_EVERYONE_CEL}))",
        "router.trustedTenantHeader needs networkPolicy.enabled and a networkPolicy.routerFrom "
        "that admits only the gateway setting the header (not empty, no entry that admits "
        "every pod of every namespace): any other caller could name any tenant",
        ".router.trustedTenantHeader",
    ),
    (
        "!has(self.router.trustedTenantHeader) || self.router.serviceType == 'ClusterIP'",
        "router.serviceType must be ClusterIP when router.trustedTenantHeader is set: a "
        "LoadBalancer or NodePort Service takes callers from outside the cluster, whom "
        "networkPolicy.routerFrom cannot name",
        ".router.serviceType",
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


_CACHE_SOURCES = ("persistentVolumeClaim", "hostPath", "emptyDir")
for _where in ("engine", "prefill", "decode"):
    _count = " + ".join(f"(has(self.{_where}.modelCache.{s}) ? 1 : 0)" for s in _CACHE_SOURCES)
    CEL_RULES.append((
        f"!has(self.{_where}.modelCache) || {_count} == 1",
        f"{_where}.modelCache needs exactly one of persistentVolumeClaim, hostPath, emptyDir",
        f".{_where}.modelCache",
    ))


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
    monitoring: MonitoringSpec = Field(
        default_factory=MonitoringSpec,
        description="Scraping of the engines and traces (all off by default).",
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
            f"spec.router.conversationTtlSeconds: {router_ttl:g} must be at most "
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
    problem = LEASE_OUTLIVES_RENEWALS.problem(
        ("spec.kvTransfer.ownerLeaseSeconds", "spec.router.healthCheckIntervalSeconds"),
        (lease, spec.router.health_check_interval_seconds))
    if problem:
        errors.append(problem)
    if lease > ttl:
        errors.append(
            f"spec.kvTransfer.ownerLeaseSeconds: {lease} must be at most "
            f"kvTransfer.decoderKvBlocksTtlSeconds ({ttl})"
        )
    errors += _trusted_header_errors(spec)
    for field in ("metrics_from", "router_from"):
        for i, peer in enumerate(getattr(spec.network_policy, field)):
            if peer.namespace_selector is None and peer.pod_selector is None:
                name = "metricsFrom" if field == "metrics_from" else "routerFrom"
                errors.append(f"spec.networkPolicy.{name}[{i}]: needs namespaceSelector or "
                              "podSelector (an empty entry would admit everyone)")
    if spec.efa.enabled and spec.kv_transfer.backend != NixlBackend.LIBFABRIC.value:
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


def _trusted_header_errors(spec: DisaggregatedInferenceSpec) -> list[str]:
    """`trustedTenantHeader` names the tenant for whoever sets it: the router must be
    reachable by the gateway alone (the two trusted-header rules of `CEL_RULES`)."""
    header = spec.router.trusted_tenant_header
    if header is None:
        return []
    np, errors = spec.network_policy, []
    open_to = ("spec.networkPolicy.enabled is false" if not np.enabled
               else "spec.networkPolicy.routerFrom is empty" if not np.router_from
               else next((f"spec.networkPolicy.routerFrom[{i}] admits every pod of every "
                          "namespace" for i, p in enumerate(np.router_from)
                          if admits_everyone(p)), None))
    if open_to:
        errors.append(
            f"spec.router.trustedTenantHeader: {header!r} is believed from whoever reaches "
            f"the router, and {open_to}: any pod that can reach it could name any tenant, "
            "share that tenant's cache salt, take its handles and end its conversations. "
            "Set spec.networkPolicy.routerFrom to the gateway's pods alone (with "
            "networkPolicy.enabled true), or unset trustedTenantHeader")
    if spec.router.service_type != ServiceType.ClusterIP:
        errors.append(
            f"spec.router.serviceType: {str(spec.router.service_type)!r} must be "
            f"'ClusterIP' while spec.router.trustedTenantHeader is set ({header!r}): a "
            "LoadBalancer or NodePort Service takes callers from outside the cluster, whom "
            "networkPolicy.routerFrom (pods and namespaces) cannot name; where NetworkPolicy "
            "is not enforced they could name any tenant. Put the gateway in the cluster, "
            "in front of a ClusterIP router")
    return errors


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
        value = shown_input(err.get("input"))
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        parts.append(f"{path}: {shown}: {err['msg']}")
    return "; ".join(parts)
