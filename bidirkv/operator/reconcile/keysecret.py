"""The resource's handle-key Secret on the reconcile side: created once, its name and uid
recorded in the resource's status, never read (the rules: render/handlekey.py).

Create is all the operator may do with Secrets, so a Secret it did not see itself create
is never used. The first name is derived from the uid; an AlreadyExists there is not
trusted (someone allowed to create Secrets in the namespace may have planted it, or a
pass stopped before recording its own): the key goes under a name the API server
generates, and an Event names the one left unused. An AlreadyExists on a generated name
fails the pass (retried), as any failed create does.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from bidirkv.operator.api import spec as api
from bidirkv.operator.kube import ApiError, KubeClient
from bidirkv.operator.render.handlekey import (
    HANDLE_KEY_NAME_TAKEN,
    STATUS_FIELD,
    default_name,
    name_taken_message,
    new_secret,
    recorded,
)
from bidirkv.operator.render.naming import Owner, child_metadata

log = logging.getLogger("bidirkv.operator")

# (resource, type, reason, message): posts an Event on the resource.
PostEvent = Callable[[dict[str, Any], str, str, str], Awaitable[None]]
# The Reconciled condition's reason while the status cannot hold the record.
CRD_OUTDATED = "CrdOutdated"


class ResourceGone(Exception):
    """The resource was deleted (or replaced by another of its name) during the pass."""


class RecordDropped(Exception):
    """The status write did not keep the record (a CRD older than the operator)."""


class KeySecrets:
    def __init__(self, client: KubeClient, event: PostEvent) -> None:
        self.client = client
        self.event = event
        # Secrets created whose record did not reach the status (a failed write): the
        # retries record these, never create another.
        self.unrecorded: dict[str, dict[str, str]] = {}

    def forget(self, uid: str) -> None:
        self.unrecorded.pop(uid, None)

    async def record(self, body: dict[str, Any], owner: Owner
                     ) -> tuple[dict[str, str], dict[str, Any] | None]:
        """The Secret the resource's pods are to mount, created and recorded here unless
        the server's copy of the resource records one already; and the resource as the
        server answered (None: not read)."""
        made = self.unrecorded.get(owner.uid)
        if made is None:
            # The cached body may be older than a record already written (a watch event
            # behind the status write, a standby that takes over): confirm first.
            fresh = await self.client.get(api.KIND, owner.namespace, owner.name)
            if fresh is None or fresh["metadata"].get("uid") != owner.uid:
                raise ResourceGone(f"{owner.namespace}/{owner.name} is gone")
            if (key := recorded(fresh.get("status"))) is not None:
                return key, fresh
            made = self.unrecorded[owner.uid] = await self._create(body, owner)
        result = await self.client.patch_status(api.KIND, owner.namespace, owner.name,
                                                {STATUS_FIELD: made})
        if result is not None and recorded(result.get("status")) != made:
            raise RecordDropped(
                f"the API server dropped status.{STATUS_FIELD} ({made['name']}): the "
                f"cluster's {api.PLURAL}.{api.GROUP} CRD is older than this operator; "
                "apply this version's (`bidir-kv crd --apply`, or the chart's hook)")
        self.unrecorded.pop(owner.uid, None)
        return made, result

    async def _create(self, body: dict[str, Any], owner: Owner) -> dict[str, str]:
        metadata = child_metadata(owner, "handle-key", default_name(owner))
        try:
            created = await self.client.create(new_secret(metadata))
        except ApiError as exc:
            if exc.status != 409:
                raise
            taken = metadata.pop("name")
            created = await self.client.create(new_secret(
                {**metadata, "generateName": f"{taken}-"}))
            message = name_taken_message(owner.namespace, taken, created["metadata"]["name"])
            log.warning("%s/%s: %s", owner.namespace, owner.name, message)
            await self.event(body, "Warning", HANDLE_KEY_NAME_TAKEN, message)
        log.info("created Secret/%s", created["metadata"]["name"])
        return {"name": created["metadata"]["name"], "uid": created["metadata"]["uid"]}
