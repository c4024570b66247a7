"""vLLM patches that make decode's retained KV yield (residency.py holds the decisions).

Decode, engine-core process:
- `NixlBaseConnector.request_finished[_all_groups]`: a retained request (D, delayed free)
  becomes a `Held` entry, with the router that owns its handle (`bidirkv_owner` in the
  request's kv_transfer_params, set by the router on the decode leg).
- `NixlBaseConnector.update_state_after_alloc`: vLLM only tracks a D request for its
  deadline when it pulled from P; a request that arrived without a P handle (both flags
  false, or a handle the plugin dropped) would be retained and never freed. It is tracked
  like any other.
- `Scheduler.schedule`: before each step, release what must go: owners whose lease lapsed,
  retained blocks above the watermark, and, when a waiting request does not fit in the
  free blocks, the oldest retained requests nobody was granted.
- `NixlBaseConnector.build_connector_meta`: decided releases become a deadline of 0 for
  vLLM's own expiry path (the worker frees them on this step, and the scheduler frees
  them when the worker reports them, exactly as for an expired TTL).
- `NixlBaseConnector.update_connector_output`: freed requests leave the residency.
- the side channel also answers read grants (grants.py).
- `EngineCore.bidirkv_residency`: the utility the `/bidirkv/residency` route calls
  (renew an owner's lease, release handles the router dropped, report capacity).

Prefill asks for a grant before it reads decode's retained blocks (grants.py).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from typing import Any

from bidirkv.connector.core.residency import Residency, blocks_wanted, current, install
from bidirkv.connector.patches import grants as patch_grants
from bidirkv.connector.patches.guarded import Target, resolve, wrap
from bidirkv.wire import MAX_TENANT_LEN, OWNER_KEY, TENANT_KEY

log = logging.getLogger("vllm.bidirkv")

CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector"
SCHEDULER = "vllm.v1.core.sched.scheduler"
ENGINE = "vllm.v1.engine.core"
# Owner leases are checked this often (seconds): cheap, but not every step.
OWNER_CHECK_S = 0.5
# How far down the waiting queues to look for the request that does not fit.
PEEK = 4


def _bidirectional(conn: Any) -> bool:
    cs = getattr(conn, "connector_scheduler", None)
    return bool(cs is not None and cs.is_bidirectional_kv_xfer_enabled
                and getattr(cs, "_TRANSFER_MODE", "pull") == "pull")


# -- decode: retention, release, free ----------------------------------------------------
def _request_finished(orig):
    @functools.wraps(orig)
    def request_finished(self, request, block_ids):
        delay, out = orig(self, request, block_ids)
        if delay and isinstance(out, dict) and out.get("do_remote_decode") and _bidirectional(
            self
        ):
            params = request.kv_transfer_params or {}
            owner = params.get(OWNER_KEY)
            tenant = params.get(TENANT_KEY)
            if not (isinstance(tenant, str) and 0 < len(tenant) <= MAX_TENANT_LEN):
                tenant = None
            deadline = self.connector_scheduler._reqs_need_send.get(request.request_id)
            if deadline is not None:
                blocks = sum(len(g) for g in out.get("remote_block_ids") or ())
                res = current()
                assert res is not None  # installed with the connector patches
                res.retain(request.request_id, blocks,
                           owner if isinstance(owner, str) else None, deadline, tenant)
        return delay, out

    return request_finished


def _update_state_after_alloc(orig):
    @functools.wraps(orig)
    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        out = orig(self, request, blocks, num_external_tokens)
        params = request.kv_transfer_params
        if params and not params.get("do_remote_decode") and _bidirectional(self):
            # Tracked, so vLLM's deadline (and ours) can free it: see the module doc.
            self.connector_scheduler._reqs_in_batch.add(request.request_id)
        return out

    return update_state_after_alloc


def _build_connector_meta(orig):
    @functools.wraps(orig)
    def build_connector_meta(self, scheduler_output):
        res = current()
        if res is not None and _bidirectional(self):
            need_send = self.connector_scheduler._reqs_need_send
            for rid in res.take_pending():
                need_send[rid] = 0.0
        return orig(self, scheduler_output)

    return build_connector_meta


def _update_connector_output(orig):
    @functools.wraps(orig)
    def update_connector_output(self, connector_output):
        res = current()
        sent = getattr(connector_output, "finished_sending", None)
        if res is not None and sent:
            res.on_freed(sent)
        return orig(self, connector_output)

    return update_connector_output


def _first_waiting(sched: Any) -> Any:
    from vllm.v1.request import RequestStatus

    queues = [q for q in (getattr(sched, "kv_holding_waiting", None), sched.waiting) if q]
    for req in itertools.islice(itertools.chain(*queues), PEEK):
        if req.status == RequestStatus.WAITING:
            return req
    return None


def blocks_short(sched: Any, res: Residency) -> int:
    """Blocks the first waiting request lacks, counting those already being released."""
    req = _first_waiting(sched)
    if req is None:
        return 0
    pool = sched.kv_cache_manager.block_pool
    want = blocks_wanted(req.num_tokens, sched.block_size, len(sched.running))
    return max(0, want - pool.get_num_free_blocks() - res.releasing_blocks())


def _schedule(orig):
    @functools.wraps(orig)
    def schedule(self, *args, **kwargs):
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
    out: dict[str, Any] = {"enabled": res is not None, "numBlocks": pool.num_gpu_blocks,
                           "freeBlocks": pool.get_num_free_blocks()}
    if res is None:
        return out
    owner, lease_s = body.get("owner"), body.get("leaseSeconds")
    if isinstance(owner, str) and isinstance(lease_s, int | float):
        res.renew(owner, float(lease_s))
    out["releasedBlocks"] = res.release(body.get("release") or (), "router")
    out.update(res.stats())
    return out


CONNECTOR_TARGETS = [
    Target(CONNECTOR, "NixlBaseConnector.request_finished", ("self", "request", "block_ids")),
    Target(CONNECTOR, "NixlBaseConnector.request_finished_all_groups",
           ("self", "request", "block_ids")),
    Target(CONNECTOR, "NixlBaseConnector.update_state_after_alloc",
           ("self", "request", "blocks", "num_external_tokens")),
    Target(CONNECTOR, "NixlBaseConnector.build_connector_meta", ("self", "scheduler_output")),
    Target(CONNECTOR, "NixlBaseConnector.update_connector_output",
           ("self", "connector_output")),
]
TARGETS = [
    *CONNECTOR_TARGETS,
    Target(SCHEDULER, "Scheduler.schedule", ("self",)),
    # Utility calls are looked up by name on the engine (EngineCore.bidirkv_residency).
    Target(ENGINE, "EngineCoreProc._handle_client_request", ("self", "request_type", "request")),
    *patch_grants.TARGETS,
]
_lock = threading.Lock()


def install_connector(owner_lease_s: float, watermark: float) -> list[str]:
    """Decode-side patches of the connector module (engine-core process)."""
    for t in CONNECTOR_TARGETS:
        resolve(t.module, t.qualname)

    with _lock:
        if current() is None:
            install(Residency(owner_lease_s=owner_lease_s, watermark=watermark))
        wrap(CONNECTOR, "NixlBaseConnector.request_finished", _request_finished)
        wrap(CONNECTOR, "NixlBaseConnector.request_finished_all_groups", _request_finished)
        wrap(CONNECTOR, "NixlBaseConnector.update_state_after_alloc", _update_state_after_alloc)
        wrap(CONNECTOR, "NixlBaseConnector.build_connector_meta", _build_connector_meta)
        wrap(CONNECTOR, "NixlBaseConnector.update_connector_output", _update_connector_output)
        patch_grants.install_listener()
    return ["residency", "read-grants"]


def install_scheduler() -> list[str]:
    wrap(SCHEDULER, "Scheduler.schedule", _schedule)
    return ["yield-retained-kv"]


def install_engine() -> list[str]:
    cls = resolve(ENGINE, "EngineCore")[2]
    if not hasattr(cls, "bidirkv_residency"):
        cls.bidirkv_residency = lambda self, body: residency_utility(self, body)
    return ["residency-utility"]
