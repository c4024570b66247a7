"""bidir-kv's pull-mode connector scheduler: vLLM's, whose side channel also answers
read grants and asks for lent blocks' ids (engine-core process).

Prefill asks decode over NIXL's side channel for a grant right before it reads decode's
retained blocks (core/lease.py is the wire format). The grant is decided by the
residency (core/residency.py) under its lock, so a release and a read never overlap.
vLLM starts the side-channel thread with `self._nixl_handshake_listener`, so this
class's listener is the one that runs.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)

from bidirkv.connector.core import lease
from bidirkv.connector.core.residency import current


class PullScheduler(NixlPullConnectorScheduler):
    @staticmethod
    def _nixl_handshake_listener(encoded_data, ready_event, stop_event, host, port):
        """vLLM's side-channel thread: handshakes as vLLM answers them, and grants."""
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
                                                   res.answer if res is not None else None)))
