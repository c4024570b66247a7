"""The read-grant exchange on NIXL's side channel (the wire format is lease.py).

Decode, engine-core process:
- `NixlBaseConnectorScheduler._nixl_handshake_listener`: the side-channel thread also
  answers read grants, decided by the residency (residency.py) under its lock.

Prefill, worker process:
- `NixlPullConnectorWorker._read_blocks_for_req`: a read of decode's retained blocks
  (a turn-2 read: it carries D's deadline) asks for the grant first; refused, it takes
  vLLM's expired-read path and the request is recomputed.
"""

from __future__ import annotations

import functools
import logging

from bidirkv.connector.core import lease
from bidirkv.connector.core.residency import current
from bidirkv.connector.patches.guarded import MARK, Skip, Target, resolve, wrap

log = logging.getLogger("vllm.bidirkv")
# One per worker process: which decode peers lately left a grant unanswered.
_GATE = lease.PeerGate()

BASE_SCHEDULER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler"
PULL_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"
TARGETS = [
    Target(BASE_SCHEDULER, "NixlBaseConnectorScheduler._nixl_handshake_listener",
           ("encoded_data", "ready_event", "stop_event", "host", "port")),
    Target(PULL_WORKER, "NixlPullConnectorWorker._read_blocks_for_req",
           ("self", "req_id", "meta")),
    Target(PULL_WORKER, "NixlPullConnectorWorker._handle_failed_transfer",
           ("self", "req_id", "handle", "failed_req_ids", "record_failed_transfer")),
]


# -- decode: the side channel ------------------------------------------------------
def _listener(encoded_data, ready_event, stop_event, host, port):
    """vLLM's side-channel thread, answering read grants too (lease.answer)."""
    import zmq
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import zmq_ctx
    from vllm.utils.network_utils import make_zmq_path

    with zmq_ctx(zmq.ROUTER, make_zmq_path("tcp", host, port)) as sock:
        sock.setsockopt(zmq.RCVTIMEO, 1000)
        ready_event.set()
        while True:
            try:
                frames = sock.recv_multipart()
            except zmq.Again:
                if stop_event.is_set():
                    break
                continue
            if len(frames) != 3:
                continue  # not a REQ peer: nothing to answer
            identity, _, msg = frames
            res = current()
            sock.send_multipart((identity, b"",
                                 *lease.answer(msg, encoded_data,
                                               res.grant if res is not None else None)))


def install_listener() -> None:
    owner, attr, orig = resolve(BASE_SCHEDULER, "NixlBaseConnectorScheduler."
                                "_nixl_handshake_listener")
    if getattr(orig, MARK, False):
        return
    if not isinstance(owner.__dict__.get(attr), staticmethod):
        raise Skip(f"{BASE_SCHEDULER}.{attr} is no longer a staticmethod")
    fn = functools.wraps(orig)(_listener)
    setattr(fn, MARK, True)
    setattr(owner, attr, staticmethod(fn))


# -- prefill: grant before read --------------------------------------------------------------
def _read_blocks_for_req(orig):
    @functools.wraps(orig)
    def _read(self, req_id, meta):
        remote = meta.remote
        if (
            getattr(self, "_bidirectional_kv_xfer_enabled", False)
            and remote is not None
            and remote.blocks_expiry_time is not None  # D's retained blocks, not P's
            and remote.engine_id in self._remote_agents
            and remote.engine_id not in self._invalid_remote_engines
            and any(len(g) for g in meta.local_physical_block_ids)
        ):
            ok, why = _GATE.confirm(remote.host, remote.port, remote.request_id)
            if not ok:
                log.warning("bidir-kv: decode refused the read of %s for %s (%s); "
                            "recomputing", remote.request_id, req_id, why)
                self.xfer_stats.record_kv_expired_req()
                self._handle_failed_transfer(req_id, None, self._recv_failures,
                                             record_failed_transfer=False)
                return None
        return orig(self, req_id, meta)

    return _read



def install_worker() -> list[str]:
    wrap(PULL_WORKER, "NixlPullConnectorWorker._read_blocks_for_req", _read_blocks_for_req)
    return ["grant-before-read"]
