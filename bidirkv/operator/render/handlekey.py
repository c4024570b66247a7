"""The resource's handle key: a Secret the operator creates once and never reads or rewrites.

Engines sign KV handles with it and the router its proof (connector/core/handles.py,
bidirkv/proof.py). Rendering only references it (`secretKeyRef`) by the name recorded in
`status.handleKey`, so `bidir-kv render` stays deterministic and the key appears in no
child, status, event or log. Pods mount only a Secret whose create the operator saw
succeed (the operator may only create Secrets, never read one). An AlreadyExists on the
name derived from the resource's uid is not trusted (whoever could create it would hold
the key that signs every handle): the key is created under a generated name, and a
Warning Event names the one left unused. Rotation: docs/operator.md.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Mapping
from typing import Any

CURRENT = "current"
PREVIOUS = "previous"
ENV_CURRENT = "BIDIRKV_HANDLE_KEY"
ENV_PREVIOUS = "BIDIRKV_HANDLE_KEY_PREVIOUS"
# The status field that records the Secret the operator created.
STATUS_FIELD = "handleKey"
# The Warning Event's reason when the first name was taken.
HANDLE_KEY_NAME_TAKEN = "HandleKeyNameTaken"


def default_name(owner: Any) -> str:
    """The first name tried for the resource's key (`owner`: naming.Owner). The uid keeps
    a recreated resource of the same name, and one of an earlier version, apart."""
    return f"{owner.name}-handle-key-{owner.uid[:8]}"


def secret_name(owner: Any) -> str:
    """The Secret the pods read the key from: the recorded one, else the first name tried
    (what a resource that has no status yet renders)."""
    return owner.handle_key or default_name(owner)


def recorded(status: Mapping[str, Any] | None) -> dict[str, str] | None:
    """The Secret the status records (name and uid), or None when there is none."""
    record = (status or {}).get(STATUS_FIELD)
    if not isinstance(record, Mapping) or not isinstance(record.get("name"), str) \
            or not record["name"]:
        return None
    return {"name": record["name"], "uid": str(record.get("uid") or "")}


def key_env(owner: Any) -> list[dict[str, Any]]:
    """Container env entries that read the key from the Secret."""
    name = secret_name(owner)
    return [
        {"name": ENV_CURRENT,
         "valueFrom": {"secretKeyRef": {"name": name, "key": CURRENT}}},
        {"name": ENV_PREVIOUS,
         "valueFrom": {"secretKeyRef": {"name": name, "key": PREVIOUS, "optional": True}}},
    ]


def name_taken_message(namespace: str, taken: str, used: str) -> str:
    """The Warning Event of a first name that was taken."""
    return (f"Secret {namespace}/{taken} already existed when the operator went to create "
            f"this resource's handle key there, so it is not used: the key is Secret "
            f"{namespace}/{used}, recorded in status.handleKey. The operator cannot tell "
            f"who wrote {taken} (it never reads Secrets): if it is not one of its own from "
            "a pass that stopped before recording it, someone allowed to create Secrets "
            "in this namespace planted it. Delete it either way")


def new_key() -> str:
    """256 random bits, as hex text (an environment variable's value)."""
    return secrets.token_hex(32)


def new_secret(metadata: dict[str, Any]) -> dict[str, Any]:
    """The Secret object, with a fresh key (created once; never rendered or compared)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": "Opaque",
        "data": {CURRENT: base64.b64encode(new_key().encode()).decode()},
    }
