"""The router's proof on a decode leg: shared by the router (makes it) and the engine
plugin (checks it), and owned by neither.

`nonce.expiry.mac`: an HMAC with the resource's handle key over a random nonce and a
wall-clock expiry. Decode keeps a request's KV and hands out a handle only when the
request carries a valid proof it has not seen before, so only the router, which holds
the key, can obtain handles (bidirkv/connector/core/handles.py).

The same key signs every call to the engines' residency route (`sign_residency`, checked
by bidirkv/connector/endpoint.py): only its holders renew leases, release retained KV or
read decode's report.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

# Good this long after it was made (wall clock; allows for skew between pods).
PROOF_TTL_S = 120
MAC_HEX = 32


@lru_cache(maxsize=16)
def _keyed(key: bytes) -> hmac.HMAC:
    return hmac.new(key, digestmod=hashlib.sha256)


def keyed_sha256(key: bytes) -> hmac.HMAC:
    """A fresh HMAC-SHA256 under `key`, to be updated. Every decode leg, residency call
    and note is signed with one key (or the few of a rotation): the key's state is set up
    once, and a copy of it costs about half of `hmac.new` with the key each time."""
    return _keyed(key).copy()


def _hmac_hex(key: bytes, msg: bytes) -> str:
    h = keyed_sha256(key)
    h.update(msg)
    return h.hexdigest()


def proof_mac(key: bytes, nonce: str, expires: int) -> str:
    return _hmac_hex(key, f"bidirkv-proof/1|{nonce}|{expires}".encode())[:MAC_HEX]


def make_proof(key: bytes, now: float | None = None) -> str:
    nonce = os.urandom(12).hex()  # secrets.token_hex(12), without its two calls
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


# -- the residency route's signature ---------------------------------------------------------
# `POST /bidirkv/residency` on the engines renews leases, releases retained KV and reports
# it, so only holders of the handle key may call it. Each call carries
# `X-Bidirkv-Auth: <unix seconds>.<mac>`, an HMAC with the handle key over the method,
# the path, the time and the body's SHA-256: the key never goes on the wire, a captured
# header is good for that one body for AUTH_SKEW_S only (replaying it repeats the same
# renewal and releases), and a MAC of another purpose (a proof, a handle) never fits it.
RESIDENCY_AUTH_HEADER = "X-Bidirkv-Auth"
AUTH_SKEW_S = 60  # allowed clock skew between the pods, either way
RESIDENCY_AUTH_SCHEME = "Bidirkv-HMAC-SHA256"  # named in a refusal's WWW-Authenticate


def residency_mac(key: bytes, method: str, path: str, stamp: int, body: bytes) -> str:
    digest = hashlib.sha256(body).hexdigest()
    return _hmac_hex(key,
                     f"bidirkv-residency/1|{method.upper()}|{path}|{stamp}|{digest}".encode())


def sign_residency(key: bytes, path: str, body: bytes, now: float | None = None,
                   method: str = "POST") -> str:
    """The `X-Bidirkv-Auth` value for this call."""
    stamp = int(time.time() if now is None else now)
    return f"{stamp}.{residency_mac(key, method, path, stamp, body)}"


def residency_stamp_problem(header: Any, now: float | None = None) -> str | None:
    """What is wrong with the header before its body is read (None: its form and time
    are fine): a caller without the key costs no body read."""
    if header is None:
        return f"missing {RESIDENCY_AUTH_HEADER} header (an HMAC with the handle key)"
    parts = header.split(".") if isinstance(header, str) and len(header) <= 128 else []
    if len(parts) != 2 or not parts[0].isdigit() or len(parts[1]) != 64:
        return f"malformed {RESIDENCY_AUTH_HEADER} header: expected <unix seconds>.<64 hex>"
    t = time.time() if now is None else now
    if abs(int(parts[0]) - t) > AUTH_SKEW_S:
        return (f"{RESIDENCY_AUTH_HEADER} time {parts[0]} is more than {AUTH_SKEW_S} s from "
                f"this engine's clock ({int(t)})")
    return None


def residency_auth_problem(header: Any, keys: Sequence[bytes], path: str, body: bytes,
                           now: float | None = None, method: str = "POST") -> str | None:
    """Why this call does not show a holder of one of `keys` made it (None: it does)."""
    if problem := residency_stamp_problem(header, now):
        return problem
    stamp, mac = header.split(".")
    if not any(hmac.compare_digest(mac, residency_mac(k, method, path, int(stamp), body))
               for k in keys if k):
        return (f"{RESIDENCY_AUTH_HEADER} does not match this body under the handle key "
                "(another key, or the body changed on the way)")
    return None
