"""Decode's retained requests at the scheduler-side connector hooks (engine-core
process); core/residency.py decides what stays and what goes.

- `request_finished`: a retained request (D, delayed free) becomes a `Held` entry, with
  its block ids, the router that owns its handle (`bidirkv_owner` in the request's
  kv_transfer_params, set by the router on the decode leg), its tenant label and the
  router's estimate of when its conversation comes back (`bidirkv_return_s`).
- `update_state_after_alloc`: vLLM only tracks a D request for its deadline when it
  pulled from P; a request that arrived without a P handle (both flags false, or a handle
  the plugin dropped) would be retained and never freed. It is tracked like any other.
- `build_connector_meta`: decided releases become a deadline of 0 for vLLM's own expiry
  path (the worker frees them on this step, and the scheduler frees them when the worker
  reports them, exactly as for an expired TTL).
- `update_connector_output`: freed requests leave the residency.
`sched` is vLLM's pull-mode connector scheduler: its send deadlines (`_reqs_need_send`)
and the requests it tracks (`_reqs_in_batch`) are what vLLM's expiry path acts on.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from bidirkv.connector.core.residency import Residency
from bidirkv.connector.hooks import tally
from bidirkv.returns import gap_of
from bidirkv.wire import (
    COUNTS_KEY,
    MAX_TENANT_LEN,
    NOTE_LEAVES_OUT,
    OWNER_KEY,
    RETURN_KEY,
    SHARED_BLOCKS_KEY,
    TENANT_KEY,
)


def bidirectional(sched: Any) -> bool:
    return bool(sched is not None and sched.is_bidirectional_kv_xfer_enabled
                and getattr(sched, "_TRANSFER_MODE", "pull") == "pull")


class Retention:
    """One engine core's retained requests, as the connector hooks see them."""

    def __init__(self, sched: Any, residency: Residency,
                 counts: tally.Tally | None = None) -> None:
        self.sched = sched
        self.residency = residency
        self.enabled = bidirectional(sched)
        self.tally = counts or tally.Tally()

    def finished(self, request: Any, delay: bool, out: dict | None) -> None:
        if delay and isinstance(out, dict) and out.get("do_remote_prefill") and (
                COUNTS_KEY in out):
            # P lends these blocks to D for this turn, whatever the transfer's direction:
            # D asks for their ids before it reads (core/lease.py's Lent).
            self.residency.lent.lend(request.request_id,
                                     [list(g) for g in out.get("remote_block_ids") or ()])
        if not (self.enabled and delay and isinstance(out, dict)
                and out.get("do_remote_decode")):
            return
        params = request.kv_transfer_params or {}
        owner = params.get(OWNER_KEY)
        tenant = params.get(TENANT_KEY)
        if not (isinstance(tenant, str) and 0 < len(tenant) <= MAX_TENANT_LEN):
            tenant = None
        deadline = self.sched._reqs_need_send.get(request.request_id)
        if deadline is not None:
            # Ids, not only a count: an extend shares its history's blocks with the turn
            # it extends, and those are pinned once, not twice. Per group, too: the
            # grant hands them to the reader as vLLM lists them.
            groups = out.get("remote_block_ids") or ()
            ids = [b for g in groups for b in g]
            shared = self.residency.retain(
                request.request_id, len(ids), owner if isinstance(owner, str) else None,
                deadline, tenant, gap_of(params.get(RETURN_KEY)), ids,
                {k: out[k] for k in NOTE_LEAVES_OUT if k in out},
                tuple(len(g) for g in groups))
            # The router's block bounds count a shared prefix once, as decode does.
            out[SHARED_BLOCKS_KEY] = shared

    def after_alloc(self, request: Any) -> None:
        params = request.kv_transfer_params
        if self.enabled and params and not params.get("do_remote_decode"):
            # Tracked, so vLLM's deadline (and ours) can free it: see the module doc.
            self.sched._reqs_in_batch.add(request.request_id)

    def expire_pending(self) -> None:
        """Before vLLM builds the step's metadata: decided releases expire now."""
        if not self.enabled:
            return
        need_send = self.sched._reqs_need_send
        for rid in self.residency.take_pending():
            need_send[rid] = 0.0

    def sent(self, finished: Iterable[str] | None, shared_done: Iterable[str]) -> set[str]:
        """A step's reads: the shared ones done count first, then of the requests vLLM
        would free (`finished`), those it may free now; a request spent while children
        still read it shared keeps its blocks until they are done (Residency.frees)."""
        for rid in shared_done:
            self.residency.shared_done(rid)
        return self.residency.frees(finished or ())

    def count(self) -> None:
        """Hand the residency's cumulative counters to the tally (what grew)."""
        res = self.residency
        with res.lock:
            released = dict(res.released)
            grants = {"granted": res.grants, **res.refusals}
        self.tally.grown(tally.RELEASED, released)
        self.tally.grown(tally.GRANTS, grants)
