"""vLLM general plugin `bidirkv`: registered as a `vllm.general_plugins` entry point.

vLLM calls `register()` in every process of a server, possibly more than once; each patch
applies when its target module is imported. The plugin fails closed: on a vLLM release it
was not written for, without a handle key, or when a patch that keeps reuse safe cannot
apply, it stops the server with one line that says which, instead of letting vLLM reuse
KV on trust; only the CPU performance patches are optional. The connector hooks are
overrides of bidir-kv's own NIXL connector (connector/nixl/), not patches.
`REQUIRED_TARGETS`, `OPTIONAL_TARGETS` and `CONNECTOR_TARGETS` are checked by the
launcher before vLLM starts. VLLM_PLUGINS without `bidirkv` turns the plugin off.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

from bidirkv.connector.nixl import targets as nixl_targets
from bidirkv.connector.patches import connector as patch_connector
from bidirkv.connector.patches import cpu as patch_cpu
from bidirkv.connector.patches import idle as patch_idle
from bidirkv.connector.patches import residency as patch_residency
from bidirkv.connector.patches import stream as patch_stream
from bidirkv.connector.patches.guarded import when_imported
from bidirkv.connector.settings import Resolved, Settings
from bidirkv.connector.targets import PatchSite, Skip, vllm_supported

log = logging.getLogger("vllm.bidirkv")

NAME = "bidirkv"
ENTRY_POINT = "bidirkv.connector.plugin:register"
# Patched globally: what vLLM gives no hook for (docs/protocol.md, section 5).
REQUIRED_TARGETS: list[PatchSite] = [*patch_connector.TARGETS, *patch_stream.TARGET_LIST,
                                  *patch_residency.TARGETS]
OPTIONAL_TARGETS: list[PatchSite] = [*patch_cpu.TARGETS, *patch_idle.TARGETS]
# Overridden or called by bidir-kv's NIXL connector classes (nixl/), loaded by vLLM.
CONNECTOR_TARGETS: list[PatchSite] = list(nixl_targets.TARGETS)
_registered = False
applied: list[str] = []


class PluginError(RuntimeError):
    """The server must not start: the message says why and what to do."""


@functools.cache
def _resolved() -> Resolved:
    from vllm.platforms import current_platform

    return Settings.from_env(os.environ).resolve(bool(current_platform.is_cpu()))


def _version() -> str:
    import vllm

    return getattr(vllm, "__version__", "?")


def _guarded(what: str, install: Callable[[], list[str]], required: bool = True
             ) -> Callable[[], None]:
    def hook() -> None:
        try:
            done = install()
        except Exception as exc:  # noqa: BLE001 - reported below, by kind
            if required:
                raise PluginError(f"bidir-kv: the {what} patch cannot apply to vLLM "
                                  f"{_version()} ({exc}); refusing to serve KV reuse "
                                  "without it") from exc
            if isinstance(exc, Skip):
                log.warning("bidir-kv: %s patch skipped: %s", what, exc)
            else:
                log.exception("bidir-kv: %s patch failed; skipped", what)
            return
        if done:
            applied.extend(done)
            log.info("bidir-kv: patched %s in pid %d", ", ".join(done), os.getpid())

    return hook


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    version = _version()
    if not vllm_supported(version):
        raise PluginError(f"bidir-kv: vLLM {version} is not a release the plugin was written "
                          "for; refusing to start (set VLLM_PLUGINS without bidirkv to run "
                          "vLLM without it)")
    if not Settings.from_env(os.environ).handle_keys:
        raise PluginError("bidir-kv: BIDIRKV_HANDLE_KEY is not set; refusing to start "
                          "(KV handles could not be authenticated)")
    when_imported(nixl_targets.CONNECTOR, _guarded("connector guard", patch_connector.install))
    for module in patch_stream.TARGETS:
        when_imported(module, _guarded(
            "streamed handles",
            lambda m=module: patch_stream.install(m) if _resolved().stream_params else []))
    when_imported(patch_cpu.MODULE, _guarded(
        "cpu", lambda: patch_cpu.install(_resolved()), required=False))
    when_imported(patch_cpu.ENGINE_MODULE, _guarded(
        "cpu engine core", lambda: patch_cpu.install_engine_core(_resolved()),
        required=False))
    when_imported(patch_idle.MODULE, _guarded(
        "idle loop", lambda: patch_idle.install(_resolved().idle_poll_ms), required=False))
    when_imported(patch_idle.WORKER_MODULE, _guarded(
        "idle worker", lambda: patch_idle.install_worker(_resolved().idle_poll_ms),
        required=False))
    when_imported(patch_residency.SCHEDULER, _guarded(
        "residency scheduler", patch_residency.install_scheduler))
    when_imported(patch_residency.ENGINE, _guarded(
        "residency utility", patch_residency.install_engine))
    log.info("bidir-kv plugin registered in pid %d (vLLM %s)", os.getpid(), version)
