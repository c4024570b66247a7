"""What the router sends upstream and reads back: the two legs' bodies, an upstream
request's headers, and the few fields of an engine's reply it reads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bidirkv.proof import make_proof
from bidirkv.router.codec import dumps
from bidirkv.router.engine.sse import PARAMS
from bidirkv.router.request.replies import JSON_TYPE
from bidirkv.router.request.validation import CHAT
from bidirkv.wire import (
    COUNTS_KEY,
    OWNER_KEY,
    PROOF_KEY,
    RETURN_KEY,
    SHARED_BLOCKS_KEY,
    TENANT_KEY,
    TENANT_LABEL_LEN,
    VERSION,
    VERSION_KEY,
)

PATHS = {CHAT: "/v1/chat/completions", "completions": "/v1/completions"}
PARAMS_MARKER = b'"kv_transfer_params"'
_MISS_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# vLLM's prefix cache, and the connector's digests, match only requests of one salt.
SALT_KEY = "cache_salt"
# Fields a one-token prefill must not carry (they would change or fail a max_tokens=1 run).
_PREFILL_DROP = ("max_completion_tokens", "min_tokens", "stream_options")


def salt(body: dict[str, Any], salt_of: Callable[[str | None], str]) -> None:
    """Give the client's body its tenant's `cache_salt` (`salt_of(the client's salt)`).
    Set once on the body every leg is built from: both legs, an extend and a prefill-only
    answer carry the same salt, so reuse between them is kept. The client's salt, if any,
    is a non-empty string of at most MAX_CACHE_SALT characters (parse_request)."""
    body[SALT_KEY] = salt_of(body.get(SALT_KEY))


def prefill_body(body: dict[str, Any], handle: dict[str, Any] | None,
                 proof: str | None = None) -> dict[str, Any]:
    """The prefill leg's body: one token, not streamed, asking P to keep its blocks for D;
    with a handle, also telling P where D holds this conversation's earlier blocks. The
    router's proof: without it P keeps nothing for D and hands out no handle, so nobody
    but the router can obtain one of P's (and replay it after P reused the blocks)."""
    out = dict(body)
    out["stream"] = False
    out["max_tokens"] = 1
    for key in _PREFILL_DROP:
        out.pop(key, None)
    if handle is not None:
        kv = dict(handle)
        kv["do_remote_decode"] = True
        kv["do_remote_prefill"] = False
    else:
        kv = dict(_MISS_PARAMS)
    if proof is not None:
        kv[PROOF_KEY] = proof
    kv[VERSION_KEY] = VERSION
    out[PARAMS] = kv
    return out


def decode_body(body: dict[str, Any], p_params: Any, owner: str | None = None,
                proof: str | None = None, tenant: bytes | None = None,
                gap: float | None = None) -> dict[str, Any]:
    """The client's body plus P's params as P signed them (host included), the router that
    will own D's handle (D keeps the blocks while that owner renews), the tenant's label,
    the conversation's gap (when it is expected back: what D releases by), and the
    router's proof, without which D keeps nothing and hands out no handle."""
    out = dict(body)
    if isinstance(p_params, dict):
        kv = dict(p_params)
        if owner is not None:
            kv[OWNER_KEY] = owner
        if tenant is not None:
            kv[TENANT_KEY] = tenant.hex()[:TENANT_LABEL_LEN]
        if gap is not None:
            kv[RETURN_KEY] = round(gap, 3)
        if proof is not None:
            kv[PROOF_KEY] = proof
        kv[VERSION_KEY] = VERSION
        out[PARAMS] = kv
    return out


# The decode leg of a turn extended on its holder: no P params, both flags false. D
# prefills the prompt on top of its own KV and, with the router's proof, keeps the blocks
# and hands out the next handle, as after any decode leg.
LOCAL_PARAMS = {"do_remote_prefill": False, "do_remote_decode": False}


def model_len(models: Any, name: str | None) -> int | None:
    """`max_model_len` of the model named `name` (else the first) in a /v1/models reply."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        return None
    cards = [m for m in data if isinstance(m, dict)]
    chosen = next((m for m in cards if m.get("id") == name), cards[0] if cards else None)
    n = chosen.get("max_model_len") if chosen else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def shared_blocks(params: dict[str, Any], total: int) -> int:
    """Of a D handle's `total` blocks, those D said other kept requests already pinned
    (wire.SHARED_BLOCKS_KEY). Taken out of `params`: the router's to read, never sent on.
    0 from a decode that does not say, or says nonsense."""
    n = params.pop(SHARED_BLOCKS_KEY, None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return 0
    return min(n, total)


def handle_blocks(params: dict[str, Any]) -> int:
    """Blocks a D handle pins on its replica (all KV groups): its counts (wire.COUNTS_KEY),
    or the length of vLLM's id lists in a handle that carries them."""
    counts = params.get(COUNTS_KEY)
    if isinstance(counts, list):
        return sum(n for n in counts if isinstance(n, int) and not isinstance(n, bool)
                   and n > 0)
    ids = params.get("remote_block_ids")
    if not isinstance(ids, list):
        return 0
    return sum(len(g) for g in ids if isinstance(g, list))


def upstream_headers(rid: str, auth: str | None,
                     trace: dict[str, str] | None = None) -> dict[str, str]:
    """An upstream request's headers; `trace`: its traceparent (and tracestate)."""
    h = {"Content-Type": JSON_TYPE, "X-Request-Id": rid}
    if auth:
        h["Authorization"] = auth
    if trace:
        h.update(trace)
    return h


def decode_payload(handle_key: bytes | None, body: dict[str, Any], p_params: Any,
                   owner: str | None, tenant: bytes | None, gap: float | None) -> bytes:
    """A decode (or extend) leg's body as it goes out (see decode_body), with a proof made
    then (`handle_key`: None when the router keeps none of D's handles, or has no key)."""
    proof = make_proof(handle_key) if handle_key else None
    return dumps(decode_body(body, p_params, owner, proof, tenant, gap))


def prefill_payload(handle_key: bytes | None, body: dict[str, Any],
                    handle: dict[str, Any] | None) -> bytes:
    """The prefill leg's body, with a fresh single-use proof each time it is built
    (a stale-connection retry builds it again: P may have seen the first proof)."""
    proof = make_proof(handle_key) if handle_key else None
    return dumps(prefill_body(body, handle, proof))
