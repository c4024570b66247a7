"""Verified reuse at the scheduler-side connector hooks (engine-core process).

The scheduler-side connector is the one place every request's `kv_transfer_params` pass
before vLLM acts on them, and where the params of a finished request are built:
- `on_new_request`: admit the params (core/handles.py), then narrow a D handle on P to
  the verified prefix (core/reuse.py). Runs before the scheduler first looks at the
  request.
- `get_num_new_matched_tokens`: note how many tokens vLLM decided to pull; never pull a
  second time for the same request (vLLM 0.32 does after a failed read or a preemption).
- `update_connector_output`: note reads that failed (P then recomputes).
- `request_finished`: D adds its block digests; both roles sign what they hand out; P
  adds its reuse report. D keeps blocks and hands out a handle only for a request that
  carried the router's proof (bidirkv/proof.py); any other request's blocks are freed at
  once and it gets no handle.
`sched` is vLLM's pull-mode connector scheduler (NixlPullConnectorScheduler), read for
its configuration and, to keep nothing for a request, its send bookkeeping.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from bidirkv.connector.core import digests
from bidirkv.connector.core.handles import (
    ReplayGuard,
    admit,
    block_counts,
    normalized,
    placeholder_ids,
    sign,
    stamp_expiry,
)
from bidirkv.connector.core.reuse import (
    Report,
    offered_tokens,
    plan,
    record_load_failure,
    record_match,
)
from bidirkv.connector.hooks import tally
from bidirkv.proof import PROOF_TTL_S, proof_problem
from bidirkv.roleconfig import FINGERPRINT_ENV
from bidirkv.wire import (
    BLOCKS_KEY,
    COUNTS_KEY,
    MAC_KEY,
    PROOF_KEY,
    REPORT_KEY,
    VERSION,
    VERSION_KEY,
    version_problem,
)

log = logging.getLogger("vllm.bidirkv")

QUIET = ("match", "prompt_shorter", "local_cache", "below_threshold")


@dataclass
class State:
    keys: tuple[bytes, ...]  # the current key (signs) first, then the previous one
    seed: bytes
    fingerprint: str
    max_tokens: int
    guard: ReplayGuard
    proofs: ReplayGuard = field(default_factory=lambda: ReplayGuard(ttl=3 * PROOF_TTL_S))
    failed: set[str] = field(default_factory=set)
    # Requests that carried a valid router proof (D keeps their blocks for reuse).
    proven: set[str] = field(default_factory=set)
    # Kept here, not in the params: those travel to the workers with the request.
    reports: dict[str, Report] = field(default_factory=dict)


def new_state(sched: Any, keys: tuple[bytes, ...]) -> State:
    cfg = sched.vllm_config
    mc, cc = cfg.model_config, cfg.cache_config
    seed = digests.model_seed(str(mc.model), getattr(mc, "revision", None),
                              str(mc.dtype), str(cc.cache_dtype), int(sched.block_size),
                              digests.engine_shaping(mc, cc, os.environ.get(FINGERPRINT_ENV)))
    ttl = max(float(sched.decoder_kv_blocks_ttl), float(sched._kv_lease_duration))
    return State(keys, seed, digests.fingerprint(seed), int(mc.max_model_len),
                 ReplayGuard(ttl=2 * ttl))


def _tokens(request: Any) -> list[int] | None:
    """The prompt's token ids, or None when ids alone do not determine its KV."""
    if getattr(request, "prompt_embeds", None) is not None or getattr(
        request, "mm_features", None
    ):
        return None
    return request.prompt_token_ids


def _request_seed(st: State, request: Any) -> bytes:
    lora = getattr(request, "lora_request", None)
    return digests.request_seed(st.seed, getattr(lora, "lora_name", None),
                                getattr(request, "cache_salt", None))


def _layout_ok(sched: Any, counts: list[int]) -> bool:
    """Prefix narrowing is per-token blocks: full attention in every group only."""
    groups = sched.kv_cache_config.transfer_groups
    return not getattr(sched, "_is_hma_required", True) and len(counts) == len(groups)


