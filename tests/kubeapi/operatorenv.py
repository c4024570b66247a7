"""Run the real operator against the in-memory API server (tests and benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import kubernetes

from bidirkv.operator.api import spec as api
from bidirkv.operator.crd.schema import build_crd
from bidirkv.operator.kube import KINDS, KubeClient
from bidirkv.operator.main import run_operator
from bidirkv.operator.reconcile.controller import Controller
from kubeapi.server import KubeAPIServer

CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
NAMESPACES = ("ns1", "bench")


def di_path(namespace: str, name: str | None = None, sub: str | None = None) -> str:
    return KINDS[api.KIND].path(namespace, name, sub)


@contextlib.asynccontextmanager
async def api_server(gc: bool = False) -> AsyncIterator[tuple[KubeAPIServer, KubeClient]]:
    server = KubeAPIServer(gc=gc)
    url = await server.start()
    client = KubeClient(kubernetes.client.Configuration(host=url))
    try:
        await client.call("POST", CRD_PATH, build_crd())
        for ns in NAMESPACES:
            await client.call("POST", "/api/v1/namespaces",
                              {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        yield server, client
    finally:
        client.close()
        await server.stop()


class RecordingClient(KubeClient):
    """Keeps every body the operator sends, so tests can validate each one."""

    def __init__(self, configuration: kubernetes.client.Configuration):
        super().__init__(configuration)
        self.sent: list[tuple[str, str, Any]] = []

    async def call(self, method: str, path: str, body: Any = None,
                   content_type: str | None = None):
        if method != "GET":
            self.sent.append((method, path, copy.deepcopy(body)))
        return await super().call(method, path, body, content_type)


class OperatorHandle:
    """The operator running in its own thread and event loop, as in its own process.

    kopf treats every task created in its loop after start-up as its own (and waits for
    or cancels them at exit), so the API server and the test must not share its loop.
    """

    def __init__(self, controller: Controller):
        self.controller = controller
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def client(self) -> RecordingClient:
        return self.controller.client  # type: ignore[return-value]

    @property
    def reconciles(self) -> int:
        return self.controller.reconciles

    async def idle(self, timeout: float = 30.0) -> None:
        assert self.loop is not None
        future = asyncio.run_coroutine_threadsafe(self.controller.queue.idle(timeout), self.loop)
        await asyncio.wrap_future(future)


@contextlib.asynccontextmanager
async def running_operator(client: KubeClient, **kwargs: Any) -> AsyncIterator[OperatorHandle]:
    """The operator as `bidir-kv operator` runs it; `handle.client.sent` records its writes."""
    stop, ready = threading.Event(), threading.Event()
    handle = OperatorHandle(
        Controller(RecordingClient(client.configuration), debounce=0.02, **kwargs)
    )
    errors: list[BaseException] = []

    async def main() -> None:
        handle.loop = asyncio.get_running_loop()
        await run_operator(client.configuration, stop_flag=stop, ready_flag=ready,
                           controller=handle.controller)

    def target() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            errors.append(exc)
            ready.set()

    thread = threading.Thread(target=target, name="operator", daemon=True)
    thread.start()
    try:
        if not await asyncio.to_thread(ready.wait, 20) or errors:
            raise RuntimeError(f"operator did not start: {errors}")
        yield handle
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 20)
        if thread.is_alive():
            raise RuntimeError("operator did not stop within 20 s")
    if errors:
        raise errors[0]


async def eventually(check: Callable[[], Any], timeout: float = 15.0, what: str = "") -> Any:
    """Poll an (a)sync check until it returns a truthy value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: Any = None
    while loop.time() < deadline:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or check}: last {last!r}")


def resource(doc: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    doc["metadata"].setdefault("namespace", namespace)
    doc["metadata"].pop("uid", None)
    return doc
