"""`POST /bidirkv/residency` on every engine: vLLM endpoint plugin `bidirkv`.

The router calls it on each decode replica (residency.py has the semantics):

    {"owner": "<router id>", "leaseSeconds": 15, "release": ["<decode request id>", ...],
     "keep": {"<decode request id>": "<note>", ...}, "recall": <cursor>}
    -> {"numBlocks": 1024, "freeBlocks": 700, "retainedBlocks": 120, "releasedBlocks": 8,
        "released": {"router": 3, ...}, "refusals": {...},
        "notes": {"<decode request id>": "<note>"}, "recallNext": 42, "recallMore": false, ...}

It renews the owner's lease, frees the blocks of handles the router dropped, reports
decode's capacity, keeps and recalls notes (core/notes.py), and `"drain": true` (from the
launcher on SIGTERM) marks the engine draining. Each call is signed for the one engine it
names (bidirkv/proof.py, connector/identity.py), checked before the body is read
(connector/bodyread.py): vLLM's API key guards only its own routes, and the engine port
is open to whoever may scrape metrics. What a caller can make decode keep is bounded
(owners, a lease's length, a body's size); the report is running totals, never a walk.
The work runs in the engine core between steps (`EngineCore.bidirkv_residency`,
patches/residency.py), where the scheduler owns the blocks.
"""

import asyncio
import json
import math
import os
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bidirkv.connector.bodyread import READ_S, ReadSlots, read_body
from bidirkv.connector.core.notes import MAX_KEEP, MAX_NOTE
from bidirkv.connector.identity import Here
from bidirkv.connector.settings import Settings
from bidirkv.knobs import OwnerLeaseSeconds
from bidirkv.proof import (
    RESIDENCY_AUTH_HEADER,
    RESIDENCY_AUTH_SCHEME,
    RESIDENCY_TARGET_HEADER,
    ResidencyAuth,
    residency_body_problem,
    residency_header_problem,
)
from bidirkv.wire import (
    RECALL_FIELD,
    RESIDENCY_KEEP_FIELD,
    RESIDENCY_PATH,
    RESIDENCY_VERSION_FIELD,
    VERSION,
    version_problem,
)

MAX_RELEASE = 10_000
MAX_OWNER = 128
MAX_ID = 512
# The longest owner lease any decode grants: the bound of kvTransfer.ownerLeaseSeconds.
MAX_LEASE_S = next(m.le for f in OwnerLeaseSeconds.__metadata__
                   for m in getattr(f, "metadata", ()) if hasattr(m, "le"))
# How long a call waits for the engine core's answer (milliseconds when it is alive). A
# call in flight when vLLM stops its engine core is never answered, and the API server's
# shutdown waits for every request: without a bound a drained pod would not exit.
ENGINE_S = 5.0
# The largest body read: a full release batch of the longest ids, a full batch of notes,
# and the rest.
MAX_BODY = MAX_RELEASE * (MAX_ID + 4) + MAX_KEEP * (MAX_ID + MAX_NOTE + 8) + 4096


def retention_ttl(args: Any) -> int | None:
    """How long this decode keeps a finished request's blocks: `decoder_kv_blocks_ttl` of
    vLLM's --kv-transfer-config (None: not set there)."""
    cfg = getattr(args, "kv_transfer_config", None)
    if isinstance(cfg, str):
        try:
            cfg = json.loads(cfg)
        except ValueError:
            return None
    extra = (cfg.get("kv_connector_extra_config") if isinstance(cfg, dict)
             else getattr(cfg, "kv_connector_extra_config", None))
    ttl = extra.get("decoder_kv_blocks_ttl") if isinstance(extra, dict) else None
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 1 <= ttl <= MAX_LEASE_S:
        return None
    return int(ttl)


def lease_bound(ttl: int | None) -> tuple[int, str]:
    """The longest lease this decode grants, and why: a lease past its blocks' TTL keeps
    nothing longer, only the owner's entry (the operator holds the router to it too)."""
    if ttl is None:
        return MAX_LEASE_S, "the longest owner lease decode grants"
    return ttl, "no longer than this decode keeps a finished request's blocks, " \
        "decoder_kv_blocks_ttl"


