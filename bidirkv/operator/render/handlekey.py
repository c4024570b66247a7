"""The resource's handle key: a Secret the operator creates once and never rewrites.

Engines sign KV handles with it and the router signs its proof with it
(bidirkv/connector/core/handles.py, bidirkv/proof.py). Rendering only references the Secret
(`secretKeyRef`), so `bidir-kv render` stays deterministic and the key never appears in
the rendered children, the resource's status, events or logs. A Secret of that name the
resource does not own is not used: anyone allowed to create Secrets in the namespace
could have put it there first (reconcile/controller.py says so in the status). To
rotate: move `current` to `previous`, write a new `current`, restart the engines and the
router; engines accept both while the rollout runs and sign with `current`.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

CURRENT = "current"
PREVIOUS = "previous"
ENV_CURRENT = "BIDIRKV_HANDLE_KEY"
ENV_PREVIOUS = "BIDIRKV_HANDLE_KEY_PREVIOUS"


def secret_name(owner_name: str) -> str:
    return f"{owner_name}-handle-key"


def key_env(owner_name: str) -> list[dict[str, Any]]:
    """Container env entries that read the key from the Secret."""
    name = secret_name(owner_name)
    return [
        {"name": ENV_CURRENT,
         "valueFrom": {"secretKeyRef": {"name": name, "key": CURRENT}}},
        {"name": ENV_PREVIOUS,
         "valueFrom": {"secretKeyRef": {"name": name, "key": PREVIOUS, "optional": True}}},
    ]


# The Reconciled condition's reason while the Secret is someone else's.
HANDLE_KEY_NOT_OWNED = "HandleKeyNotOwned"


def not_owned_problem(owner: Any, existing: dict[str, Any]) -> str:
    """What to tell the resource's author of a Secret of its key's name that it does not
    own (`existing`: that Secret, or its metadata). `owner` is the resource (Owner)."""
    name = secret_name(owner.name)
    refs = existing.get("metadata", {}).get("ownerReferences") or []
    owners = ", ".join(f"{r.get('kind')}/{r.get('name')}" for r in refs) or "none"
    return (f"Secret {owner.namespace}/{name} exists and is not owned by this "
            f"DisaggregatedInference (its owners: {owners}): whoever wrote it would hold "
            "the key that signs every handle and proof, so no child is created or changed "
            "until it is. Delete it (the operator then creates its own key) or, to use it "
            "as this resource's key, add to it an ownerReference to kind "
            f"DisaggregatedInference, name {owner.name}, uid {owner.uid}")


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
