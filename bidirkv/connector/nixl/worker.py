"""bidir-kv's pull-mode connector worker: vLLM's, which asks decode for a grant before
it reads decode's retained blocks, and leaves the model thread on its cores (CPU).

A read of decode's retained blocks (a turn-2 read: it carries D's deadline) asks for the
grant first (core/lease.py), which also brings the blocks' ids (decode's handle carries
only their count); refused, or granted without ids for every block to read, it takes
vLLM's expired-read path and the request is recomputed. A read of prefill's blocks
(decode, each turn) asks prefill for their ids the same way; without them it is a failed
transfer. A read that would still use a placeholder id is never issued. A child's
shared read of its parent's blocks (its request id prefixed, core/handles.py) asks and
notifies the same way; decode tells its notification apart (nixl/notifs.py).
"""

from __future__ import annotations

import logging

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)

from bidirkv.connector.core import lease
from bidirkv.connector.hooks.affinity import kept_affinity
from bidirkv.connector.nixl.notifs import SharedNotifs

log = logging.getLogger("vllm.bidirkv")


class PullWorker(NixlPullConnectorWorker):
    def __init__(self, vllm_config, engine_id, kv_cache_config, keep_affinity: bool = False):
        # Which decode peers lately left a grant unanswered (one gate per worker).
        self.grant_gate = lease.PeerGate()
        with kept_affinity(keep_affinity):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        # A shared read's notification leaves the blocks retained (nixl/notifs.py).
        self.nixl_wrapper = SharedNotifs(self.nixl_wrapper)

    def _read_blocks_for_req(self, req_id, meta):
        remote = meta.remote
        if (
            remote is not None
            and remote.engine_id in self._remote_agents  # else vLLM handshakes first
            and remote.engine_id not in self._invalid_remote_engines
            and any(len(g) for g in meta.local_physical_block_ids)  # else it only notifies
        ):
            # D's retained blocks (they carry D's deadline) are read only once granted;
            # P's lent blocks only once P gave the ids its handle left out.
            retained = (self._bidirectional_kv_xfer_enabled
                        and remote.blocks_expiry_time is not None)
            if retained or lease.has_placeholder(remote.block_ids):
                ok, why, given = self.grant_gate.confirm(remote.host, remote.port,
                                                         remote.request_id)
                ids = lease.ids_to_read(remote.block_ids, given) if ok else None
                if ids is None:
                    return self._recompute(req_id, remote.request_id, retained,
                                           why if not ok else "the ids given do not cover it")
                remote.block_ids = type(remote.block_ids)(ids)
        return super()._read_blocks_for_req(req_id, meta)

    def _recompute(self, req_id, remote_req_id, retained: bool, why: str) -> None:
        """No read: a refused grant takes vLLM's expired-read path, P's blocks without
        their ids a failed transfer; `kv_load_failure_policy` recomputes either."""
        log.warning("bidir-kv: no read of %s's %s for %s (%s); recomputing", remote_req_id,
                    "retained blocks" if retained else "lent blocks", req_id, why)
        if retained:
            self.xfer_stats.record_kv_expired_req()
        self._handle_failed_transfer(req_id, None, self._recv_failures,
                                     record_failed_transfer=False)
