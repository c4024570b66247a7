"""The resource's handle key: a Secret the operator creates once and never reads or rewrites.

Engines sign KV handles with it and the router signs its proof with it
(bidirkv/connector/core/handles.py, bidirkv/proof.py). Rendering only references the Secret
(`secretKeyRef`), by the name recorded in the resource's status (`status.handleKey`), so
`bidir-kv render` stays deterministic and the key never appears in the rendered children,
the resource's status, events or logs.

The pods mount only a Secret whose create the operator saw succeed: its name and uid, as
the API server answered the create, are recorded in the status before any child refers to
it, and later passes take the record as it is. The operator's role has `create` alone on
Secrets, so it never reads one, not even to check who owns it. The first name it tries is
derived from the resource's uid; an AlreadyExists there is not trusted (anyone allowed to
create Secrets in the namespace could have put one there once the resource existed, and
would hold the key that signs every handle and proof; or it is the operator's own from a
pass that stopped before recording it): the key is then created under a name the API
server generates, and a Warning Event names the Secret left unused. To rotate: move
`current` to `previous`, write a new `current`, restart the engines and the router;
engines accept both while the rollout runs and sign with `current`.
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
