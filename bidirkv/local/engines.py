"""The engine containers the operator renders, as local processes.

The container's command, args and env come from the same render as a cluster's pods,
given where each server listens here (render's own parameter): the loopback address and each
server's own HTTP and NIXL side-channel ports, since all share one host. What a pod
gets from Kubernetes at run time (a Secret) is mapped here.
"""

from __future__ import annotations

import pathlib
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bidirkv.operator.api.spec import DisaggregatedInferenceSpec
from bidirkv.operator.render.children import Owner, engine_statefulset, router_config
from bidirkv.operator.render.handlekey import CURRENT, new_key, secret_name
from bidirkv.roleconfig import POD, Listen

LOOPBACK = "127.0.0.1"
LOCAL_OWNER = Owner(name="local", namespace="local", uid="local")
# The router's spans, as JSON lines: relative, so in the router's working directory,
# which is the stack's state directory (stack.py starts every server there).
ROUTER_TRACES = "router-traces.jsonl"
# secret name -> key -> value: what a pod would read through secretKeyRef.
LocalSecrets = Mapping[str, Mapping[str, str]]


def local_secrets(key: str | None = None) -> dict[str, dict[str, str]]:
    """The Secrets a local stack stands in for: a fresh handle key per stack (as the
    operator creates one per resource)."""
    return {secret_name(LOCAL_OWNER): {CURRENT: key or new_key()}}


@dataclass(frozen=True)
class LocalPorts:
    http: int
    nixl: int


def listen(ports: LocalPorts) -> Listen:
    return Listen(bind_host=LOOPBACK, http_port=ports.http, side_channel_host=LOOPBACK,
                  side_channel_port=ports.nixl)


def rendered_container(spec: DisaggregatedInferenceSpec, role: str,
                       ports: LocalPorts | None = None) -> dict[str, Any]:
    """The engine container as rendered for a pod, or (with `ports`) for this machine."""
    sts = engine_statefulset(LOCAL_OWNER, spec, role,
                             listen(ports) if ports is not None else POD)
    return sts["spec"]["template"]["spec"]["containers"][0]


def local_env(env: list[dict[str, Any]], secrets: LocalSecrets) -> dict[str, str]:
    """A container's env for a local process: secretKeyRef reads `secrets`."""
    out: dict[str, str] = {}
    for var in env:
        source = var.get("valueFrom") or {}
        secret = source.get("secretKeyRef")
        if "value" in var:
            out[var["name"]] = var["value"]
        elif secret is not None:
            value = secrets.get(secret.get("name"), {}).get(secret.get("key"))
            if value is not None:
                out[var["name"]] = value
            elif not secret.get("optional"):
                raise ValueError(f"env {var['name']}: no local value for Secret "
                                 f"{secret.get('name')} key {secret.get('key')}")
        else:
            raise ValueError(f"env {var['name']}: cannot map {var} to a local process")
    return out


def bidirkv_command() -> str:
    """The `bidir-kv` of this interpreter's environment (the container's entry point)."""
    here = shutil.which("bidir-kv", path=str(pathlib.Path(sys.executable).parent))
    return here or "bidir-kv"


def engine_process(
    spec: DisaggregatedInferenceSpec, role: str, ports: LocalPorts, secrets: LocalSecrets
) -> tuple[list[str], dict[str, str]]:
    """argv and environment additions that run one rendered engine container locally."""
    c = rendered_container(spec, role, ports)
    command = list(c["command"])
    if command[0] == "bidir-kv":
        command[0] = bidirkv_command()
    return command + c["args"], local_env(c["env"], secrets)


def local_router_config(
    spec: DisaggregatedInferenceSpec, prefill: list[LocalPorts], decode: list[LocalPorts]
) -> dict[str, Any]:
    """The router ConfigMap's content with the per-pod endpoints mapped to local ports,
    and its spans written to a file of the state directory (no collector here; an OTLP
    endpoint the spec names is kept)."""
    cfg = router_config(LOCAL_OWNER, spec)
    cfg["prefill"] = [f"http://{LOOPBACK}:{p.http}" for p in prefill]
    cfg["decode"] = [f"http://{LOOPBACK}:{p.http}" for p in decode]
    cfg["tracing"] = {**cfg.get("tracing", {}), "file": ROUTER_TRACES}
    return cfg
