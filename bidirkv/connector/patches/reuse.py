"""Scheduler-side patches of vLLM's pull-mode NIXL connector (engine core process).

`NixlPullConnectorScheduler` (vllm/distributed/kv_transfer/kv_connector/v1/nixl/
pull_scheduler.py) is the one place every request's `kv_transfer_params` pass before
vLLM acts on them, and where the params of a finished request are built:
- `on_new_request`: admit the params (handles.py), then narrow a D handle on P to the
  verified prefix (reuse.py). Runs before the scheduler first looks at the request.
- `get_num_new_matched_tokens`: note how many tokens vLLM decided to pull; never pull a
  second time for the same request (vLLM 0.32 does after a failed read or a preemption).
- `update_connector_output`: note reads that failed (P then recomputes).
- `request_finished`: D adds its block digests; both roles sign what they hand out; P
  adds its reuse report. D keeps blocks and hands out a handle only for a request that
  carried the router's proof (handles.make_proof); any other request's blocks are freed
  at once and it gets no handle.
Push mode (NixlPushConnector) is left alone: it does not support bidirectional transfer.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

from bidirkv.connector.core import digests
from bidirkv.connector.core.handles import ReplayGuard, admit, normalized, sign, stamp_expiry
from bidirkv.connector.core.reuse import (
    Report,
    offered_tokens,
    plan,
    record_load_failure,
    record_match,
)
from bidirkv.connector.patches.guarded import Skip, Target, resolve, wrap
from bidirkv.proof import PROOF_TTL_S, proof_problem
from bidirkv.wire import (
    BLOCKS_KEY,
    MAC_KEY,
    PROOF_KEY,
    REPORT_KEY,
    VERSION,
    VERSION_KEY,
    version_problem,
)

log = logging.getLogger("vllm.bidirkv")

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler"
CLASS = "NixlPullConnectorScheduler"
STATE = "_bidirkv_state"
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


def _state(sched: Any, keys: tuple[bytes, ...]) -> State:
    st = sched.__dict__.get(STATE)
    if st is None:
        cfg = sched.vllm_config
        mc, cc = cfg.model_config, cfg.cache_config
        seed = digests.model_seed(str(mc.model), getattr(mc, "revision", None),
                                  str(mc.dtype), str(cc.cache_dtype), int(sched.block_size))
        ttl = max(float(sched.decoder_kv_blocks_ttl), float(sched._kv_lease_duration))
        st = State(keys, seed, digests.fingerprint(seed), int(mc.max_model_len),
                   ReplayGuard(ttl=2 * ttl))
        sched.__dict__[STATE] = st
    return st


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


def _layout_ok(sched: Any, ids: list) -> bool:
    """Prefix narrowing is per-token blocks: full attention in every group only."""
    groups = sched.kv_cache_config.transfer_groups
    return not getattr(sched, "_is_hma_required", True) and len(ids) == len(groups)


def _on_new_request(orig, keys):
    @functools.wraps(orig)
    def on_new_request(self, request):
        params = request.kv_transfer_params
        if isinstance(params, dict) and params:
            try:
                _admit(self, request, params, keys)
            except Exception:  # noqa: BLE001 - a bug here must cost reuse, not the engine
                log.exception("bidir-kv: request %s: params check failed; served without "
                              "KV transfer", request.request_id)
                params.clear()
        return orig(self, request)

    return on_new_request


def _admit(sched: Any, request: Any, params: dict, keys: tuple[bytes, ...]) -> None:
    st = _state(sched, keys)
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
        log.warning("bidir-kv: request %s: kv_transfer_params handle dropped: %s",
                    request.request_id, adm.problem)
    if adm.params.get("do_remote_decode") and (adm.handle or adm.problem):
        ids = adm.params.get("remote_block_ids") or []
        st.reports[request.request_id] = plan(
            adm, offered, _tokens(request), st.seed, _request_seed(st, request),
            sched.block_size, _layout_ok(sched, ids))
    # In place: the request and its sampling params share this dict.
    params.clear()
    params.update(adm.params)


def _get_num_new_matched_tokens(orig):
    @functools.wraps(orig)
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode") and params.get("_remote_blocks_processed"):
            # A D handle is read at most once. vLLM asks again when the request comes
            # back with nothing computed: after a failed read under the `recompute`
            # policy it would park the request for a read that is never issued (the
            # request hangs), after a preemption it would read blocks D already freed.
            return 0, False
        count, load_async = orig(self, request, num_computed_tokens)
        st = self.__dict__.get(STATE)
        report = st.reports.get(request.request_id) if st is not None else None
        if report is not None:
            record_match(report, count if load_async and count else 0,
                         num_computed_tokens, request.num_prompt_tokens)
        return count, load_async

    return get_num_new_matched_tokens


def _update_connector_output(orig, keys):
    @functools.wraps(orig)
    def update_connector_output(self, connector_output):
        failed = getattr(connector_output, "failed_recving", None)
        if failed:
            _state(self, keys).failed.update(failed)
        return orig(self, connector_output)

    return update_connector_output


def _request_finished(orig, keys):
    @functools.wraps(orig)
    def request_finished(self, request, block_ids):
        delay, out = orig(self, request, block_ids)
        st = _state(self, keys)
        failed = request.request_id in st.failed
        st.failed.discard(request.request_id)
        proven = request.request_id in st.proven
        st.proven.discard(request.request_id)
        hands_out = out is not None and (out.get("do_remote_decode")
                                          or out.get("do_remote_prefill"))
        if delay and hands_out and not proven:
            # Not sent by the router: keep nothing, hand out nothing. On D (its blocks
            # for P's next turn) and on P alike (its blocks for D): a handle taken
            # straight from an engine and replayed once its blocks held other KV would
            # read that KV.
            self._reqs_need_send.pop(request.request_id, None)
            self._reqs_not_processed.add(request.request_id)
            st.reports.pop(request.request_id, None)
            return False, None
        if out is None:
            st.reports.pop(request.request_id, None)
            return delay, out
        report = st.reports.pop(request.request_id, None)
        try:
            out = _finish(self, st, request, normalized(out), delay)
        except Exception:  # noqa: BLE001 - unsigned, the handle is merely not reused
            log.exception("bidir-kv: request %s: could not sign its handle",
                          request.request_id)
            return delay, out
        if report is not None:
            if failed:
                record_load_failure(report, request.num_prompt_tokens)
            out[REPORT_KEY] = report.wire()
            # Routine reuse is in the response; what an operator should see is logged.
            level = logging.DEBUG if report.reason in QUIET else logging.INFO
            log.log(level, "bidir-kv: request %s reuse: %s", request.request_id, out[REPORT_KEY])
        return delay, out

    return request_finished


def _finish(sched: Any, st: State, request: Any, out: dict, delay: bool) -> dict:
    if out.get("do_remote_decode") and delay and _tokens(request) is not None:
        # D: what its retained blocks hold (prompt + output, minus the last sampled
        # token, whose KV was never computed).
        held = request.all_token_ids[: out.get("remote_num_tokens") or 0]
        out[BLOCKS_KEY] = digests.HeldBlocks(
            sched.block_size, st.fingerprint,
            digests.block_digests(_request_seed(st, request), held, sched.block_size),
        ).to_wire()
    if out.get("remote_block_ids"):
        # How long the issuer keeps the blocks: D its TTL, P its lease (which D's
        # heartbeats extend once it admitted the handle; admission is what is checked).
        lifetime = (sched.decoder_kv_blocks_ttl if out.get("do_remote_decode")
                    else sched._kv_lease_duration)
        stamp_expiry(out, float(lifetime))
        out[MAC_KEY] = sign(out, st.keys[0])
        out[VERSION_KEY] = VERSION
    return out


TARGETS = [
    Target(MODULE, f"{CLASS}.on_new_request", ("self", "request")),
    Target(MODULE, f"{CLASS}.get_num_new_matched_tokens",
           ("self", "request", "num_computed_tokens")),
    Target(MODULE, f"{CLASS}.update_connector_output", ("self", "connector_output")),
    Target(MODULE, f"{CLASS}.request_finished", ("self", "request", "block_ids")),
]


def install(keys: tuple[bytes, ...]) -> list[str]:
    # All or nothing: D publishing digests that no P checks (or the reverse) would
    # only turn reuse off in a way that is harder to see.
    for t in TARGETS:
        resolve(t.module, t.qualname)
    if not keys:
        raise Skip("no handle key (BIDIRKV_HANDLE_KEY)")
    wrap(MODULE, f"{CLASS}.on_new_request", lambda o: _on_new_request(o, keys))
    wrap(MODULE, f"{CLASS}.get_num_new_matched_tokens", _get_num_new_matched_tokens)
    wrap(MODULE, f"{CLASS}.update_connector_output",
         lambda o: _update_connector_output(o, keys))
    wrap(MODULE, f"{CLASS}.request_finished", lambda o: _request_finished(o, keys))
    return ["verified-reuse"]
