"""The router's proof on a decode leg: shared by the router (makes it) and the engine
plugin (checks it), and owned by neither.

`nonce.expiry.mac`: an HMAC with the resource's handle key over a random nonce and a
wall-clock expiry. Decode keeps a request's KV and hands out a handle only when the
request carries a valid proof it has not seen before, so only the router, which holds
the key, can obtain handles (bidirkv/connector/core/handles.py).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

# Good this long after it was made (wall clock; allows for skew between pods).
PROOF_TTL_S = 120
MAC_HEX = 32


def proof_mac(key: bytes, nonce: str, expires: int) -> str:
    msg = f"bidirkv-proof/1|{nonce}|{expires}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()[:MAC_HEX]


def make_proof(key: bytes, now: float | None = None) -> str:
    nonce = secrets.token_hex(12)
    expires = int((time.time() if now is None else now) + PROOF_TTL_S)
    return f"{nonce}.{expires}.{proof_mac(key, nonce, expires)}"


def proof_problem(proof: Any, keys: Sequence[bytes],
                  first_use: Callable[[str], bool] | None = None,
                  now: float | None = None) -> str | None:
    """Why `proof` does not show the router sent this request (None: it does)."""
    if proof is None:
        return "no router proof"
    parts = proof.split(".") if isinstance(proof, str) and len(proof) <= 128 else []
    if len(parts) != 3 or not parts[1].isdigit():
        return "malformed router proof"
    nonce, expires, mac = parts[0], int(parts[1]), parts[2]
    t = time.time() if now is None else now
    if not t - PROOF_TTL_S <= expires <= t + 2 * PROOF_TTL_S:
        return "router proof expired"
    if not any(hmac.compare_digest(mac, proof_mac(k, nonce, expires)) for k in keys if k):
        return "router proof does not match"
    if first_use is not None and not first_use(nonce):
        return "router proof already used"
    return None
