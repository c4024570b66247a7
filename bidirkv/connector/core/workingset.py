"""Decode's KV working set: the share of its KV blocks that live work needs.

vLLM's `vllm:kv_cache_usage_perc` counts the blocks decode retains for a conversation's
next turn, which new work can take (core/residency.py): an autoscaler reading it would
add decode pods for conversations only kept for reuse. So

    working set = (used blocks - retained blocks) / usable blocks

(retained: held, granted or being released) is exported as
`vllm:bidirkv_kv_working_set_ratio`, which the operator's autoscalers scale decode on,
beside `vllm:bidirkv_retained_requests` (one per conversation whose next turn has not
come back), which the operator reads from draining pods (operator/reconcile/heldcount.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

from bidirkv.connector.core.residency import Residency

KV_WORKING_SET_METRIC = "vllm:bidirkv_kv_working_set_ratio"
# Key of the stats' data (engine core -> API server), next to hooks/tally.py's counters.
WORKING_SET = "bidirkv_kv_working_set"
RETAINED_REQUESTS_METRIC = "vllm:bidirkv_retained_requests"
RETAINED = "bidirkv_retained_requests"


def working_set(usage: float, retained_blocks: int, usable_blocks: int) -> float:
    """The share of `usable_blocks` in use by live work: vLLM's `usage` (0..1) less the
    retained blocks' share, within 0..1."""
    if usable_blocks <= 0:
        return 0.0
    return min(1.0, max(0.0, usage - retained_blocks / usable_blocks))


def retained_blocks(res: Residency | None) -> int:
    """Blocks retention pins or is freeing (running totals: no walk, no lock)."""
    if res is None:
        return 0
    return res.kept_blocks() + res.releasing_blocks()


class BlockPool(Protocol):
    """What is read of vLLM's block pool."""

    num_gpu_blocks: int

    def get_usage(self) -> float: ...


@dataclass
class WorkingSetGauge:
    """One engine core's gauge: the scheduler patch binds the block pool (the connector
    has no reference to it), the connector's stats read the value when it changed."""

    pool: BlockPool | None = None
    last: float | None = None
    last_retained: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def bind(self, pool: BlockPool) -> None:
        if self.pool is not pool:
            self.pool = pool

    def value(self, res: Residency | None) -> float | None:
        """The working set now (None before a block pool was bound)."""
        pool = self.pool
        if pool is None:
            return None
        # vLLM's usage leaves out the null block, and so does the share retained here.
        return working_set(pool.get_usage(), retained_blocks(res), pool.num_gpu_blocks - 1)

    def changed(self, res: Residency | None) -> float | None:
        """The value, when it differs from the one last handed over (stats go out only
        when something changed, so an idle engine sends none)."""
        now = self.value(res)
        with self.lock:
            if now is None or now == self.last:
                return None
            self.last = now
        return now

    def readings(self, res: Residency | None) -> dict[str, float | int]:
        """The gauges that changed since they were last handed over, by stats key: the
        working set, and the requests retained for a later turn (parked: a granted one
        is being read back, a releasing one is on its way out; neither waits for a
        turn). No residency (prefill): no retained count."""
        out: dict[str, float | int] = {}
        if (share := self.changed(res)) is not None:
            out[WORKING_SET] = share
        if res is not None:
            parked = res.parked()
            with self.lock:
                if parked != self.last_retained:
                    self.last_retained = parked
                    out[RETAINED] = parked
        return out


_gauge = WorkingSetGauge()


def gauge() -> WorkingSetGauge:
    """This engine-core process's gauge."""
    return _gauge
