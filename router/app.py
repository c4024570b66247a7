"""`bidir-kv router`: the HTTP server, its routes and the command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from .codec import dumps, loads
from .config import ConfigError, RouterConfig, load_config
from .handlestore import StoreUnavailable
from .identity import tenant_of
from .prefillonly import UNAVAILABLE
from .proxy import HANDLE_KEY_ENV, Router, json_error, json_response
from .reload import ConfigWatcher
from .validation import CHAT, COMPLETIONS, MAX_CONVERSATION_ID

log = logging.getLogger("bidirkv.router")

ROUTER = web.AppKey("router", Router)
WATCHER = web.AppKey("watcher", ConfigWatcher)
STORE_PASSWORD_ENV = "BIDIRKV_HANDLE_STORE_PASSWORD"
# Off unless set: lets benchmarks fill the handle store without 100k real requests.
DEBUG_ENV = "BIDIRKV_ROUTER_DEBUG"


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
        log.exception("unhandled error on %s %s rid=%s", request.method, request.path,
                      request.headers.get("X-Request-Id", "-"))
        return json_error(500, "internal router error", "internal_error")


async def _chat(request: web.Request) -> web.StreamResponse:
    return await request.app[ROUTER].handle_generate(request, CHAT)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await request.app[ROUTER].handle_generate(request, COMPLETIONS)


async def _models(request: web.Request) -> web.StreamResponse:
    return await request.app[ROUTER].handle_models(request)


async def _end_conversation(request: web.Request) -> web.Response:
    """DELETE /v1/conversations/{id}: 204 when this tenant had a handle for it, else 404."""
    router = request.app[ROUTER]
    cid = request.match_info["conversation_id"]
    if len(cid) > MAX_CONVERSATION_ID:
        return json_error(400, f"conversation id: {len(cid)} characters is too long; at most "
                          f"{MAX_CONVERSATION_ID} allowed", param="conversation_id")
    tenant = tenant_of(request.headers.get(router.cfg.tenant_header))
    if await router.end_conversation(tenant, cid):
        return web.Response(status=204)
    return json_error(404, "no stored conversation with this id for this tenant (never "
                      "stored, already ended, expired or released)", "not_found",
                      param="conversation_id")


async def _health(request: web.Request) -> web.Response:
    return json_response(200, b'{"status":"ok"}')


async def _ready(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    mode, reason = router.serving_mode()
    body = dumps({
        "ready": mode != UNAVAILABLE,
        "mode": mode, "reason": reason,  # prefill-only still serves: see router/prefillonly.py
        "prefill": {"healthy": len(router.prefill.healthy()),
                    "total": len(router.prefill.backends)},
        "decode": {"healthy": len(router.decode.healthy()),
                   "total": len(router.decode.backends)},
        # Serving goes on without reuse while a shared store is away.
        "handleStore": {"shared": router.store.owner is not None
                        or router.cfg.handle_store is not None,
                        "available": router.store.available},
    })
    return json_response(503 if mode == UNAVAILABLE else 200, body)


async def _metrics(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    with contextlib.suppress(StoreUnavailable):
        router.metrics.handles.set(await router.store.count())
    for b in router.backends():
        router.metrics.backend_outstanding.labels(b.role, b.url).set(b.outstanding)
    body, ctype = router.metrics.exposition()
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = ctype
    return resp


async def _debug_fill(request: web.Request) -> web.Response:
    """POST {"count": N, "blocks": B}: N handles shaped like D's, via the store's put."""
    router = request.app[ROUTER]
    spec = loads(await request.read() or b"{}")
    count, blocks = int(spec.get("count", 1000)), int(spec.get("blocks", 64))
    base = await router.store.count()
    decode = router.decode.backends[0].url if router.decode.backends else "http://decode"
    for i in range(count):
        n = base + i
        params = {
            "do_remote_prefill": False, "do_remote_decode": True,
            "remote_block_ids": [[100000 + (n * blocks + j) % 900000 for j in range(blocks)]],
            "remote_engine_id": "a3f1c2d4-5e6f-4a7b-8c9d-0e1f2a3b4c5d",
            "remote_request_id": f"chatcmpl-{n:032x}", "remote_host": "10.0.12.34",
            "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
            "remote_num_tokens": blocks * 16 - 1, "remote_blocks_expiry_time": 12345.678,
            "transfer_mode": "pull",
        }
        key = n.to_bytes(16, "big")
        await router.store.put(key, dumps(params), decode, params["remote_engine_id"],
                               params["remote_num_tokens"])
    return json_response(200, dumps({"stored": await router.store.count()}))


def build_app(
    cfg: RouterConfig,
    *,
    config_path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    reload_interval: float = 1.0,
    debug: bool | None = None,
    handle_key: bytes | None = None,
    store_password: str | None = None,
) -> web.Application:
    # aiohttp's own body limit is lifted: the router applies maxBodyBytes itself, which a
    # reload can change, with a JSON 413.
    app = web.Application(middlewares=[json_errors], client_max_size=2**40)
    router = Router(cfg, handle_key=handle_key,
                    store_password=store_password or os.environ.get(STORE_PASSWORD_ENV))
    app[ROUTER] = router
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_delete("/v1/conversations/{conversation_id}", _end_conversation)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    if debug if debug is not None else os.environ.get(DEBUG_ENV) == "1":
        app.router.add_post("/debug/fill-handles", _debug_fill)
    if config_path is not None:
        app[WATCHER] = ConfigWatcher(
            config_path, overrides or {}, router.apply_config,
            lambda result: router.metrics.config_reloads.labels(result).inc(),
            reload_interval,
        )

    async def background(app: web.Application) -> Any:
        await router.start()
        watcher = app.get(WATCHER)
        task = asyncio.create_task(watcher.run()) if watcher is not None else None
        yield
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await router.close()

    app.cleanup_ctx.append(background)
    return app


@dataclass
class RunningRouter:
    runner: web.AppRunner
    app: web.Application
    url: str

    @property
    def router(self) -> Router:
        return self.app[ROUTER]

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_router(app: web.Application, host: str = "127.0.0.1", port: int = 0
                       ) -> RunningRouter:
    # handler_cancellation: a client that goes away cancels its handler, which closes
    # both upstream requests (the engines stop working for nobody).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    server = site._server
    assert server is not None
    bound = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    shown = f"[{host}]" if ":" in host else host
    return RunningRouter(runner, app, f"http://{shown}:{bound}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="bidir-kv router",
        description="KV-cache-aware router for 1PnD vLLM with bidirectional KV transfer.",
    )
    ap.add_argument("--prefill", action="append", metavar="URL",
                    help="prefill engine base URL (repeatable; overrides the file's list)")
    ap.add_argument("--decode", action="append", metavar="URL",
                    help="decode engine base URL (repeatable; overrides the file's list)")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--handle-store", metavar="URL",
                    help="redis://HOST:PORT/DB (rediss:// for TLS) shared by router replicas; "
                         f"the password from ${STORE_PASSWORD_ENV} (overrides handleStore)")
    ap.add_argument("--config", metavar="FILE",
                    help="JSON (or YAML) config, reloaded when it changes")
    ap.add_argument("--log-level", default=os.environ.get("BIDIRKV_LOG_LEVEL", "INFO"),
                    choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return ap.parse_args(argv)


async def _serve(app: web.Application, host: str, port: int) -> None:
    running = await start_router(app, host, port)
    log.info("router listening on %s", running.url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await running.stop()


def _loop_factory() -> Any:
    """uvloop's event loop when installed (a router dependency; measured in
    benchmarks/router_bench.py), else asyncio's."""
    if os.environ.get("BIDIRKV_ROUTER_LOOP", "uvloop") == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["router"]:
        argv = argv[1:]
    try:
        args = parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides: dict[str, Any] = {}
    if args.prefill:
        overrides["prefill"] = args.prefill
    if args.decode:
        overrides["decode"] = args.decode
    if args.handle_store:
        overrides["handleStore"] = args.handle_store
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"bidir-kv router: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    key = os.environ.get(HANDLE_KEY_ENV, "").strip().encode()
    if cfg.bidirectional and not key:
        print(f"bidir-kv router: {HANDLE_KEY_ENV} is not set: decode keeps KV for reuse only "
              "for requests the router proves it sent, with the resource's handle key (the "
              "operator sets it from the resource's Secret)", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"bidir-kv router: --port {args.port} is not a port (0-65535)", file=sys.stderr)
        return 2
    app = build_app(cfg, config_path=args.config, overrides=overrides, handle_key=key or None)
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_serve(app, args.host, args.port))
    except OSError as exc:
        print(f"bidir-kv router: cannot listen on {args.host}:{args.port}: {exc}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
