"""What bidir-kv's NIXL classes override or call in vLLM, with the parameters they rely
on: checked before vLLM starts (`bidir-kv serve`), against the installed vLLM by the tests
and against the next release's wheel (tests/test_vllm_next.py). No vLLM import here.
"""

from __future__ import annotations

from bidirkv.connector.targets import PatchSite
from bidirkv.roleconfig import KV_CONNECTOR, KV_CONNECTOR_MODULE

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
CONNECTOR = f"{NIXL}.connector"
PULL_SCHEDULER = f"{NIXL}.pull_scheduler"
BASE_SCHEDULER = f"{NIXL}.base_scheduler"
PULL_WORKER = f"{NIXL}.pull_worker"
STATS = f"{NIXL}.stats"
# The name vLLM's configuration checks compare (config/vllm.py, platforms/cpu.py): the
# subclass is exported under it, so every NIXL-specific default still applies; and what
# `kv_connector_module_path` names. roleconfig.py writes both, the launcher checks them.
NAME = KV_CONNECTOR
MODULE_PATH = KV_CONNECTOR_MODULE

TARGETS = [
    # The connector: our __init__ is NixlPullConnector's with our scheduler and worker.
    PatchSite(CONNECTOR, "NixlPullConnector.__init__",
           ("self", "vllm_config", "role", "kv_cache_config")),
    PatchSite(CONNECTOR, "NixlBaseConnector.__init__",
           ("self", "vllm_config", "role", "kv_cache_config")),
    PatchSite(CONNECTOR, "NixlBaseConnector.on_new_request", ("self", "request")),
    PatchSite(CONNECTOR, "NixlBaseConnector.get_num_new_matched_tokens",
           ("self", "request", "num_computed_tokens")),
    PatchSite(CONNECTOR, "NixlBaseConnector.update_state_after_alloc",
           ("self", "request", "blocks", "num_external_tokens")),
    PatchSite(CONNECTOR, "NixlBaseConnector.build_connector_meta", ("self", "scheduler_output")),
    PatchSite(CONNECTOR, "NixlBaseConnector.update_connector_output",
           ("self", "connector_output")),
    PatchSite(CONNECTOR, "NixlBaseConnector.request_finished", ("self", "request", "block_ids")),
    PatchSite(CONNECTOR, "NixlBaseConnector.request_finished_all_groups",
           ("self", "request", "block_ids")),
    PatchSite(CONNECTOR, "NixlBaseConnector.get_kv_connector_stats", ("self",)),
    PatchSite(CONNECTOR, "NixlBaseConnector.build_kv_connector_stats", ("data",)),
    PatchSite(CONNECTOR, "NixlBaseConnector.build_prom_metrics",
           ("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues")),
    # The scheduler: built as vLLM builds its own; its side channel also answers grants.
    PatchSite(PULL_SCHEDULER, "NixlPullConnectorScheduler.__init__",
           ("self", "vllm_config", "engine_id", "kv_cache_config")),
    PatchSite(BASE_SCHEDULER, "NixlBaseConnectorScheduler._nixl_handshake_listener",
           ("encoded_data", "ready_event", "stop_event", "host", "port")),
    # The worker: asks for a grant before it reads decode's retained blocks.
    PatchSite(PULL_WORKER, "NixlPullConnectorWorker.__init__",
           ("self", "vllm_config", "engine_id", "kv_cache_config")),
    PatchSite(PULL_WORKER, "NixlPullConnectorWorker._read_blocks_for_req",
           ("self", "req_id", "meta")),
    PatchSite(PULL_WORKER, "NixlPullConnectorWorker._handle_failed_transfer",
           ("self", "req_id", "handle", "failed_req_ids", "record_failed_transfer")),
    # Decode's notifications, read through the agent it polls them from, and the shared
    # reads among them handed to the scheduler's side (nixl/notifs.py).
    PatchSite(PULL_WORKER, "NixlPullConnectorWorker._get_new_notifs", ("self",)),
    PatchSite(CONNECTOR, "NixlBaseConnector.build_connector_worker_meta", ("self",)),
    # The stats: NIXL's, with bidir-kv's counters beside them.
    PatchSite(STATS, "NixlKVConnectorStats.reset", ("self",)),
    PatchSite(STATS, "NixlPromMetrics.__init__",
           ("self", "vllm_config", "metric_types", "labelnames", "per_engine_labelvalues")),
    PatchSite(STATS, "NixlPromMetrics.observe", ("self", "transfer_stats_data", "engine_idx")),
]
