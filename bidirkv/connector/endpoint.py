"""`POST /bidirkv/residency` on every engine: vLLM endpoint plugin `bidirkv`.

The router calls it on each decode replica (residency.py has the semantics):

    {"owner": "<router id>", "leaseSeconds": 15, "release": ["<decode request id>", ...]}
    -> {"numBlocks": 1024, "freeBlocks": 700, "retainedBlocks": 120, "releasedBlocks": 8,
        "released": {"router": 3, ...}, "refusals": {...}, ...}

It renews the owner's lease (its handles survive only while it calls), frees the blocks of
handles the router dropped, and reports decode's capacity. `"drain": true` (sent by the
launcher on SIGTERM, bidirkv/connector/supervise.py) marks the engine draining: the report
then says `"draining": true`, and the router places nothing new there. Loaded through vLLM's
`vllm.endpoint_plugins` entry point, which vLLM loads only when `VLLM_PLUGINS` names it
(the operator sets `VLLM_PLUGINS=bidirkv` on engine pods). The work runs in the engine
core as a utility call (`EngineCore.bidirkv_residency`, patches/residency.py), between steps,
where the scheduler owns the blocks.
"""


import math
from typing import Any

from bidirkv.wire import RESIDENCY_PATH, RESIDENCY_VERSION_FIELD, VERSION, version_problem

MAX_RELEASE = 10_000
MAX_OWNER = 128
MAX_ID = 512


def body_problem(body: Any) -> str | None:
    """Why a residency request is refused (None: it is fine)."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    unknown = set(body) - {"owner", "leaseSeconds", "release", "drain",
                           RESIDENCY_VERSION_FIELD}
    if unknown:
        return (f"unknown keys {sorted(unknown)}; allowed: owner, leaseSeconds, release, "
                f"drain, {RESIDENCY_VERSION_FIELD}")
    if "drain" in body and not isinstance(body["drain"], bool):
        return f"drain {body['drain']!r}: must be true or false"
    owner, lease_s = body.get("owner"), body.get("leaseSeconds")
    if (owner is None) != (lease_s is None):
        return "owner and leaseSeconds go together"
    if owner is not None and not (isinstance(owner, str) and 0 < len(owner) <= MAX_OWNER):
        return f"owner must be a string of 1-{MAX_OWNER} characters"
    if lease_s is not None and not (
        isinstance(lease_s, int | float) and not isinstance(lease_s, bool)
        and math.isfinite(lease_s) and 1 <= lease_s <= 86400
    ):
        return f"leaseSeconds {lease_s!r}: must be a number in 1-86400"
    release = body.get("release", [])
    if not isinstance(release, list) or len(release) > MAX_RELEASE:
        return f"release must be a list of at most {MAX_RELEASE} request ids"
    return None


def valid_ids(release: list) -> tuple[list[str], int]:
    """(the request ids decode can act on, how many entries were not one). An entry that
    is not a request id names nothing decode holds, so it is skipped, not a reason to
    refuse the batch: that would also refuse the lease renewal it carries, and decode
    would free every conversation of that router."""
    ok = [r for r in release if isinstance(r, str) and 0 < len(r) <= MAX_ID]
    return ok, len(release) - len(ok)


class ResidencyEndpoint:
    """vLLM EndpointPlugin (vllm/plugins/endpoint_plugins/interface.py)."""

    name = "bidirkv"
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        from fastapi import Request
        from fastapi.responses import JSONResponse

        # No postponed annotations in this module: FastAPI reads `Request` at runtime.
        async def residency(request: Request) -> JSONResponse:
            try:
                body = await request.json()
            except ValueError:
                body = None
            if isinstance(body, dict) and (problem := version_problem(
                    body.get(RESIDENCY_VERSION_FIELD), "the residency call")):
                return JSONResponse({"error": {"message": problem, "type": "wire_version",
                                               "version": VERSION}}, status_code=409)
            problem = body_problem(body)
            if problem is not None:
                return JSONResponse({"error": {"message": problem, "type": "invalid_request"}},
                                    status_code=400)
            engine = getattr(request.app.state, "bidirkv_engine", None)
            if engine is None:
                return JSONResponse({"error": {"message": "no engine", "type": "unavailable"}},
                                    status_code=503)
            release, skipped = valid_ids(body.get("release") or [])
            body = {k: v for k, v in body.items() if k != RESIDENCY_VERSION_FIELD}
            if "release" in body:
                body = {**body, "release": release}
            out = await engine.engine_core.call_utility_async("bidirkv_residency", body)
            if skipped and isinstance(out, dict):
                out["skippedIds"] = skipped
            return JSONResponse(out)

        app.add_api_route(RESIDENCY_PATH, residency, methods=["POST"], include_in_schema=False)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        state.bidirkv_engine = engine_client
