"""`kv_transfer_params` as they arrive at an engine: checked, authenticated, single use.

A handle (the `remote_*` fields) tells the engine which blocks of which peer to read over
NIXL. Reads are one-sided: the peer does not check what is read, so a handle made up by
a client, or replayed after its blocks were freed and reused, reads another request's
KV. vLLM takes the dict from the request body as it is, so a wrong type also ends up in
the scheduler, where it can take the engine down. Here every handle is either exactly
well formed, signed by the engine that issued it and seen for the first time, or it is
dropped and the request is served without reuse.

The signature is an HMAC over everything the reading engine acts on: engine, request,
host and port (the reader connects only where the signature says), blocks, token counts,
expiry, digests and (vLLM 0.33) the issuer's registration generation. `bidirkv_expires`
is the issuer's wall-clock deadline for the blocks (D: `decoder_kv_blocks_ttl`; P: its
lease), signed with the rest: a handle admitted after it (beyond a few seconds of clock
skew between nodes) is dropped, so a handle that leaked is worthless once its blocks may
hold other KV, whatever the replay guard still remembers. vLLM's own
`remote_blocks_expiry_time` is the issuer's `perf_counter`, which another node cannot
compare. It leaves out only the direction flags, which the router sets per leg. Its key
is `BIDIRKV_HANDLE_KEY`, identical on every engine of a resource (the operator's
Secret); `BIDIRKV_HANDLE_KEY_PREVIOUS` is also accepted during a rotation.
There is no default key: an engine without one does not start (plugin.py).

Decode hands out a handle only to a request that carries the router's proof
(`bidirkv_proof`, bidirkv/proof.py): a caller who can reach the engine but does not hold
the key gets its answer and nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bidirkv.wire import (
    BLOCKS_KEY,
    COUNTS_KEY,
    EXPIRES_KEY,
    MAC_KEY,
    PROOF_KEY,
    SHARE_PREFIX,
    SHARED_KEY,
    VERSION_KEY,
    version_problem,
)

# vLLM 0.33 adds the issuer's registration generation to every handle: a reader that
# sees a newer one drops its agent for that peer and handshakes again (the peer
# registered its KV memory anew). Signed like the rest: stripped or lowered, a reader
# would read with the old registration.
GENERATION = "remote_registration_generation"
HANDLE_KEYS = (
    "remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
    "remote_port", "remote_num_tokens", "remote_blocks_expiry_time", "tp_size", "dcp_size",
    "pp_size", GENERATION, BLOCKS_KEY, COUNTS_KEY, EXPIRES_KEY, MAC_KEY,
)
# Nodes keep time with NTP (milliseconds apart); a few seconds of slack never lets a
# handle outlive its blocks, which the issuer keeps well past a router's TTL for them.
CLOCK_SKEW_S = 5.0
FLAGS = ("do_remote_prefill", "do_remote_decode")
MAX_GROUPS = 16
MAX_ID_LEN = 512
MAX_PARALLEL = 4096
MAC_HEX = 32
# What a compact handle's block ids are on the reader until the issuer's grant gives the
# real ones (nixl/worker.py): an id no block pool has, so a read of it fails instead of
# reading another block.
PLACEHOLDER_ID = (1 << 31) - 1


def _is_int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _is_str(v: Any, hi: int = MAX_ID_LEN) -> bool:
    return isinstance(v, str) and 0 < len(v) <= hi


def _blocks_problem(params: dict[str, Any], max_tokens: int) -> str | None:
    """A handle names its blocks by vLLM's id lists (P's) or by counts (D's), not both."""
    ids, counts = params.get("remote_block_ids"), params.get(COUNTS_KEY)
    if (ids is None) == (counts is None):
        return f"a handle carries exactly one of remote_block_ids and {COUNTS_KEY}"
    if counts is not None:
        # A group never has more blocks than the model has positions (block size >= 1).
        if not (isinstance(counts, list) and 0 < len(counts) <= MAX_GROUPS
                and all(_is_int(n, 0, max_tokens + 1) for n in counts)):
            return (f"{COUNTS_KEY} must be a list of 1-{MAX_GROUPS} block counts of "
                    f"0-{max_tokens + 1}")
        return None
    if not isinstance(ids, list) or not 0 < len(ids) <= MAX_GROUPS:
        return "remote_block_ids must be a non-empty list of block-id lists"
    for group in ids:
        if not isinstance(group, list) or len(group) > max_tokens + 1:
            return f"remote_block_ids groups must be lists of at most {max_tokens + 1} ids"
        if not all(_is_int(b, 0, (1 << 31) - 1) for b in group):
            return "remote_block_ids must hold non-negative integers"
    return None


def block_counts(params: dict[str, Any]) -> list[int]:
    """Blocks per KV group a well-formed handle names."""
    counts = params.get(COUNTS_KEY)
    if counts is not None:
        return list(counts)
    return [len(g) for g in params.get("remote_block_ids") or ()]


def compact(out: dict[str, Any] | None) -> dict[str, Any] | None:
    """A handle as it leaves its issuer: one signed with its counts no longer carries
    the ids (decode's retention kept them; the grant hands them to the reader)."""
    if out is not None and COUNTS_KEY in out:
        out.pop("remote_block_ids", None)
    return out


def placeholder_ids(counts: Sequence[int]) -> list[list[int]]:
    """vLLM's scheduler takes a read only with a block list of the read's length; a
    compact handle's real ids come with the grant (see PLACEHOLDER_ID)."""
    return [[PLACEHOLDER_ID] * n for n in counts]


def handle_problem(params: dict[str, Any], max_tokens: int) -> str | None:
    """Why the handle in `params` is not well formed (None: it is)."""
    problem = _blocks_problem(params, max_tokens)
    if problem is not None:
        return problem
    if COUNTS_KEY in params and not (params.get("do_remote_decode") is True
                                     or params.get("do_remote_prefill") is True):
        # The ids come with the ask before a read (lease.py); a leg that reads nothing
        # never asks.
        return (f"a handle with {COUNTS_KEY} is read on a leg with do_remote_decode or "
                "do_remote_prefill")
    if not _is_str(params.get("remote_engine_id")):
        return "remote_engine_id must be a non-empty string"
    if not _is_str(params.get("remote_request_id")):
        return "remote_request_id must be a non-empty string"
    if not _is_str(params.get("remote_host"), 255):
        return "remote_host must be a non-empty string"
    if not _is_int(params.get("remote_port"), 1, 65535):
        return "remote_port must be an integer 1-65535"
    n = params.get("remote_num_tokens")
    if n is not None and not _is_int(n, 0, max_tokens + 1):
        return f"remote_num_tokens must be an integer 0-{max_tokens + 1}"
    gen = params.get(GENERATION)
    if gen is not None and not _is_int(gen, 0, (1 << 63) - 1):
        return f"{GENERATION} must be a non-negative integer"
    for key in ("tp_size", "dcp_size", "pp_size"):
        if key in params and params[key] is not None and not _is_int(
            params[key], 1, MAX_PARALLEL
        ):
            return f"{key} must be a positive integer"
    exp = params.get("remote_blocks_expiry_time")
    if exp is not None and not (
        isinstance(exp, int | float) and not isinstance(exp, bool) and math.isfinite(exp)
    ):
        return "remote_blocks_expiry_time must be a finite number"
    if not _is_finite(params.get(EXPIRES_KEY)):
        return f"{EXPIRES_KEY} must be a finite number (the issuer's deadline)"
    mac = params.get(MAC_KEY)
    if not (isinstance(mac, str) and len(mac) == MAC_HEX):
        return "the handle is not signed (no bidirkv_mac)"
    return None


def _is_finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def stamp_expiry(params: dict[str, Any], lifetime_s: float, wall: float | None = None) -> None:
    """The issuer's deadline for its blocks, to be signed with the handle."""
    params[EXPIRES_KEY] = round((time.time() if wall is None else wall) + lifetime_s, 3)


def _mac_message(params: dict[str, Any]) -> bytes:
    # Layout 3 for handles without a registration generation (vLLM 0.32): their MACs are
    # those of earlier bidir-kv releases, so engines of both read each other's handles
    # during a rolling upgrade. Layout 4 (vLLM 0.33) signs the generation too; removing
    # it or adding one changes the layout, so the MAC no longer matches.
    # Layouts 5 and 6 (wire version 3): a compact handle signs its counts where the ids
    # were; the ids it was issued with stay with the issuer, which hands them over itself.
    gen = params.get(GENERATION)
    counts = params.get(COUNTS_KEY)
    fields = [
        (3 if gen is None else 4) + (0 if counts is None else 2),
        params.get("remote_engine_id"),
        params.get("remote_request_id"),
        params.get("remote_host"),
        params.get("remote_port"),
        params.get("remote_block_ids") if counts is None else counts,
        params.get("remote_num_tokens"),
        params.get("remote_blocks_expiry_time"),
        params.get("tp_size"),
        params.get("dcp_size"),
        params.get("pp_size"),
        params.get(BLOCKS_KEY),
        params.get(EXPIRES_KEY),
        *(() if gen is None else (gen,)),
    ]
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


Keys = bytes | Sequence[bytes]


def _keys(keys: Keys) -> tuple[bytes, ...]:
    return (keys,) if isinstance(keys, bytes) else tuple(k for k in keys if k)


def sign(params: dict[str, Any], key: bytes) -> str:
    if not key:
        raise ValueError("no handle key")
    return hmac.new(key, _mac_message(params), hashlib.sha256).hexdigest()[:MAC_HEX]


def signature_ok(params: dict[str, Any], keys: Keys) -> bool:
    """Signed with one of `keys` (the current key, then the previous one)."""
    mac = params.get(MAC_KEY)
    return isinstance(mac, str) and any(
        hmac.compare_digest(mac, sign(params, k)) for k in _keys(keys))


def normalized(params: dict[str, Any]) -> dict[str, Any]:
    """Upstream returns block ids as a tuple of lists; signing needs their JSON form."""
    out = dict(params)
    ids = out.get("remote_block_ids")
    if isinstance(ids, tuple | list):
        out["remote_block_ids"] = [list(g) for g in ids]
    return out


@dataclass
class Admission:
    params: dict[str, Any]
    handle: bool  # a handle survived and may be used
    problem: str | None = None  # why a handle that was offered was dropped
    reason: str | None = None  # short code of the problem, for the report


def admit(params: dict[str, Any], keys: Keys, max_tokens: int,
          seen: ReplayGuard | None = None, now: float | None = None,
          wall: float | None = None) -> Admission:
    """The params an engine may act on: internal keys and bad handles removed.

    `now` is the replay guard's (monotonic) clock, `wall` the wall clock expiry is
    checked against."""
    # Keys with a leading underscore are vLLM's own per-request state; the proof is
    # checked by the caller before this. The wire version is the leg's (the router
    # writes it on every leg), outside the handle's signature like the direction flags.
    out = {k: v for k, v in params.items()
           if not str(k).startswith("_") and k != PROOF_KEY}
    # The router's word that this read leaves the blocks retained (a child reading its
    # parent's): never spent, so not a use the replay guard keeps.
    shared = out.pop(SHARED_KEY, None) is True
    for flag in FLAGS:
        if flag in out and not isinstance(out[flag], bool | None):
            out[flag] = False
    offered = any(out.get(k) is not None for k in HANDLE_KEYS)
    if not offered:
        return Admission(out, handle=False)
    problem, reason = version_problem(params.get(VERSION_KEY), "the leg"), "wire_version"
    if problem is None:
        problem, reason = handle_problem(out, max_tokens), "malformed"
    if problem is None and not signature_ok(out, keys):
        problem, reason = "the handle's signature does not match", "unauthenticated"
    if problem is None and (time.time() if wall is None else wall) > (
            out[EXPIRES_KEY] + CLOCK_SKEW_S):
        problem, reason = "the handle expired (its issuer may have freed the blocks)", "expired"
    if problem is None and not shared and seen is not None and not seen.first_use(
            out[MAC_KEY], now):
        problem, reason = "the handle was already used", "replayed"
    if problem is None:
        if shared:  # asked and notified for as such (core/residency.py, `share`)
            out["remote_request_id"] = SHARE_PREFIX + out["remote_request_id"]
        return Admission(out, handle=True)
    for k in HANDLE_KEYS:
        out.pop(k, None)
    # Without a handle there is nothing to pull; P still serves as a plain prefill.
    out["do_remote_prefill"] = False
    return Admission(out, handle=False, problem=problem, reason=reason)


@dataclass
class ReplayGuard:
    """Signatures of handles already accepted by this engine, for a while.

    A handle is a one-time capability: its blocks are freed once read, and may then
    hold another request's KV.
    """

    ttl: float
    capacity: int = 200_000
    _seen: OrderedDict[str, float] = field(default_factory=OrderedDict)

    def first_use(self, mac: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        while self._seen and (
            next(iter(self._seen.values())) <= now or len(self._seen) >= self.capacity
        ):
            self._seen.popitem(last=False)
        if mac in self._seen:
            return False
        self._seen[mac] = now + self.ttl
        return True
