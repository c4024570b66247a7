"""Wire the controller into kopf and run it (`bidir-kv operator`)."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import socket
import sys
from collections.abc import Mapping
from typing import Any

import kopf
import kubernetes

from bidirkv.operator.api import spec as api
from bidirkv.operator.kube import ApiError, KubeClient, load_configuration, request
from bidirkv.operator.reconcile.controller import Controller
from bidirkv.operator.render.children import MANAGED_BY
from bidirkv.operator.render.netpol import namespace_error

# What the operator watches besides its own resource: the kinds it writes.
CHILD_RESOURCES = [
    ("apps", "v1", "statefulsets"),
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("networking.k8s.io", "v1", "networkpolicies"),
]
# Pods are not the operator's children (their StatefulSet owns them): watched for their
# drains only (reconcile/drainwatch.py), a pod being deleted or gone.
PODS = ("", "v1", "pods")
MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}
MANAGED_SELECTOR = ",".join(f"{k}={v}" for k, v in MANAGED.items())
# kopf's peering resources (kopf.dev, the group kopf looks for first).
PEERING_GROUP_VERSION = "kopf.dev/v1"
PEERING_WAIT_SECONDS = 60.0
# The operator's own namespace, which the chart's Deployment sets from the pod's
# metadata.namespace (the downward API): the engines' NetworkPolicy admits its pods from
# there only (render/netpol.py).
NAMESPACE_ENV = "POD_NAMESPACE"

log = logging.getLogger("bidirkv.operator")


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
        # The API server filters children by label: the operator never streams the
        # cluster's other ConfigMaps, Services, StatefulSets, ...
        for group, version, plural in [*CHILD_RESOURCES, PODS]:
            settings.watching.label_selectors[group, version, plural] = MANAGED_SELECTOR

    @kopf.on.event(api.GROUP, api.VERSION, api.PLURAL, registry=registry)
    async def owner_event(type: str | None, body: kopf.Body, **_: Any) -> None:  # noqa: A002
        controller.owner_event(type, _plain(body))

    for group, version, plural in CHILD_RESOURCES:
        kopf.on.event(group, version, plural, labels=MANAGED, registry=registry)(
            _child_handler(controller)
        )

    @kopf.on.event(*PODS, labels=MANAGED, registry=registry)
    async def pod_event(type: str | None, body: kopf.Body, **_: Any) -> None:  # noqa: A002
        controller.pod_event(type, _plain(body))

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        controller.queue.close()

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


async def run_operator(configuration: kubernetes.client.Configuration, *,
                       namespaces: tuple[str, ...] = (), stop_flag: asyncio.Event | None = None,
                       ready_flag: asyncio.Event | None = None,
                       liveness_endpoint: str | None = None, peering_name: str | None = None,
                       priority: int = 0, operator_namespace: str | None = None,
                       controller: Controller | None = None) -> None:
    """`controller`: one made by the caller (tests), which must render for the same
    `operator_namespace` when that is given."""
    if (controller is not None and operator_namespace is not None
            and operator_namespace != controller.operator_namespace):
        raise ValueError(f"operator_namespace {operator_namespace!r} differs from the given "
                         f"controller's {controller.operator_namespace!r}")
    if peering_name is not None:
        await ensure_peering(configuration, peering_name, namespaces)
    if controller is None:
        controller = Controller(KubeClient(configuration), operator_namespace=operator_namespace)
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
        controller.queue.close()
        controller.client.close()


async def ensure_peering(configuration: kubernetes.client.Configuration, name: str,
                         namespaces: tuple[str, ...] = (), *,
                         wait: float = PEERING_WAIT_SECONDS) -> None:
    """Create kopf's peering object(s) if missing: a ClusterKopfPeering when cluster-wide,
    a KopfPeering in each watched namespace otherwise.

    With `--peering`, kopf pauses until it sees its peering object, and it never creates
    one. A Helm chart cannot create it either on a first install when it also creates the
    peering CRD (Helm maps every manifest to a known kind before it creates anything), so
    the operator does it. The CRD may still be becoming established: retried for `wait` s.
    """
    base = f"/apis/{PEERING_GROUP_VERSION}"
    targets = (
        [(f"{base}/namespaces/{ns}/kopfpeerings", "KopfPeering", ns) for ns in namespaces]
        or [(f"{base}/clusterkopfpeerings", "ClusterKopfPeering", None)]
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    with kubernetes.client.ApiClient(configuration) as api_client:

        async def call(method: str, path: str, body: Any = None) -> Any:
            return await asyncio.to_thread(request, api_client, method, path, body)

        for path, kind, namespace in targets:
            where = f"in namespace {namespace}" if namespace else "cluster-wide"
            while True:
                try:
                    await call("GET", f"{path}/{name}")
                    break
                except ApiError as exc:
                    if exc.status != 404:
                        raise
                body = {"apiVersion": PEERING_GROUP_VERSION, "kind": kind,
                        "metadata": {"name": name}}
                try:
                    await call("POST", path, body)
                    log.info("created %s %s %s", kind, name, where)
                    break
                except ApiError as exc:
                    if exc.status == 409:
                        break
                    if exc.status != 404 or loop.time() > deadline:
                        raise RuntimeError(
                            f"cannot create the kopf peering object {kind} {name!r} {where}: "
                            f"{exc}; are kopf's peering CRDs installed (kopf.dev/v1)?"
                        ) from exc
                log.info("waiting for the %s resource (kopf's peering CRD)", kind)
                await asyncio.sleep(1.0)


def resolve_priority(value: int | str, pod_name: str | None = None) -> int:
    """`--priority auto`: a priority derived from this pod's name (`POD_ID`, as kopf uses
    for its peer identity, else the host name, which is the pod name in Kubernetes).

    Replicas of one Deployment share one pod template, so they cannot be given distinct
    numbers; kopf freezes every replica when two share a priority. Names are unique, and a
    31-bit hash of two of them collides with a probability of about 5e-10. Stable across
    container restarts of one pod."""
    if value != "auto":
        return int(value)
    name = pod_name or os.environ.get("POD_ID") or socket.gethostname()
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:4], "big") % (2**31 - 1) + 1


def _priority(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither an integer nor 'auto'") from None


def operator_namespace(environ: Mapping[str, str] = os.environ) -> str | None:
    """This operator's namespace, from `NAMESPACE_ENV`; None when that is unset or empty
    (run by hand), and a ValueError naming it when it is no namespace name."""
    value = environ.get(NAMESPACE_ENV, "")
    if not value:
        return None
    problem = namespace_error(value)
    if problem:
        raise ValueError(f"{NAMESPACE_ENV}: {problem}")
    return value


def operator_options(args: argparse.Namespace,
                     environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """`bidir-kv operator` arguments (and its environment) as keyword arguments of
    `run_operator`; a ValueError names a bad environment variable."""
    return {
        "namespaces": tuple(args.namespace),
        "liveness_endpoint": args.liveness,
        "peering_name": args.peering,
        "priority": resolve_priority(args.priority),
        "operator_namespace": operator_namespace(environ),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", "-n", action="append", default=[],
                        help="watch only this namespace (repeatable); default: all")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then "
                        "KUBECONFIG / ~/.kube/config)")
    parser.add_argument("--liveness", default=None,
                        help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--peering", default=None,
                        help="kopf peering object name for running several replicas (HA); "
                        "created if missing")
    parser.add_argument("--priority", type=_priority, default=0,
                        help="peering priority; replicas need different values: an integer, "
                        "or 'auto' for one derived from the pod name (POD_ID, else hostname)")
    parser.add_argument("--verbose", "-v", action="store_true")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        options = operator_options(args)
    except ValueError as exc:
        print(f"bidir-kv operator: {exc}", file=sys.stderr)
        return 2
    if options["operator_namespace"] is None:
        log.info("%s is not set: the engines' NetworkPolicy admits operator pods of each "
                 "resource's own namespace only, so a draining decode pod's held "
                 "conversations may stay unknown", NAMESPACE_ENV)
    configuration = load_configuration(args.kubeconfig)
    if args.peering is not None:
        log.info("peering %r with priority %d", args.peering, options["priority"])
    asyncio.run(run_operator(configuration, **options))
    return 0