def body_problem(body: Any, max_lease: tuple[int, str] = lease_bound(None)) -> str | None:
    """Why a residency request is refused (None: it is fine)."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    unknown = set(body) - {"owner", "leaseSeconds", "release", "drain",
                           RESIDENCY_KEEP_FIELD, RECALL_FIELD, RESIDENCY_VERSION_FIELD}
    if unknown:
        return (f"unknown keys {sorted(unknown)}; allowed: owner, leaseSeconds, release, "
                f"drain, {RESIDENCY_KEEP_FIELD}, {RECALL_FIELD}, {RESIDENCY_VERSION_FIELD}")
    if "drain" in body and not isinstance(body["drain"], bool):
        return f"drain {body['drain']!r}: must be true or false"
    owner, lease_s = body.get("owner"), body.get("leaseSeconds")
    if (owner is None) != (lease_s is None):
        return "owner and leaseSeconds go together"
    if owner is not None and not (isinstance(owner, str) and 0 < len(owner) <= MAX_OWNER):
        return f"owner must be a string of 1-{MAX_OWNER} characters"
    if lease_s is not None and not (
        isinstance(lease_s, int | float) and not isinstance(lease_s, bool)
        and math.isfinite(lease_s) and 1 <= lease_s <= max_lease[0]
    ):
        return f"leaseSeconds {lease_s!r}: must be a number in 1-{max_lease[0]} ({max_lease[1]})"
    release = body.get("release", [])
    if not isinstance(release, list) or len(release) > MAX_RELEASE:
        return f"release must be a list of at most {MAX_RELEASE} request ids"
    # Notes are kept and recalled for an owner: only a call that names one.
    keep = body.get(RESIDENCY_KEEP_FIELD, {})
    if not isinstance(keep, dict) or len(keep) > MAX_KEEP:
        return (f"{RESIDENCY_KEEP_FIELD} must be an object of at most {MAX_KEEP} request "
                "ids to notes")
    if keep and owner is None:
        return f"{RESIDENCY_KEEP_FIELD} needs an owner"
    if RECALL_FIELD in body:
        recall = body[RECALL_FIELD]
        if isinstance(recall, bool) or not isinstance(recall, int) or recall < 0:
            return f"{RECALL_FIELD} {recall!r}: must be a cursor, an integer >= 0"
        if owner is None:
            return f"{RECALL_FIELD} needs an owner"
    return None


def valid_ids(release: list) -> tuple[list[str], int]:
    """(the request ids decode can act on, how many entries were not one). An entry that
    is not a request id names nothing decode holds, so it is skipped, not a reason to
    refuse the batch: that would also refuse the lease renewal it carries, and decode
    would free every conversation of that router."""
    ok = [r for r in release if isinstance(r, str) and 0 < len(r) <= MAX_ID]
    return ok, len(release) - len(ok)


def valid_notes(keep: dict) -> tuple[dict[str, str], int]:
    """(the notes decode can keep, how many entries were not a request id with a note of
    1-MAX_NOTE characters): skipped like invalid release ids, so one bad note never
    costs the lease renewal its call carries."""
    ok = {r: n for r, n in keep.items()
          if 0 < len(r) <= MAX_ID and isinstance(n, str) and 0 < len(n) <= MAX_NOTE}
    return ok, len(keep) - len(ok)


def _error(status: int, kind: str, message: str, **extra: Any) -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": kind, **extra}}


@dataclass(frozen=True)
class Credentials:
    """What a call says about who made it, and for which engine; `here`: the engine as the
    call's connection reaches it."""

    auth: Any  # X-Bidirkv-Auth
    target: Any  # X-Bidirkv-Target
    here: Here


def unauthorized(creds: Credentials, keys: Sequence[bytes], raw: bytes | None) -> str | None:
    """Why the call is refused with 401 (None: a holder of the key made it for this
    engine). `raw` None: the body is not read yet, only the headers are checked."""
    if not keys:
        return "this engine has no handle key (BIDIRKV_HANDLE_KEY): no caller can be trusted"
    # The MAC first: only a holder of the key learns what this engine answers to.
    if problem := residency_header_problem(creds.auth, creds.target, keys, RESIDENCY_PATH):
        return problem
    if problem := creds.here.target_problem(creds.target):
        return problem
    return None if raw is None else residency_body_problem(creds.auth, raw)


def length_problem(declared: str | None, signed: int) -> tuple[int, str] | None:
    """(status, why) when the body cannot be read as the signature has it: its length
    (`signed`) is past MAX_BODY, or is not the request's Content-Length."""
    if signed > MAX_BODY:
        return 413, f"the body is longer than {MAX_BODY} bytes"
    if declared is None:
        return 411, (f"Content-Length is required: {RESIDENCY_AUTH_HEADER} names the body's "
                     "length")
    if declared.strip() != str(signed):
        return 400, (f"Content-Length {declared[:20]!r} is not the body's length "
                     f"{RESIDENCY_AUTH_HEADER} signed, {signed}")
    return None


