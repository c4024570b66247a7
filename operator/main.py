"""Wire the controller into kopf and run it (`bidir-kv operator`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

import kopf
import kubernetes

from . import spec as api
from .controller import Controller
from .kube import KubeClient
from .render import MANAGED_BY

# What the operator watches besides its own resource: the kinds it writes.
CHILD_RESOURCES = [
    ("apps", "v1", "statefulsets"),
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("policy", "v1", "poddisruptionbudgets"),
]
MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}


def build_registry(
    controller: Controller, configuration: kubernetes.client.Configuration
) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(configuration)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Handlers are async: sync ones run in a thread pool, away from the controller's loop.
    # Events are posted by the controller itself, for its own reasons only.
        settings.posting.enabled = False
        settings.watching.server_timeout = 300
        settings.watching.reconnect_backoff = 0.5

    @kopf.on.event(api.GROUP, api.VERSION, api.PLURAL, registry=registry)
    async def owner_event(type: str | None, body: kopf.Body, **_: Any) -> None:  # noqa: A002
        controller.owner_event(type, _plain(body))

    for group, version, plural in CHILD_RESOURCES:
        kopf.on.event(group, version, plural, labels=MANAGED, registry=registry)(
            _child_handler(controller)
        )

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        controller.close()

    return registry


def _child_handler(controller: Controller):
    async def child_event(type: str | None, body: kopf.Body, **_: Any) -> None:  # noqa: A002
        controller.child_event(type, _plain(body))

    return child_event


def _plain(body: kopf.Body) -> dict[str, Any]:
    return dict(body)


def connection_info(configuration: kubernetes.client.Configuration) -> kopf.ConnectionInfo:
    token = (configuration.api_key or {}).get("authorization") or (
        configuration.api_key or {}
    ).get("BearerToken")
    if token and token.lower().startswith("bearer "):
        token = token[7:]
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        token=token,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
        username=configuration.username or None,
        password=configuration.password or None,
    )


def load_configuration(kubeconfig: str | None = None) -> kubernetes.client.Configuration:
    """In-cluster service account first (the normal case), else a kubeconfig file."""
    configuration = kubernetes.client.Configuration()
    if kubeconfig is None:
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
            return configuration
        except kubernetes.config.ConfigException:
            pass
    kubernetes.config.load_kube_config(
        config_file=kubeconfig, client_configuration=configuration
    )
    return configuration


async def run_operator(
    configuration: kubernetes.client.Configuration,
    *,
    namespaces: tuple[str, ...] = (),
    stop_flag: asyncio.Event | None = None,
    ready_flag: asyncio.Event | None = None,
    liveness_endpoint: str | None = None,
    peering_name: str | None = None,
    priority: int = 0,
    controller: Controller | None = None,
) -> None:
    if controller is None:
        controller = Controller(KubeClient(configuration))
    registry = build_registry(controller, configuration)
    try:
        await kopf.operator(
            registry=registry,
            clusterwide=not namespaces,
            namespaces=list(namespaces),
            standalone=peering_name is None,
            peering_name=peering_name,
            priority=priority,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
            liveness_endpoint=liveness_endpoint,
        )
    finally:
        controller.close()
        controller.client.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", "-n", action="append", default=[],
                        help="watch only this namespace (repeatable); default: all")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then "
                        "KUBECONFIG / ~/.kube/config)")
    parser.add_argument("--liveness", default=None,
                        help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--peering", default=None,
                        help="kopf peering object name for running several replicas (HA)")
    parser.add_argument("--priority", type=int, default=0,
                        help="peering priority; replicas need different values")
    parser.add_argument("--verbose", "-v", action="store_true")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    configuration = load_configuration(args.kubeconfig)
    asyncio.run(
        run_operator(
            configuration,
            namespaces=tuple(args.namespace),
            liveness_endpoint=args.liveness,
            peering_name=args.peering,
            priority=args.priority,
        )
    )
    return 0
