"""vLLM general plugin `bidirkv`: registered as a `vllm.general_plugins` entry point.

vLLM calls `register()` in every process of a server (API server, engine core, workers),
possibly more than once. Each patch is applied when its target module is imported in
that process, and skipped with one warning when its target is not what it was written
against, or when vLLM is not a release line the patches know. Set VLLM_PLUGINS to a
list without `bidirkv` to turn the plugin off.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

from . import patch_cpu, patch_idle, patch_residency, patch_reuse, patch_stream
from .patching import Skip, vllm_supported, when_imported
from .settings import Resolved, Settings

log = logging.getLogger("vllm.bidirkv")

NAME = "bidirkv"
ENTRY_POINT = "bidirkv.connector.plugin:register"
_registered = False
applied: list[str] = []


@functools.cache
def _resolved() -> Resolved:
    from vllm.platforms import current_platform

    return Settings.from_env(os.environ).resolve(bool(current_platform.is_cpu()))


def _guarded(what: str, install: Callable[[], list[str]]) -> Callable[[], None]:
    def hook() -> None:
        try:
            done = install()
        except Skip as exc:
            log.warning("bidir-kv: %s patch skipped: %s", what, exc)
            return
        except Exception:  # noqa: BLE001 - a broken patch must not break the import
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
    import vllm

    version = getattr(vllm, "__version__", "?")
    if not vllm_supported(version):
        log.warning("bidir-kv: vLLM %s is not a release the plugin was written for; "
                    "no patches applied (no streamed handles, no verified reuse)", version)
        return
    settings = Settings.from_env(os.environ)
    key = settings.handle_key
    when_imported(patch_reuse.MODULE,
                  _guarded("verified reuse", lambda: patch_reuse.install(key)))
    for module in patch_stream.TARGETS:
        when_imported(module, _guarded(
            "streamed handles",
            lambda m=module: patch_stream.install(m) if _resolved().stream_params else []))
    when_imported(patch_cpu.MODULE, _guarded("cpu", lambda: patch_cpu.install(_resolved())))
    when_imported(patch_idle.MODULE,
                  _guarded("idle loop", lambda: patch_idle.install(_resolved().idle_poll_ms)))
    when_imported(patch_idle.WORKER_MODULE, _guarded(
        "idle worker", lambda: patch_idle.install_worker(_resolved().idle_poll_ms)))
    when_imported(patch_residency.CONNECTOR, _guarded(
        "residency", lambda: patch_residency.install_connector(
            settings.owner_lease_s, settings.retention_watermark)))
    when_imported(patch_residency.SCHEDULER, _guarded(
        "residency scheduler", patch_residency.install_scheduler))
    when_imported(patch_residency.ENGINE, _guarded(
        "residency utility", patch_residency.install_engine))
    when_imported(patch_residency.PULL_WORKER, _guarded(
        "read grants", patch_residency.install_worker))
    log.info("bidir-kv plugin registered in pid %d (vLLM %s)", os.getpid(), version)
