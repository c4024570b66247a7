"""Global patches that make decode's retained KV yield (core/residency.py decides; the
connector's own hooks are in connector/hooks/retention.py).

Decode, engine-core process:
- `Scheduler.schedule`: before each step, release what must go: owners whose lease lapsed,
  retained blocks above the watermark, and, when a waiting request does not fit in the
  free blocks (less those prefix caching lets it share), retained requests nobody was
  granted. The connector has no reference to the scheduler's queues or block pool, and a
  release decided here becomes a deadline of 0 in the same step's connector metadata.
- `EngineCore.bidirkv_residency`: the utility the `/bidirkv/residency` route calls
  (renew an owner's lease, release handles the router dropped, keep and recall the
  owner's notes, mark the engine draining, report capacity); utility
  calls are looked up by name on the engine, which has no other way in between steps.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from typing import Any

from bidirkv.connector.core import workingset
from bidirkv.connector.core.notes import exchange
from bidirkv.connector.core.residency import Residency, blocks_wanted, current
from bidirkv.connector.patches.guarded import wrap
from bidirkv.connector.targets import PatchSite, resolve
from bidirkv.wire import RECALL_FIELD, RESIDENCY_KEEP_FIELD

log = logging.getLogger("vllm.bidirkv")

SCHEDULER = "vllm.v1.core.sched.scheduler"
ENGINE = "vllm.v1.engine.core"
# Owner leases are checked this often (seconds): cheap, but not every step.
OWNER_CHECK_S = 0.5
# How far down the waiting queues to look for the request that does not fit.
PEEK = 4


def _first_waiting(sched: Any) -> Any:
    from vllm.v1.request import RequestStatus

    queues = [q for q in (getattr(sched, "kv_holding_waiting", None), sched.waiting) if q]
    for req in itertools.islice(itertools.chain(*queues), PEEK):
        if req.status == RequestStatus.WAITING:
            return req
    return None


def shared_blocks(kvm: Any, req: Any) -> int:
    """Blocks of the request's prompt that prefix caching finds in blocks some request
    holds (a retained turn it extends, most often): it takes them without a free block.
    Cached blocks nobody holds sit in the free pool and are counted there. The lookup is
    the one vLLM's admission makes, without its side effects (no stats, no touch)."""
    if not kvm.prefix_cache_lookup_enabled(req):
        return 0
    hits, _, _ = kvm.coordinator.find_longest_cache_hit(req.block_hashes, req.num_tokens - 1)
    # The first group's blocks: `blocks_wanted` counts the blocks of one group.
    return sum(1 for b in hits[0] if b.ref_cnt > 0 and not b.is_null) if hits else 0


def blocks_short(sched: Any, res: Residency) -> int:
    """Blocks the first waiting request lacks, counting those already being released."""
    req = _first_waiting(sched)
    if req is None:
        return 0
    kvm = sched.kv_cache_manager
    want = blocks_wanted(req.num_tokens, sched.block_size, len(sched.running),
                         shared_blocks(kvm, req))
    return max(0, want - kvm.block_pool.get_num_free_blocks() - res.releasing_blocks())


def _schedule(orig):
    @functools.wraps(orig)
    def schedule(self, *args, **kwargs):
        # The connector's stats read the working set from this pool (core/workingset.py).
        workingset.gauge().bind(self.kv_cache_manager.block_pool)
        res = current()
        if res is not None and res.held:
            try:
                _yield(self, res)
            except Exception:  # noqa: BLE001 - must never take the engine loop down
                log.exception("bidir-kv: residency check failed")
        return orig(self, *args, **kwargs)

    return schedule


def _yield(sched: Any, res: Residency) -> None:
    now = time.monotonic()
    if now >= sched.__dict__.get("_bidirkv_owner_check", 0.0):
        sched.__dict__["_bidirkv_owner_check"] = now + OWNER_CHECK_S
        if n := res.expire_owners():
            log.info("bidir-kv: released %d retained blocks of routers that went away", n)
    total = sched.kv_cache_manager.block_pool.num_gpu_blocks
    if over := res.over_watermark(total):
        res.reclaim(over, "watermark")
    if short := blocks_short(sched, res):
        got = res.reclaim(short, "pressure")
        if got:
            log.info("bidir-kv: a waiting request lacks %d blocks; released %d retained "
                     "blocks", short, got)


# -- the HTTP utility ------------------------------------------------------------------------
def residency_utility(engine: Any, body: dict) -> dict:
    """EngineCore utility: renew an owner, release handles, report; runs between steps."""
    res = current()
    sched = engine.scheduler
    pool = sched.kv_cache_manager.block_pool
    if isinstance(body.get("drain"), bool):
        engine.bidirkv_draining = body["drain"]
    out: dict[str, Any] = {"enabled": res is not None, "numBlocks": pool.num_gpu_blocks,
                           "freeBlocks": pool.get_num_free_blocks(),
                           "draining": getattr(engine, "bidirkv_draining", False),
                           # What a drain waits for besides retained KV (connector/drain.py).
                           "activeRequests": sched.get_num_unfinished_requests()}
    if res is None:
        return out
    owner, lease_s = body.get("owner"), body.get("leaseSeconds")
    if isinstance(owner, str) and isinstance(lease_s, int | float):
        if refused := res.renew(owner, float(lease_s)):
            # Nothing of the call is done: the router keeps its releases for the retry.
            return {**out, "refused": refused}
    out["releasedBlocks"] = res.release(body.get("release") or (), "router")
    out.update(res.stats())
    if isinstance(owner, str):
        out.update(exchange(res.notes, res.lock, res.holds, owner,
                            body.get(RESIDENCY_KEEP_FIELD) or {}, body.get(RECALL_FIELD),
                            res.bulk_of))
    return out


TARGETS = [
    PatchSite(SCHEDULER, "Scheduler.schedule", ("self",)),
    # The pressure check's prefix-cache lookup (shared_blocks).
    PatchSite("vllm.v1.core.kv_cache_manager", "KVCacheManager.prefix_cache_lookup_enabled",
           ("self", "request")),
    PatchSite("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator.find_longest_cache_hit",
           ("self", "block_hashes", "max_cache_hit_length")),
    PatchSite("vllm.v1.core.kv_cache_utils", "KVCacheBlock.ref_cnt"),
    PatchSite("vllm.v1.core.kv_cache_utils", "KVCacheBlock.is_null"),
    # Utility calls are looked up by name on the engine (EngineCore.bidirkv_residency).
    PatchSite(ENGINE, "EngineCoreProc._handle_client_request", ("self", "request_type", "request")),
]


def install_scheduler() -> list[str]:
    wrap(SCHEDULER, "Scheduler.schedule", _schedule)
    return ["yield-retained-kv"]


def install_engine() -> list[str]:
    cls = resolve(ENGINE, "EngineCore")[2]
    if not hasattr(cls, "bidirkv_residency"):
        cls.bidirkv_residency = lambda self, body: residency_utility(self, body)
    return ["residency-utility"]
