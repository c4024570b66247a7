"""`bidir-kv router`: the HTTP server and the command line (the routes are routes.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from bidirkv.router.config import ConfigError, RouterConfig, load_config
from bidirkv.router.datapath.proxy import Router
from bidirkv.router.server.reload import ConfigWatcher
from bidirkv.router.server.routes import ROUTER, add_metrics_routes, add_routes, json_errors
from bidirkv.router.tracing.spans import describe

log = logging.getLogger("bidirkv.router")

WATCHER = web.AppKey("watcher", ConfigWatcher)
HANDLE_KEY_ENV = "BIDIRKV_HANDLE_KEY"
STORE_PASSWORD_ENV = "BIDIRKV_HANDLE_STORE_PASSWORD"
# Off unless set: lets benchmarks fill the handle store without 100k real requests.
DEBUG_ENV = "BIDIRKV_ROUTER_DEBUG"
# A router that stops (SIGTERM) gives its turns in flight this long to end (aiohttp's own
# wait is 60 s), then sends what they left queued for decode within SHUTDOWN_FLUSH_S
# (pool/residency.py): 25 s in all, inside the 30 s Kubernetes gives a pod that names no
# grace period, as the router's does not.
IN_FLIGHT_S = 20.0


def build_app(cfg: RouterConfig, *, config_path: str | Path | None = None,
              overrides: dict[str, Any] | None = None, reload_interval: float = 1.0,
              debug: bool | None = None, handle_key: bytes | None = None,
              store_password: str | None = None, metrics_apart: bool = False) -> web.Application:
    """The router's application; with `metrics_apart`, `/metrics` is left out of it and
    served by `metrics_app(app)` on a port of its own."""
    # aiohttp's own body limit is lifted: the router applies maxBodyBytes itself, which a
    # reload can change, with a JSON 413.
    app = web.Application(middlewares=[json_errors], client_max_size=2**40)
    router = Router(cfg, handle_key=handle_key,
                    store_password=store_password or os.environ.get(STORE_PASSWORD_ENV))
    app[ROUTER] = router
    add_routes(app, debug if debug is not None else os.environ.get(DEBUG_ENV) == "1",
               metrics=not metrics_apart)
    if config_path is not None:
        app[WATCHER] = ConfigWatcher(
            config_path, overrides or {}, router.apply_config,
            lambda result: router.ctx.metrics.config_reloads.labels(result).inc(),
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


def metrics_app(app: web.Application) -> web.Application:
    """`/metrics` (and `/health`) of the router `app`, for a port of its own: scrapers
    then need no access to the port clients send conversations to."""
    side = web.Application(middlewares=[json_errors])
    side[ROUTER] = app[ROUTER]
    add_metrics_routes(side)
    return side


@dataclass
class RunningRouter:
    runner: web.AppRunner
    app: web.Application
    url: str
    metrics_runner: web.AppRunner | None = None
    metrics_url: str | None = None

    @property
    def router(self) -> Router:
        return self.app[ROUTER]

    async def stop(self) -> None:
        if self.metrics_runner is not None:
            await self.metrics_runner.cleanup()
        await self.runner.cleanup()


async def _listen(runner: web.AppRunner, host: str, port: int) -> str:
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    server = site._server
    assert server is not None
    bound = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{bound}"


async def start_router(app: web.Application, host: str = "127.0.0.1", port: int = 0,
                       metrics_port: int | None = None) -> RunningRouter:
    # handler_cancellation: a client that goes away cancels its handler, which closes
    # both upstream requests (the engines stop working for nobody).
    idle = app[ROUTER].ctx.cfg.timeouts.idle_connection_seconds
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           keepalive_timeout=idle, shutdown_timeout=IN_FLIGHT_S)
    url = await _listen(runner, host, port)
    running = RunningRouter(runner, app, url)
    if metrics_port is not None:
        running.metrics_runner = web.AppRunner(metrics_app(app), access_log=None)
        try:
            running.metrics_url = await _listen(running.metrics_runner, host, metrics_port)
        except BaseException:
            await running.stop()
            raise
    return running


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
    ap.add_argument("--metrics-port", type=int, metavar="PORT",
                    help="serve /metrics on this port only (not on --port)")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--handle-store", metavar="URL",
                    help="redis://HOST:PORT/DB (rediss:// for TLS) shared by router replicas; "
                         f"the password from ${STORE_PASSWORD_ENV} (overrides handleStore)")
    ap.add_argument("--config", metavar="FILE",
                    help="JSON (or YAML) config, reloaded when it changes")
    ap.add_argument("--log-level", default=os.environ.get("BIDIRKV_LOG_LEVEL", "INFO"),
                    choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return ap.parse_args(argv)


# Python's collector runs its youngest generation every 700 new container objects; a
# turn makes a few hundred (coroutines, dicts, the legs' buffers), nearly all freed by
# reference counting anyway. Measured on streamed turns (router and fake engines in one
# process): 5-6% of the CPU in collections at 700, 0.5% at 10 000.
GC_YOUNG_THRESHOLD = 10_000


def settle_gc() -> None:
    """Once the router listens: what it holds by then (modules, config, the app) lives
    as long as the process, so no collection walks it again, and young passes are
    fewer. Collected first: cycles start-up left behind would never be freed once
    frozen."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


async def _serve(app: web.Application, host: str, port: int,
                 metrics_port: int | None) -> None:
    running = await start_router(app, host, port, metrics_port)
    settle_gc()
    log.info("router listening on %s%s", running.url,
             f", metrics on {running.metrics_url}" if running.metrics_url else "")
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
    if not key:
        print(f"bidir-kv router: {HANDLE_KEY_ENV} is not set: prefill keeps KV for decode, "
              "and decode for reuse, only for requests the router proves it sent, with the "
              "resource's handle key (the operator sets it from the resource's Secret)",
              file=sys.stderr)
        return 2
    for flag, value in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if value is not None and not 0 <= value <= 65535:
            print(f"bidir-kv router: {flag} {value} is not a port (0-65535)", file=sys.stderr)
            return 2
    if args.metrics_port is not None and args.metrics_port == args.port != 0:
        print(f"bidir-kv router: --metrics-port {args.metrics_port} is --port too; it must "
              "be another port (or left out: /metrics on --port)", file=sys.stderr)
        return 2
    try:
        app = build_app(cfg, config_path=args.config, overrides=overrides,
                        handle_key=key or None, metrics_apart=args.metrics_port is not None)
    except ConfigError as exc:  # what only opening it tells (tracing.file)
        print(f"bidir-kv router: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    log.info("tracing: %s", describe(cfg.tracing))
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_serve(app, args.host, args.port, args.metrics_port))
    except OSError as exc:
        print(f"bidir-kv router: cannot listen on {args.host}:{args.port}"
              f"{f' or {args.metrics_port}' if args.metrics_port is not None else ''}: {exc}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
