"""The router's HTTP routes: the OpenAI-compatible API, conversations, health, readiness,
metrics; and the middleware that turns every error into a JSON body."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Any

from aiohttp import web

from bidirkv.router.codec import dumps, dumps_kept, loads
from bidirkv.router.datapath.admission import logged
from bidirkv.router.datapath.health import UNAVAILABLE, recalling, serving_mode
from bidirkv.router.datapath.proxy import Router
from bidirkv.router.request.replies import json_error, json_response
from bidirkv.router.request.validation import CHAT, COMPLETIONS, MAX_CONVERSATION_ID
from bidirkv.router.store.base import Kept, StoreUnavailable
from bidirkv.router.tracing.spans import traced
from bidirkv.wire import COUNTS_KEY

log = logging.getLogger("bidirkv.router")

ROUTER = web.AppKey("router", Router)
CONVERSATION = "/v1/conversations/{conversation_id}"


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """404/405/unexpected errors as OpenAI-style JSON; nothing a client sends is a 500."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        if exc.status == 404:
            msg = f"no route {request.method} {request.path}"
        elif exc.status == 405:
            msg = f"method {request.method} not allowed on {request.path}; allowed: " + \
                headers.get("Allow", "")
        else:
            msg = exc.reason
        return json_error(exc.status, msg, "not_found" if exc.status == 404 else
                          "invalid_request_error", headers=headers)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s rid=%s", request.method,
                      logged(request.path), logged(request.headers.get("X-Request-Id")))
        return json_error(500, "internal router error", "internal_error")


async def _end_conversation(request: web.Request) -> web.Response:
    """DELETE /v1/conversations/{id}: 204 when this tenant had a handle for it, else 404."""
    router = request.app[ROUTER]
    # The route's template, never the conversation id, names the span.
    trace = router.ctx.traces.request(request.method, CONVERSATION, request.headers)

    async def handler() -> tuple[web.Response, str]:
        resp = await _end(router, request)
        return resp, "ok" if resp.status < 400 else "client_error"

    resp, _ = await traced(trace, handler)
    return resp


async def _end(router: Router, request: web.Request) -> web.Response:
    cid = request.match_info["conversation_id"]
    if len(cid) > MAX_CONVERSATION_ID:
        return json_error(400, f"conversation id: {len(cid)} characters is too long; at most "
                          f"{MAX_CONVERSATION_ID} allowed", param="conversation_id")
    tenant = router.conversations.tenant(request)
    if await router.conversations.end_conversation(tenant, cid):
        return web.Response(status=204)
    return json_error(404, "no stored conversation with this id for this tenant (never "
                      "stored, already ended, expired or released)", "not_found",
                      param="conversation_id")


async def _health(request: web.Request) -> web.Response:
    return json_response(200, b'{"status":"ok"}')


async def _ready(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    mode, reason = serving_mode(router.ctx)
    # A restarted router waits for the handles decode kept for it; in a rollout the old
    # router serves meanwhile (bounded: a crash leaves no other).
    waiting = recalling(router.ctx) if mode != UNAVAILABLE else []
    ready = mode != UNAVAILABLE and not waiting
    if waiting:
        reason = (f"recalling the handles decode kept for this router from {len(waiting)} "
                  "replica(s)")
    body = dumps({
        "ready": ready,
        # prefill-only still serves: see bidirkv/router/datapath/flow.py
        "mode": mode, "reason": reason, "recalling": waiting,
        "prefill": {"healthy": len(router.ctx.prefill.healthy()),
                    "total": len(router.ctx.prefill.backends)},
        "decode": {"healthy": len(router.ctx.decode.healthy()),
                   "total": len(router.ctx.decode.backends)},
        # Serving goes on without reuse while a shared store is away.
        "handleStore": {"shared": router.ctx.store.owner is not None
                        or router.ctx.cfg.handle_store is not None,
                        "available": router.ctx.store.available},
    })
    return json_response(200 if ready else 503, body)


async def _metrics(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    with contextlib.suppress(StoreUnavailable):
        router.ctx.metrics.handles.set(await router.ctx.store.count())
    for b in router.ctx.backends():
        router.ctx.metrics.backend_outstanding.labels(b.role, b.url).set(b.outstanding)
    body, ctype = router.ctx.metrics.exposition()
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = ctype
    return resp


async def _debug_fill(request: web.Request) -> web.Response:
    """POST {"count": N, "blocks": B}: N handles shaped like D's, via the store's put."""
    router = request.app[ROUTER]
    spec = loads(await request.read() or b"{}")
    count, blocks = int(spec.get("count", 1000)), int(spec.get("blocks", 64))
    base = await router.ctx.store.count()
    decode = router.ctx.decode.backends[0].url if router.ctx.decode.backends else "http://decode"
    for i in range(count):
        n = base + i
        params = {
            "do_remote_prefill": False, "do_remote_decode": True,
            COUNTS_KEY: [blocks],
            "remote_engine_id": "a3f1c2d4-5e6f-4a7b-8c9d-0e1f2a3b4c5d",
            "remote_request_id": f"chatcmpl-{n:032x}", "remote_host": "10.0.12.34",
            "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
            "remote_num_tokens": blocks * 16 - 1, "remote_blocks_expiry_time": 12345.678,
            "transfer_mode": "pull",
        }
        key = n.to_bytes(16, "big")
        await router.ctx.store.put(Kept(key, dumps_kept(params), decode,
                                    params["remote_engine_id"], params["remote_num_tokens"]))
    return json_response(200, dumps({"stored": await router.ctx.store.count()}))


def add_metrics_routes(app: web.Application) -> None:
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/health", _health)


def add_routes(app: web.Application, debug: bool, metrics: bool = True) -> None:
    router = app[ROUTER]
    # The router's own handlers, bound once: no lookup of it, or frame, on every request.
    app.router.add_post("/v1/chat/completions",
                        functools.partial(router.handle_generate, kind=CHAT))
    app.router.add_post("/v1/completions",
                        functools.partial(router.handle_generate, kind=COMPLETIONS))
    app.router.add_get("/v1/models", router.handle_models)
    app.router.add_delete(CONVERSATION, _end_conversation)
    app.router.add_get("/ready", _ready)
    if metrics:
        add_metrics_routes(app)
    else:
        app.router.add_get("/health", _health)
    if debug:
        app.router.add_post("/debug/fill-handles", _debug_fill)
