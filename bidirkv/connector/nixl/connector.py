"""`NixlConnector`: vLLM's pull-mode NIXL connector with bidir-kv's checks at its hooks.

vLLM loads it with `--kv-transfer-config '{"kv_connector": "NixlConnector",
"kv_connector_module_path": "bidirkv.connector.nixl.connector", ...}'` (roleconfig.py
writes that). It keeps vLLM's name, which vLLM's configuration checks compare, so every
NIXL-specific default still applies; `isinstance` checks against vLLM's class hold too.

What each hook adds (in order, around vLLM's own):
- `on_new_request`: admit the params, narrow a handle to the verified prefix
  (hooks/reuse.py);
- `get_num_new_matched_tokens`: a handle is read at most once; the match is reported;
- `update_state_after_alloc`: a decode request without a P handle is tracked, so its
  retention can end (hooks/retention.py);
- `build_connector_meta`: releases decided by the residency expire now;
- `update_connector_output`: failed reads (P recomputes) and freed retained requests;
- `request_finished[_all_groups]`: sign the handle, add digests and the reuse report,
  keep nothing for a request without the router's proof, then retain D's blocks;
- `get_kv_connector_stats`, `build_kv_connector_stats`, `build_prom_metrics`: bidir-kv's
  counters and its KV working set gauge (core/workingset.py) next to NIXL's (stats.py).
Scheduler-side hooks run in the engine-core process, the worker's in the worker.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.platforms import current_platform

from bidirkv.connector.core import workingset
from bidirkv.connector.core.handles import compact
from bidirkv.connector.core.residency import Residency, current, install
from bidirkv.connector.hooks.retention import Retention
from bidirkv.connector.hooks.reuse import Reuse
from bidirkv.connector.hooks.tally import Tally
from bidirkv.connector.nixl import stats
from bidirkv.connector.nixl.notifs import SharedReadsDone
from bidirkv.connector.nixl.scheduler import PullScheduler
from bidirkv.connector.nixl.worker import PullWorker
from bidirkv.connector.settings import Settings
from bidirkv.connector.targets import MARK

log = logging.getLogger("vllm.bidirkv")


class ConnectorError(RuntimeError):
    """The connector must not start: the message says why and what to do."""


def _problem(settings: Settings) -> str | None:
    if not getattr(NixlBaseConnector.__init__, MARK, False):
        # The plugin puts that guard in place with the patches this connector needs
        # (streamed handles, the yield to waiting work, the residency route).
        return ("bidir-kv's NixlConnector needs the bidirkv vLLM plugin, which is not "
                "loaded in this process (VLLM_PLUGINS leaves it out?)")
    if not settings.handle_keys:
        return ("BIDIRKV_HANDLE_KEY is not set; refusing to start (KV handles could not be "
                "authenticated)")
    return None


def _residency(settings: Settings) -> Residency:
    """The engine core's one residency (the schedule patch and the route read it)."""
    return current() or install(Residency(owner_lease_s=settings.owner_lease_s,
                                          watermark=settings.retention_watermark))


class NixlConnector(NixlPullConnector):
    """vLLM's pull-mode NIXL connector, built with bidir-kv's scheduler and worker."""

    def __init__(self, vllm_config, role, kv_cache_config):
        # NixlPullConnector.__init__ is the base's, then one scheduler or one worker
        # (checked by nixl/targets.py's readers): the same, with ours, so no NIXL agent
        # is built twice.
        settings = Settings.from_env(os.environ)
        if problem := _problem(settings):
            raise ConnectorError(f"bidir-kv: {problem}")
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        self._tally = Tally()
        self._reuse: Reuse | None = None
        self._retention: Retention | None = None
        if role == KVConnectorRole.SCHEDULER:
            sched = PullScheduler(vllm_config, self.engine_id, kv_cache_config)
            self.connector_scheduler = sched
            self.connector_worker = None
            self._reuse = Reuse(sched, settings.handle_keys, self._tally)
            res = _residency(settings)
            # A shared read is counted done by its notification, which one worker hands
            # over (nixl/notifs.py); with more, a read's notifications are not one a read.
            res.shares = vllm_config.parallel_config.world_size == 1
            self._retention = Retention(sched, res, self._tally)
        elif role == KVConnectorRole.WORKER:
            keep = settings.resolve(bool(current_platform.is_cpu())).keep_affinity
            self.connector_scheduler = None
            self.connector_worker = PullWorker(vllm_config, self.engine_id,
                                               kv_cache_config, keep_affinity=keep)
        log.info("bidir-kv: connector %s (%s side) in pid %d", type(self).__name__,
                 "scheduler" if self.connector_scheduler is not None else "worker",
                 os.getpid())

    # -- scheduler side (engine-core process) -----------------------------------------
    def on_new_request(self, request) -> None:
        assert self._reuse is not None
        self._reuse.on_new_request(request)
        super().on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        assert self._reuse is not None
        if self._reuse.read_before(request):
            return 0, False
        count, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self._reuse.matched(request, count, load_async, num_computed_tokens)
        return count, load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        assert self._retention is not None
        out = super().update_state_after_alloc(request, blocks, num_external_tokens)
        self._retention.after_alloc(request)
        return out

    def build_connector_meta(self, scheduler_output):
        assert self._retention is not None
        self._retention.expire_pending()
        return super().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        assert self._reuse is not None and self._retention is not None
        self._reuse.failed(getattr(connector_output, "failed_recving", None))
        done = getattr(connector_output, "kv_connector_worker_meta", None)
        # vLLM frees what is left in finished_sending right after this call.
        connector_output.finished_sending = self._retention.sent(
            getattr(connector_output, "finished_sending", None),
            done.req_ids if isinstance(done, SharedReadsDone) else ()) or None
        super().update_connector_output(connector_output)

    # -- worker side --------------------------------------------------------------------
    def build_connector_worker_meta(self):
        """The shared reads whose notifications the worker took out this step."""
        worker = self.connector_worker
        return worker.nixl_wrapper.take() if isinstance(worker, PullWorker) else None

    def request_finished(self, request, block_ids):
        return self._finished(request, *super().request_finished(request, block_ids))

    def request_finished_all_groups(self, request, block_ids):
        return self._finished(request,
                              *super().request_finished_all_groups(request, block_ids))

    def _finished(self, request, delay: bool, out: dict | None
                  ) -> tuple[bool, dict[str, Any] | None]:
        assert self._reuse is not None and self._retention is not None
        delay, out = self._reuse.finished(request, delay, out)
        self._retention.finished(request, delay, out)
        return delay, compact(out)

    # -- stats -------------------------------------------------------------------------
    def get_kv_connector_stats(self):
        if self.connector_worker is not None:
            return stats.of(super().get_kv_connector_stats())
        if self._retention is not None:
            self._retention.count()
        data = self._tally.take()
        if readings := workingset.gauge().readings(current()):
            data = {**(data or {}), **readings}
        return None if data is None else stats.BidirkvStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return stats.BidirkvStats(data=data) if data is not None else stats.BidirkvStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames,
                           per_engine_labelvalues):
        return stats.BidirkvPromMetrics(vllm_config, metric_types, labelnames,
                                        per_engine_labelvalues)
