"""A resource's children brought to what is rendered: written only where they differ from
the cache the watches fill, and confirmed with a fresh GET first, so a restarted operator
whose cache is still filling writes nothing when nothing changed."""

from __future__ import annotations

import logging
from typing import Any

from bidirkv.operator.kube import ApiError, KubeClient
from bidirkv.operator.reconcile.diff import differs, owned_by, replacement
from bidirkv.operator.render.autoscaling import SCALED_OBJECT_API_VERSION
from bidirkv.operator.render.monitoring import POD_MONITOR_API_VERSION
from bidirkv.operator.render.naming import Owner

log = logging.getLogger("bidirkv.operator")

Key = tuple[str, str, str]  # kind, namespace, name
# Children the operator does not watch (their CRD may be missing, and a watch would need
# list and watch on them): never trusted from the cache.
UNWATCHED_KINDS = frozenset({"PodMonitor", "HorizontalPodAutoscaler", "ScaledObject"})


class ChildConflict(Exception):
    """A child name is taken by an object this resource does not own."""


class KindMissing(Exception):
    """The cluster does not serve the kind of an optional child (its CRD is missing)."""


def key_of(obj: dict[str, Any]) -> Key:
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace", ""), meta["name"]


class Children:
    """The children of every resource: the cache the watches fill, the writes, and the
    deletion of optional ones turned off."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client
        self.cache: dict[Key, dict[str, Any]] = {}
        # Optional children confirmed absent: not looked up again until rendered.
        self._absent: set[Key] = set()

    def observe(self, event_type: str | None, body: dict[str, Any]) -> None:
        if event_type == "DELETED":
            self.cache.pop(key_of(body), None)
        else:
            self.cache[key_of(body)] = body

    async def remove(self, key: Key, owner: Owner) -> None:
        """Delete an optional child this resource owns and no longer renders."""
        if key in self._absent:
            return
        actual = self.cache.pop(key, None) or await self.client.get(*key)
        if actual is not None and owned_by(actual, owner.uid):
            await self.client.delete(*key, actual["metadata"]["uid"])
            log.info("deleted %s/%s (turned off)", key[0], key[2])
        self._absent.add(key)

    async def apply(self, obj: dict[str, Any], owner: Owner) -> dict[str, Any]:
        key = key_of(obj)
        self._absent.discard(key)
        cached = self.cache.get(key)
        # Only watched kinds keep their cache current; the others are read every pass, so
        # a hand edit or deletion is put right at the next reconcile.
        if (cached is not None and key[0] not in UNWATCHED_KINDS
                and owned_by(cached, owner.uid) and not differs(obj, cached)):
            return cached
        # Cache miss or a difference: confirm against the server before writing.
        actual = await self.client.get(*key)
        if actual is None:
            try:
                created = await self.client.create(obj)
            except ApiError as exc:
                if exc.status == 404 and (missing := _kind_missing(obj)):
                    raise KindMissing(missing) from None
                if exc.status != 409:
                    raise
                actual = await self.client.get(*key)
                if actual is None:
                    raise
            else:
                self.cache[key] = created
                log.info("created %s/%s", key[0], key[2])
                return created
        if not owned_by(actual, owner.uid):
            raise ChildConflict(
                f"{key[0]} {key[1]}/{key[2]} exists and is not owned by this "
                "DisaggregatedInference; delete or rename it"
            )
        if not differs(obj, actual):
            self.cache[key] = actual
            return actual
        updated = await self.client.replace(replacement(obj, actual))
        self.cache[key] = updated
        log.info("updated %s/%s", key[0], key[2])
        return updated


def _kind_missing(obj: dict[str, Any]) -> str | None:
    """What to say when the cluster does not serve an optional child's kind."""
    served = f"the cluster serves no {obj['apiVersion']} {obj['kind']}"
    if obj["apiVersion"] == POD_MONITOR_API_VERSION:
        return (f"spec.monitoring.podMonitor.enabled is true but {served} (install "
                "prometheus-operator's CRDs, or turn it off)")
    if obj["apiVersion"] == SCALED_OBJECT_API_VERSION:
        role = obj["metadata"]["labels"]["app.kubernetes.io/component"]
        return (f"spec.{role}.autoscaling.engine is 'keda' but {served} (install KEDA, or "
                "use engine hpa)")
    return None
