"""Network isolation of a DisaggregatedInference's pods."""

from __future__ import annotations

from pydantic import Field

from bidirkv.operator.api.base import _Model


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
        description="Who may also reach the engines' HTTP port and the router's metrics "
        "port, 9090 (e.g. Prometheus scrapers); empty: nobody else.",
    )
    router_from: list[PolicyPeer] = Field(
        default_factory=list,
        description="Who may reach the router; empty: anyone that can route to it. With "
        "`router.trustedTenantHeader` set it must admit the gateway alone: refused empty or "
        "with an entry that admits every pod of every namespace.",
    )


def _selects_all_cel(selector: str) -> str:
    return (f"(!has({selector}.matchLabels) || size({selector}.matchLabels) == 0) && "
            f"(!has({selector}.matchExpressions) || size({selector}.matchExpressions) == 0)")


# CEL over a PolicyPeer `p`: it admits every pod of every namespace (`admits_everyone`).
ADMITS_EVERYONE_CEL = (
    f"has(p.namespaceSelector) && {_selects_all_cel('p.namespaceSelector')} && "
    f"(!has(p.podSelector) || ({_selects_all_cel('p.podSelector')}))")


def _selects_all(selector: LabelSelector | None) -> bool:
    return selector is not None and not selector.match_labels and not (
        selector.match_expressions)


def admits_everyone(peer: PolicyPeer) -> bool:
    """The peer admits every pod of every namespace (`namespaceSelector: {}` with no
    narrower podSelector): as open as no peer at all."""
    return _selects_all(peer.namespace_selector) and (
        peer.pod_selector is None or _selects_all(peer.pod_selector))