async def answer(creds: Credentials, raw: bytes, keys: Sequence[bytes],
                 call: Callable[[dict], Awaitable[Any]] | None,
                 max_lease: tuple[int, str] = lease_bound(None),
                 engine_s: float = ENGINE_S) -> tuple[int, dict]:
    """(status, JSON) of one call; `call` runs the engine's utility (None: no engine)."""
    if problem := unauthorized(creds, keys, raw):
        return _error(401, "unauthorized", problem)
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and (problem := version_problem(
            body.get(RESIDENCY_VERSION_FIELD), "the residency call")):
        return _error(409, "wire_version", problem, version=VERSION)
    if (problem := body_problem(body, max_lease)) is not None:
        return _error(400, "invalid_request", problem)
    if call is None:
        return _error(503, "unavailable", "no engine")
    release, skipped = valid_ids(body.get("release") or [])
    keep, skipped_notes = valid_notes(body.get(RESIDENCY_KEEP_FIELD) or {})
    body = {k: v for k, v in body.items() if k != RESIDENCY_VERSION_FIELD}
    if "release" in body:
        body = {**body, "release": release}
    if RESIDENCY_KEEP_FIELD in body:
        body = {**body, RESIDENCY_KEEP_FIELD: keep}
    try:
        out = await asyncio.wait_for(call(body), engine_s)
    except TimeoutError:
        return _error(503, "unavailable", f"the engine did not answer within {engine_s:g} s")
    if isinstance(out, dict) and isinstance(out.get("refused"), str):
        return _error(429, "too_many_owners", out["refused"])
    if skipped and isinstance(out, dict):
        out["skippedIds"] = skipped
    if skipped_notes and isinstance(out, dict):
        out["skippedNotes"] = skipped_notes
    return 200, out


class ResidencyEndpoint:
    """vLLM EndpointPlugin (vllm/plugins/endpoint_plugins/interface.py)."""

    name = "bidirkv"
    required_tasks = ("generate",)

    def __init__(self, slots: ReadSlots | None = None, read_s: float = READ_S,
                 hostname: str | None = None) -> None:
        self.slots = slots or ReadSlots()
        self.read_s = read_s
        self.hostname = hostname or socket.gethostname()

    async def body(self, request: Any, creds: Credentials) -> bytes | tuple[int, dict]:
        """The call's body, once its headers checked; (status, JSON) of a refusal."""
        signed = ResidencyAuth.parse(creds.auth)
        length = signed.length if isinstance(signed, ResidencyAuth) else 0
        if problem := length_problem(request.headers.get("content-length"), length):
            return _error(problem[0], "invalid_request", problem[1])
        with self.slots.take() as took:
            if not took:
                return _error(503, "busy", f"{self.slots.limit} residency calls are being "
                              "read already; try again")
            try:
                raw = await read_body(request, length, self.read_s)
            except TimeoutError:
                return _error(408, "invalid_request",
                              f"the body did not arrive within {self.read_s:g} s")
        if raw is None:
            return _error(413, "invalid_request",
                          f"the body is longer than its signed {length} bytes")
        return raw

    def attach_router(self, app: Any) -> None:
        from fastapi import Request
        from fastapi.responses import JSONResponse
        from starlette.requests import ClientDisconnect

        keys = Settings.from_env(os.environ).handle_keys
        refusal_headers = {
            401: {"WWW-Authenticate": f'{RESIDENCY_AUTH_SCHEME} header="{RESIDENCY_AUTH_HEADER}"'},
            503: {"Retry-After": "1"}}

        def reply(status: int, out: Any) -> JSONResponse:
            return JSONResponse(out, status_code=status, headers=refusal_headers.get(status))

        # No postponed annotations in this module: FastAPI reads `Request` at runtime.
        async def residency(request: Request) -> JSONResponse:
            creds = Credentials(request.headers.get(RESIDENCY_AUTH_HEADER),
                                request.headers.get(RESIDENCY_TARGET_HEADER),
                                Here.of(request.scope.get("server"), self.hostname))
            # A caller without the key, or calling another engine, costs no body read.
            if problem := unauthorized(creds, keys, None):
                return reply(*_error(401, "unauthorized", problem))
            try:
                raw = await self.body(request, creds)
            except ClientDisconnect:  # gone before its body came: nobody to answer
                return reply(*_error(400, "invalid_request", "the caller left"))
            if isinstance(raw, tuple):
                return reply(*raw)
            engine = getattr(request.app.state, "bidirkv_engine", None)
            call = None if engine is None else (
                lambda body: engine.engine_core.call_utility_async("bidirkv_residency", body))
            max_lease = getattr(request.app.state, "bidirkv_max_lease", lease_bound(None))
            return reply(*await answer(creds, raw, keys, call, max_lease))

        app.add_api_route(RESIDENCY_PATH, residency, methods=["POST"], include_in_schema=False)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        state.bidirkv_engine = engine_client
        state.bidirkv_max_lease = lease_bound(retention_ttl(args))
