"""Bytes the router keeps for long (stored handles) cost their length, not a buffer."""

import tracemalloc

from bidirkv.router.codec import dumps, dumps_kept, loads

HANDLE = {"remote_block_ids": [[100000 + j for j in range(64)]],
          "remote_request_id": "chatcmpl-" + "0" * 32, "remote_port": 5600}


def test_kept_bytes_cost_their_length():
    raw = dumps_kept(HANDLE)
    assert raw == dumps(HANDLE) and loads(raw) == HANDLE
    tracemalloc.start()
    try:
        kept = [dumps_kept(HANDLE) for _ in range(500)]
        per_handle = tracemalloc.get_traced_memory()[0] / len(kept)
    finally:
        tracemalloc.stop()
    assert per_handle < 2 * len(raw) + 256, per_handle
