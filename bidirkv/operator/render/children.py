"""Pure rendering: a DisaggregatedInference -> every child object the operator owns.

No I/O here, so every rendering rule is tested without an API server and
`bidir-kv render -f FILE --operator-namespace NS` prints exactly what an operator running
in NS would write. The engines' children are in engine.py, the router's in router.py,
names in naming.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bidirkv.operator.api import spec as api
from bidirkv.operator.crd.schema import MAX_NAME_LENGTH
from bidirkv.operator.render.autoscaling import autoscaler_keys, autoscalers
from bidirkv.operator.render.engine import (  # noqa: F401 - re-exported
    CONFIG_HASH_ANNOTATION,
    FINGERPRINT_LABEL,
    engine_pod_template,
    engine_service,
    engine_statefulset,
    pod_disruption_budget,
)
from bidirkv.operator.render.handlekey import recorded
from bidirkv.operator.render.monitoring import POD_MONITOR_COMPONENT, pod_monitor
from bidirkv.operator.render.naming import (  # noqa: F401 - re-exported: what users of render import
    MANAGED_BY,
    Owner,
    child_metadata,
    child_name,
    instance_labels,
    router_url,
    selector_labels,
    selector_string,
)
from bidirkv.operator.render.netpol import network_policies
from bidirkv.operator.render.router import (  # noqa: F401 - re-exported
    ROUTER_CONTAINER_PORT,
    ROUTER_METRICS_PORT,
    RouterListen,
    router_config,
    router_configmap,
    router_deployment,
    router_service,
)
from bidirkv.roleconfig import ROLES


def name_errors(owner: Owner) -> list[str]:
    if len(owner.name) > MAX_NAME_LENGTH:
        return [
            f"metadata.name: {owner.name!r} has {len(owner.name)} characters; at most "
            f"{MAX_NAME_LENGTH} are allowed"
        ]
    return []


def render(owner: Owner, spec: api.DisaggregatedInferenceSpec,
           observed: Mapping[str, int] | None = None, *,
           operator_namespace: str | None = None) -> list[dict[str, Any]]:
    """Every child object, in the order they are best created (config before users).

    `observed`: the replicas each autoscaled role's StatefulSet was last seen with (the
    autoscaler's choice), by role; the router's config lists that many pods.
    `operator_namespace`: where the operator runs, the one namespace whose operator pods
    the engines admit (None: unknown, the resource's own; netpol.py)."""
    errors = name_errors(owner)
    if errors:
        raise api.SpecError("; ".join(errors))
    children: list[dict[str, Any]] = []
    for role in ROLES:
        children += [
            engine_service(owner, spec, role),
            engine_statefulset(owner, spec, role),
            pod_disruption_budget(owner, role),
        ]
    children += autoscalers(owner, spec, ROLES)
    children += [
        router_configmap(owner, spec, observed),
        router_deployment(owner, spec),
        router_service(owner, spec),
    ]
    children += network_policies(lambda c: child_metadata(owner, c), instance_labels(owner),
                                 selector_labels(owner, "router"), ROUTER_CONTAINER_PORT,
                                 ROUTER_METRICS_PORT, spec,
                                 operator_namespace=operator_namespace)
    monitor = pod_monitor(owner, spec)
    if monitor is not None:
        children.append(monitor)
    return children


def optional_children(owner: Owner) -> list[tuple[str, str]]:
    """(kind, name) of children a spec may turn off: the operator deletes the ones it owns
    once they are no longer rendered."""
    return [("PodMonitor", child_name(owner, POD_MONITOR_COMPONENT)),
            *autoscaler_keys(owner, ROLES)]


def render_resource(obj: dict[str, Any], *,
                    operator_namespace: str | None = None) -> list[dict[str, Any]]:
    """Render from a whole DisaggregatedInference object (as read from a file or the API)."""
    meta = obj.get("metadata") or {}
    if not meta.get("name"):
        raise api.SpecError("metadata.name: missing; a DisaggregatedInference needs a name")
    owner = Owner(
        name=meta["name"],
        namespace=meta.get("namespace") or "default",
        uid=meta.get("uid") or "00000000-0000-0000-0000-000000000000",
        handle_key=(recorded(obj.get("status")) or {}).get("name"),
    )
    return render(owner, api.parse_spec(obj.get("spec") or {}),
                  operator_namespace=operator_namespace)