class Reuse:
    """One scheduler-side connector's reuse checks (one per engine core)."""

    def __init__(self, sched: Any, keys: tuple[bytes, ...],
                 counts: tally.Tally | None = None) -> None:
        self.sched = sched
        self.state = new_state(sched, keys)
        self.tally = counts or tally.Tally()

    def on_new_request(self, request: Any) -> None:
        """Admit the request's params in place (a bug here costs reuse, not the engine)."""
        params = request.kv_transfer_params
        if not (isinstance(params, dict) and params):
            return
        try:
            self._admit(request, params)
        except Exception:  # noqa: BLE001 - see the docstring
            log.exception("bidir-kv: request %s: params check failed; served without "
                          "KV transfer", request.request_id)
            params.clear()

    def _admit(self, request: Any, params: dict) -> None:
        st = self.state
        proof = params.pop(PROOF_KEY, None)
        if proof is not None:
            # A router of another wire version would store a handle it cannot read back.
            problem = (version_problem(params.get(VERSION_KEY), "the router's leg")
                       or proof_problem(proof, st.keys, st.proofs.first_use))
            if problem is None:
                st.proven.add(request.request_id)
            else:
                log.warning("bidir-kv: request %s: %s; its KV will not be kept for reuse",
                            request.request_id, problem)
        offered = offered_tokens(params)
        adm = admit(params, st.keys, st.max_tokens, st.guard)
        if adm.problem:
            self.tally.count(tally.DROPPED, adm.reason or "malformed")
            log.warning("bidir-kv: request %s: kv_transfer_params handle dropped: %s",
                        request.request_id, adm.problem)
        if adm.params.get("do_remote_decode") and (adm.handle or adm.problem):
            st.reports[request.request_id] = plan(
                adm, offered, _tokens(request), st.seed, _request_seed(st, request),
                self.sched.block_size,
                adm.handle and _layout_ok(self.sched, block_counts(adm.params)))
        if adm.handle and adm.params.get("remote_block_ids") is None:
            # A compact handle P lent (D reads): vLLM takes a read only with a block list
            # of its length; the ids come with the ask before the read (nixl/worker.py).
            adm.params["remote_block_ids"] = placeholder_ids(block_counts(adm.params))
        # In place: the request and its sampling params share this dict.
        params.clear()
        params.update(adm.params)

    @staticmethod
    def read_before(request: Any) -> bool:
        """True when this request already read its D handle. vLLM asks again when the
        request comes back with nothing computed: after a failed read under the
        `recompute` policy it would park the request for a read that is never issued
        (the request hangs), after a preemption it would read blocks D already freed."""
        params = request.kv_transfer_params or {}
        return bool(params.get("do_remote_decode") and params.get("_remote_blocks_processed"))

    def matched(self, request: Any, count: int | None, load_async: bool,
                num_computed_tokens: int) -> None:
        report = self.state.reports.get(request.request_id)
        if report is not None:
            record_match(report, count if load_async and count else 0,
                         num_computed_tokens, request.num_prompt_tokens)

    def failed(self, req_ids: Iterable[str] | None) -> None:
        if req_ids:
            self.state.failed.update(req_ids)

    def finished(self, request: Any, delay: bool, out: dict | None
                 ) -> tuple[bool, dict | None]:
        """vLLM's (delay, params) of a finished request, checked, signed and reported."""
        st = self.state
        rid = request.request_id
        failed = rid in st.failed
        st.failed.discard(rid)
        proven = rid in st.proven
        st.proven.discard(rid)
        report = st.reports.pop(rid, None)
        hands_out = out is not None and (out.get("do_remote_decode")
                                         or out.get("do_remote_prefill"))
        if delay and hands_out and not proven:
            # Not sent by the router: keep nothing, hand out nothing. On D (its blocks
            # for P's next turn) and on P alike (its blocks for D): a handle taken
            # straight from an engine and replayed once its blocks held other KV would
            # read that KV.
            self.sched._reqs_need_send.pop(rid, None)
            self.sched._reqs_not_processed.add(rid)
            self.tally.add(tally.UNPROVEN, 1)
            return False, None
        if out is None:
            return delay, out
        try:
            out = self._sign(request, normalized(out), delay)
        except Exception:  # noqa: BLE001 - unsigned, the handle is merely not reused
            log.exception("bidir-kv: request %s: could not sign its handle", rid)
            return delay, out
        if report is not None:
            if failed:
                record_load_failure(report, request.num_prompt_tokens)
            out[REPORT_KEY] = report.wire()
            self._count(report)
            # Routine reuse is in the response; what an operator should see is logged.
            level = logging.DEBUG if report.reason in QUIET else logging.INFO
            log.log(level, "bidir-kv: request %s reuse: %s", rid, out[REPORT_KEY])
        return delay, out

    def _count(self, report: Report) -> None:
        self.tally.count(tally.REUSE, report.reason)
        self.tally.add(tally.REUSED_TOKENS, report.reused_tokens)
        self.tally.add(tally.RECOMPUTED_TOKENS, report.recomputed_tokens or 0)

    def _sign(self, request: Any, out: dict, delay: bool) -> dict:
        st, sched = self.state, self.sched
        if out.get("do_remote_decode") and delay and _tokens(request) is not None:
            # D: what its retained blocks hold (prompt + output, minus the last sampled
            # token, whose KV was never computed).
            held = request.all_token_ids[: out.get("remote_num_tokens") or 0]
            out[BLOCKS_KEY] = digests.HeldBlocks.of(
                sched.block_size, st.fingerprint, _request_seed(st, request), held,
            ).to_wire()
        if delay and out.get("remote_block_ids"):
            # The issuer keeps the ids (D with the retained request, P with the blocks it
            # lends) and hands them to the reader when it asks (core/lease.py); the
            # handle names only how many there are, and the connector leaves the ids out
            # once retention took them.
            out[COUNTS_KEY] = [len(g) for g in out["remote_block_ids"]]
        if out.get("remote_block_ids"):
            # How long the issuer keeps the blocks: D its TTL, P its lease (which D's
            # heartbeats extend once it admitted the handle; admission is what is checked).
            lifetime = (sched.decoder_kv_blocks_ttl if out.get("do_remote_decode")
                        else sched._kv_lease_duration)
            stamp_expiry(out, float(lifetime))
            out[MAC_KEY] = sign(out, st.keys[0])
            out[VERSION_KEY] = VERSION
        return out
