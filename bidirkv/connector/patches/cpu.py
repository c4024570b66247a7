"""CPU-platform patches of vLLM's NIXL worker and executor (docs/protocol.md, section 5).
(The model thread's cores are kept by bidir-kv's worker itself: connector/hooks/affinity.py.)

- `NixlBaseConnectorWorker.__init__`: NIXL's progress thread polls with no wait (about
  one core per idle server), yet without it a peer's read of this server's blocks
  completes only when this server next steps (22 ms mean at concurrency 4 against
  2.6 ms at 1). So the thread is kept, sleeping on UCX's event descriptor
  (PROGRESS_WAIT_US): a read completes in ~1.3 ms and an idle server spends no CPU.
  Where that cannot be set, the agent is created without the thread.
- `MultiprocExecutor._init_executor`: the unpinned engine core busy-waits for its
  worker's reply every forward, and on a small host often ran on the other server's
  worker core (P/D TTFT p50 at concurrency 4 swung between 160 and 350 ms). It joins its
  workers' cores (VLLM_CPU_OMP_THREADS_BIND), where waiting costs only its own server.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys

from bidirkv.connector.patches.guarded import wrap
from bidirkv.connector.settings import Resolved
from bidirkv.connector.targets import MARK, PatchSite, Skip, resolve

log = logging.getLogger("vllm.bidirkv")

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
# Where the engine core starts its workers: run in the engine-core process after vLLM
# loaded the plugins (EngineCore.__init__ does that first), before any worker exists.
ENGINE_MODULE = "vllm.v1.executor.multiproc_executor"


def _agent_config(orig, enable: bool):
    @functools.wraps(orig)
    def nixl_agent_config(*args, **kwargs):
        kwargs.setdefault("enable_prog_thread", enable)
        return orig(*args, **kwargs)

    return nixl_agent_config


def sleeping_config_class(base: type, wait_us: int) -> type:
    """`base` (NIXL's nixlAgentConfig binding) whose progress-thread wait is never 0."""

    class AgentConfig(base):
        @property
        def pthrDelay(self):  # noqa: N802 - NIXL's field name
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value):  # noqa: N802
            base.pthrDelay.__set__(self, value or wait_us)

    AgentConfig.__wrapped__ = base
    setattr(AgentConfig, MARK, True)
    return AgentConfig


def _install_sleeping_progress(wait_us: int) -> None:
    """Replace the config class NIXL's Python agent instantiates (Skip if it cannot)."""
    _, _, wrapper = resolve(MODULE, "NixlWrapper")
    api = sys.modules.get(getattr(wrapper, "__module__", "") or "")
    bindings = getattr(api, "nixlBind", None)
    base = getattr(bindings, "nixlAgentConfig", None)
    if base is None or not isinstance(base.__dict__.get("pthrDelay"), property):
        raise Skip("NIXL's agent config has no pthrDelay to set")
    if not getattr(base, MARK, False):
        bindings.nixlAgentConfig = sleeping_config_class(base, wait_us)


def _pin_engine_core(orig, cores: frozenset[int]):
    @functools.wraps(orig)
    def _init_executor(self, *args, **kwargs):
        # Threads and workers started from here on inherit the binding (workers then
        # bind their own OpenMP threads as vLLM does).
        try:
            os.sched_setaffinity(0, cores)
            log.info("bidir-kv: engine core pinned to cores %s, its workers' "
                     "(BIDIRKV_CPU_PIN_ENGINE_CORE=0 leaves it free)", sorted(cores))
        except OSError as exc:
            log.warning("bidir-kv: cannot pin the engine core to %s: %s", sorted(cores), exc)
        return orig(self, *args, **kwargs)

    return _init_executor


TARGETS = [PatchSite(MODULE, "nixl_agent_config"),
           PatchSite(MODULE, "NixlWrapper"),
           PatchSite(ENGINE_MODULE, "MultiprocExecutor._init_executor")]


def install_engine_core(settings: Resolved) -> list[str]:
    cores = settings.engine_core_cores
    if not cores or not hasattr(os, "sched_setaffinity"):
        return []
    wrap(ENGINE_MODULE, "MultiprocExecutor._init_executor",
         lambda o: _pin_engine_core(o, cores))
    return [f"engine-core-cores={','.join(map(str, sorted(cores)))}"]


def install(settings: Resolved) -> list[str]:
    applied = []
    if settings.nixl_progress_thread is not None:
        _, _, cfg = resolve(MODULE, "nixl_agent_config")
        if cfg is None:
            raise Skip("NIXL is not installed (nixl_agent_config is None)")
        if "enable_prog_thread" not in inspect.signature(cfg).parameters:
            raise Skip("nixl_agent_config takes no enable_prog_thread")
        enable, mode = settings.nixl_progress_thread, "off"
        if enable and settings.nixl_progress_wait_us:
            try:
                _install_sleeping_progress(settings.nixl_progress_wait_us)
                mode = "sleeping"
            except Skip as exc:
                # A thread that never sleeps costs a core: better none at all.
                log.warning("bidir-kv: NIXL progress thread left off: %s", exc)
                enable = False
        elif enable:
            mode = "on"
        wrap(MODULE, "nixl_agent_config", lambda o: _agent_config(o, enable))
        applied.append(f"nixl-progress-thread={mode}")
    return applied
