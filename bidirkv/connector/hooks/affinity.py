"""The model thread keeps its cores while vLLM's NIXL worker starts (CPU platform).

vLLM 0.32's `NixlBaseConnectorWorker.__init__` pins the calling thread to the last core
of each NUMA node on the CPU platform, to keep KV transfer off the model's cores. That
thread is the model thread, so the forward pass moves onto the reserved core, which on
a small host is another server's core: an 8k-token prefill took 35-65 s instead of
4.5 s. bidir-kv's worker (nixl/worker.py) starts inside `kept_affinity`, which puts back
the binding the CPU worker chose before.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

log = logging.getLogger("vllm.bidirkv")


@contextlib.contextmanager
def kept_affinity(enabled: bool) -> Iterator[None]:
    before = (os.sched_getaffinity(0)
              if enabled and hasattr(os, "sched_getaffinity") else None)
    yield
    if before is None:
        return
    after = os.sched_getaffinity(0)
    if after != before:
        os.sched_setaffinity(0, before)
        log.info("bidir-kv: kept the model thread on cores %s (vLLM's NIXL worker "
                 "had moved it to %s; BIDIRKV_CPU_KEEP_AFFINITY=0 allows that)",
                 sorted(before), sorted(after))
