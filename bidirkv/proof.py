"""The router's proof on a decode leg: shared by the router (makes it) and the engine
plugin (checks it), and owned by neither.

`nonce.expiry.mac`: an HMAC with the resource's handle key over a random nonce and a
wall-clock expiry. Decode keeps a request's KV and hands out a handle only when the
request carries a valid proof it has not seen before, so only the router, which holds
the key, can obtain handles (bidirkv/connector/core/handles.py).

The same key signs every call to the engines' residency route (`sign_residency`, checked
by bidirkv/connector/endpoint.py): only its holders renew leases, release retained KV,
drain an engine or read its report, and each signature names the one engine it is for.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

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
# `POST /bidirkv/residency` on the engines renews leases, releases retained KV, marks the
# engine draining and reports it, so only holders of the handle key may call it. Each call
# names the engine it is for (`X-Bidirkv-Target: <host>:<port>`) and carries
# `X-Bidirkv-Auth: <unix seconds>.<body length>.<body sha256>.<mac>`, an HMAC with the
# handle key over the method, the path, the target, the time, the body's length and its
# SHA-256. The key never goes on the wire; a captured header is good for that one body, at
# that one engine, for AUTH_SKEW_S only (replaying it repeats the same renewal and
# releases there); and a MAC of another purpose (a proof, a handle) never fits it. As the
# header carries the body's length and digest, the engine checks the MAC before it reads
# a byte of the body: a caller without the key costs no body read.
RESIDENCY_AUTH_HEADER = "X-Bidirkv-Auth"
RESIDENCY_TARGET_HEADER = "X-Bidirkv-Target"
AUTH_SKEW_S = 60  # allowed clock skew between the pods, either way
RESIDENCY_AUTH_SCHEME = "Bidirkv-HMAC-SHA256"  # named in a refusal's WWW-Authenticate
# A target: a DNS name or an IPv4 address, or an IPv6 address in brackets, and a port.
_TARGET = re.compile(r"(?:[a-z0-9_.-]{1,253}|\[[0-9a-f:.]{2,45}\]):[0-9]{1,5}")
_AUTH = re.compile(r"([0-9]{1,12})\.([0-9]{1,12})\.([0-9a-f]{64})\.([0-9a-f]{64})")


def residency_target(url: str) -> str:
    """The engine a call to `url` is for, as the signature names it: `host:port`."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def residency_mac(key: bytes, method: str, path: str, target: str, stamp: int, length: int,
                  digest: str) -> str:
    return _hmac_hex(key, f"bidirkv-residency/2|{method.upper()}|{path}|{target}|{stamp}|"
                          f"{length}|{digest}".encode())


def sign_residency(key: bytes, target: str, path: str, body: bytes, now: float | None = None,
                   method: str = "POST") -> str:
    """The `X-Bidirkv-Auth` value of this call to `target` (residency_target)."""
    stamp = int(time.time() if now is None else now)
    digest = hashlib.sha256(body).hexdigest()
    mac = residency_mac(key, method, path, target, stamp, len(body), digest)
    return f"{stamp}.{len(body)}.{digest}.{mac}"


def residency_headers(key: bytes, target: str, path: str, body: bytes,
                      now: float | None = None) -> dict[str, str]:
    """Both headers of a signed POST of `body` to `target`."""
    return {RESIDENCY_AUTH_HEADER: sign_residency(key, target, path, body, now),
            RESIDENCY_TARGET_HEADER: target}


@dataclass(frozen=True)
class ResidencyAuth:
    """An `X-Bidirkv-Auth` value, parsed."""

    stamp: int
    length: int
    digest: str
    mac: str

    @classmethod
    def parse(cls, header: Any) -> ResidencyAuth | str:
        """The header's parts, or what is wrong with its form."""
        if header is None:
            return f"missing {RESIDENCY_AUTH_HEADER} header (an HMAC with the handle key)"
        m = _AUTH.fullmatch(header) if isinstance(header, str) else None
        if m is None:
            return (f"malformed {RESIDENCY_AUTH_HEADER} header: expected <unix seconds>."
                    "<body length>.<64 hex: the body's sha256>.<64 hex: the mac>")
        return cls(int(m[1]), int(m[2]), m[3], m[4])


def residency_header_problem(header: Any, target: Any, keys: Sequence[bytes], path: str,
                             now: float | None = None, method: str = "POST") -> str | None:
    """Why this call does not show a holder of one of `keys` made it for `target`, from its
    headers alone (None: it does, if its body is the one signed: residency_body_problem).
    Whether `target` is the engine that got the call is the engine's to check."""
    auth = ResidencyAuth.parse(header)
    if isinstance(auth, str):
        return auth
    t = time.time() if now is None else now
    if abs(auth.stamp - t) > AUTH_SKEW_S:
        return (f"{RESIDENCY_AUTH_HEADER} time {auth.stamp} is more than {AUTH_SKEW_S} s from "
                f"this engine's clock ({int(t)})")
    if target is None:
        return f"missing {RESIDENCY_TARGET_HEADER} header (<host>:<port> of the engine called)"
    if not (isinstance(target, str) and _TARGET.fullmatch(target)):
        return (f"malformed {RESIDENCY_TARGET_HEADER} {str(target)[:300]!r}: expected "
                "<host>:<port> in lower case (an IPv6 address in brackets)")
    if not any(hmac.compare_digest(auth.mac, residency_mac(
            k, method, path, target, auth.stamp, auth.length, auth.digest)) for k in keys if k):
        return (f"{RESIDENCY_AUTH_HEADER} does not match under the handle key (another key, "
                "or the call changed on the way)")
    return None


def residency_body_problem(header: str, body: bytes) -> str | None:
    """Why `body` is not the one the (checked) header signed (None: it is)."""
    auth = ResidencyAuth.parse(header)
    if isinstance(auth, str):
        return auth
    if len(body) != auth.length or not hmac.compare_digest(
            hashlib.sha256(body).hexdigest(), auth.digest):
        return (f"the body is not the one {RESIDENCY_AUTH_HEADER} signed (its length or "
                "sha256 differs: it changed on the way)")
    return None


def residency_auth_problem(header: Any, target: Any, keys: Sequence[bytes], path: str,
                           body: bytes, now: float | None = None,
                           method: str = "POST") -> str | None:
    """Why this call does not show a holder of one of `keys` made it, with this body, for
    `target` (None: it does)."""
    return (residency_header_problem(header, target, keys, path, now, method)
            or residency_body_problem(header, body))
