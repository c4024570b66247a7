"""The engine containers the operator renders, as local processes.

The container's command, args and env come from the same render as a cluster's pods;
only what a pod gets from Kubernetes is mapped: the pod IP becomes 127.0.0.1 and each
server gets its own HTTP and NIXL side-channel port, since all share one host.
"""

from __future__ import annotations

import pathlib
import shutil
import sys
from dataclasses import dataclass
from typing import Any

from bidirkv.operator.render import Owner, engine_statefulset, router_config
from bidirkv.operator.spec import DisaggregatedInferenceSpec

LOOPBACK = "127.0.0.1"
LOCAL_OWNER = Owner(name="local", namespace="local", uid="local")


@dataclass(frozen=True)
class LocalPorts:
    http: int
    nixl: int


def rendered_container(spec: DisaggregatedInferenceSpec, role: str) -> dict[str, Any]:
    sts = engine_statefulset(LOCAL_OWNER, spec, role)
    return sts["spec"]["template"]["spec"]["containers"][0]


def _local_args(args: list[str], ports: LocalPorts) -> list[str]:
    out = list(args)
    for flag, value in (("--host", LOOPBACK), ("--port", str(ports.http))):
        out[out.index(flag) + 1] = value
    return out


def _local_env(env: list[dict[str, Any]], ports: LocalPorts) -> dict[str, str]:
    out: dict[str, str] = {}
    for var in env:
        ref = (var.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
        if ref == "status.podIP":
            out[var["name"]] = LOOPBACK
        elif "value" in var:
            out[var["name"]] = var["value"]
        else:
            raise ValueError(f"env {var['name']}: cannot map {var} to a local process")
    out["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(ports.nixl)
    return out


def bidirkv_command() -> str:
    """The `bidir-kv` of this interpreter's environment (the container's entry point)."""
    here = shutil.which("bidir-kv", path=str(pathlib.Path(sys.executable).parent))
    return here or "bidir-kv"


def engine_process(
    spec: DisaggregatedInferenceSpec, role: str, ports: LocalPorts
) -> tuple[list[str], dict[str, str]]:
    """argv and environment additions that run one rendered engine container locally."""
    c = rendered_container(spec, role)
    command = list(c["command"])
    if command[0] == "bidir-kv":
        command[0] = bidirkv_command()
    return command + _local_args(c["args"], ports), _local_env(c["env"], ports)


def local_router_config(
    spec: DisaggregatedInferenceSpec, prefill: list[LocalPorts], decode: list[LocalPorts]
) -> dict[str, Any]:
    """The router ConfigMap's content with the per-pod endpoints mapped to local ports."""
    cfg = router_config(LOCAL_OWNER, spec)
    cfg["prefill"] = [f"http://{LOOPBACK}:{p.http}" for p in prefill]
    cfg["decode"] = [f"http://{LOOPBACK}:{p.http}" for p in decode]
    return cfg
