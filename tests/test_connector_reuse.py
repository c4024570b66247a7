"""D publishes digests, P verifies: the connector's reuse hooks driven with stand-ins for
vLLM.

The upstream functions mimic vLLM 0.32's NixlPullConnectorScheduler closely enough for the
contract between the hooks (bidirkv/connector/hooks/reuse.py, called by the connector's
overrides in bidirkv/connector/nixl/connector.py in this order) and the pure parts
(digests, handles, reuse); the real connector runs in e2e/test_connector.py.
"""

from types import SimpleNamespace

import pytest

from bidirkv.connector.core.handles import admit, compact, sign
from bidirkv.connector.core.lease import ids_to_read
from bidirkv.connector.core.reuse import Report, plan
from bidirkv.connector.hooks import tally
from bidirkv.connector.hooks.reuse import Reuse
from bidirkv.proof import make_proof
from bidirkv.wire import COUNTS_KEY, MAC_KEY, VERSION, VERSION_KEY

BS = 16
KEY = b"k"


def scheduler(dtype="torch.float32", bs=BS, threshold=0):
    return SimpleNamespace(
        vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(model="tiny", revision=None, dtype=dtype,
                                         max_model_len=4096),
            cache_config=SimpleNamespace(cache_dtype="auto"),
        ),
        block_size=bs, decoder_kv_blocks_ttl=60, _kv_lease_duration=30, engine_id="e",
        kv_cache_config=SimpleNamespace(transfer_groups=[object()]),
        _is_hma_required=False, kv_recompute_threshold=threshold,
        _reqs_need_send={}, _reqs_not_processed=set(),
    )


def request(rid, prompt, params, output=()):
    tokens = list(prompt) + list(output)
    return SimpleNamespace(
        request_id=rid, kv_transfer_params=params, prompt_token_ids=list(prompt),
        all_token_ids=tokens, num_prompt_tokens=len(prompt),
        # vLLM never computes KV for the last sampled token.
        num_computed_tokens=len(tokens) - 1 if output else len(prompt),
        lora_request=None, cache_salt=None, prompt_embeds=None, mm_features=[],
    )


def upstream_finished(self, req, block_ids):
    is_p = bool(req.kv_transfer_params.get("do_remote_decode"))
    return True, {
        "do_remote_prefill": is_p, "do_remote_decode": not is_p,
        "remote_block_ids": (list(block_ids[0]),), "remote_engine_id": self.engine_id,
        "remote_request_id": req.request_id, "remote_host": "127.0.0.1", "remote_port": 1,
        "tp_size": 1, "dcp_size": 1, "pp_size": 1,
        "remote_num_tokens": req.num_computed_tokens, "remote_blocks_expiry_time": 5.0,
        "transfer_mode": "pull",
    }


def upstream_matched(self, req, num_computed):
    p = req.kv_transfer_params
    if p.get("do_remote_decode") and p.get("remote_block_ids"):
        count = min(p.get("remote_num_tokens") or 0, req.num_prompt_tokens) - num_computed
        if count > 0 and not (self.kv_recompute_threshold and count < self.kv_recompute_threshold):
            return count, True
    return 0, False


KEYS = (KEY,)


def reuse_of(sched):
    """The connector's Reuse for this scheduler (one per engine core)."""
    if "_reuse" not in sched.__dict__:
        sched._reuse = Reuse(sched, KEYS)
    return sched._reuse


def on_new(sched, req):
    reuse_of(sched).on_new_request(req)


def matched(sched, req, num_computed):
    r = reuse_of(sched)
    if r.read_before(req):
        return 0, False
    count, load_async = upstream_matched(sched, req, num_computed)
    r.matched(req, count, load_async, num_computed)
    return count, load_async


def finished(sched, req, block_ids):
    """As the connector hands a finished request's params out (decode's retention, which
    takes the ids, is tests/test_connector_residency.py's)."""
    delay, out = reuse_of(sched).finished(req, *upstream_finished(sched, req, block_ids))
    return delay, compact(out)


def conn_out(sched, out):
    reuse_of(sched).failed(getattr(out, "failed_recving", None))


PROMPT1 = list(range(1000, 1070))  # 70 tokens
OUTPUT1 = list(range(2000, 2030))  # 30 tokens: D holds 99 -> 6 full blocks


def decode_turn(d, proof=True):
    params = {"do_remote_prefill": False, "do_remote_decode": False}
    if proof:
        params["bidirkv_proof"] = make_proof(KEY)  # what the router adds to a decode leg
        params[VERSION_KEY] = VERSION
    req = request("d1", PROMPT1, params, OUTPUT1)
    on_new(d, req)
    d.__dict__.setdefault("_reqs_need_send", {})["d1"] = 99.0  # vLLM's TTL deadline
    d_blocks = list(range(50, 57))
    _, handle = finished(d, req, (d_blocks,))
    return handle


def test_decode_keeps_nothing_for_a_request_without_the_routers_proof():
    d = scheduler()
    assert decode_turn(d, proof=False) is None
    assert "d1" not in d._reqs_need_send and "d1" in d._reqs_not_processed
    # A proof made with another key, or used twice, is no proof.
    req = request("d2", PROMPT1, {VERSION_KEY: VERSION, "bidirkv_proof": make_proof(b"other")},
                  OUTPUT1)
    on_new(d, req)
    assert finished(d, req, ([1],)) == (False, None)
    proof = make_proof(KEY)
    first = request("d3", PROMPT1, {VERSION_KEY: VERSION, "bidirkv_proof": proof}, OUTPUT1)
    on_new(d, first)
    assert finished(d, first, ([1],))[1] is not None
    again = request("d4", PROMPT1, {VERSION_KEY: VERSION, "bidirkv_proof": proof}, OUTPUT1)
    on_new(d, again)
    assert finished(d, again, ([1],)) == (False, None)
    # Counted for the connector's stats: d1, d2 and d4 kept nothing.
    assert reuse_of(d).tally.take()[tally.UNPROVEN] == 3


def test_decode_hands_out_no_handle_on_a_leg_of_another_wire_version():
    """A router of another release would store a handle no engine of this one admits."""
    d = scheduler()
    for version in (VERSION + 1, VERSION - 1, None):
        req = request(f"v{version}", PROMPT1,
                      {VERSION_KEY: version, "bidirkv_proof": make_proof(KEY)}, OUTPUT1)
        on_new(d, req)
        assert finished(d, req, ([1],)) == (False, None)


def read_ids(params, granted=(list(range(50, 57)),)):
    """The ids P's worker reads once D's grant gave it D's ids (decode_turn's blocks)."""
    return ids_to_read(params["remote_block_ids"], list(granted))


def prefill_turn(p, handle, prompt, local_cached=0, fail=False, proof=True):
    params = dict(handle, do_remote_decode=True, do_remote_prefill=False)
    if proof:
        params["bidirkv_proof"] = make_proof(KEY)  # what the router adds to a prefill leg
        params[VERSION_KEY] = VERSION
    req = request("p2", prompt, params)
    on_new(p, req)
    count, _ = matched(p, req, local_cached)
    if fail:
        conn_out(p, SimpleNamespace(failed_recving={"p2"}))
    _, out = finished(p, req, ([1, 2, 3],))
    return req.kv_transfer_params, count, out


def test_prefill_hands_out_no_handle_without_the_routers_proof():
    """A caller of P's port without the key gets its one token and no handle: nothing it
    could replay to D once P's blocks hold another request's KV."""
    h = decode_turn(scheduler())
    p = scheduler()
    p._reqs_need_send["p2"] = 99.0
    _, _, out = prefill_turn(p, h, PROMPT1 + OUTPUT1[:-1] + [7], proof=False)
    assert out is None
    assert "p2" not in p._reqs_need_send and "p2" in p._reqs_not_processed
    _, _, out = prefill_turn(scheduler(), h, PROMPT1 + OUTPUT1[:-1] + [7])
    assert out is not None and out["do_remote_prefill"] and out["bidirkv_mac"]


def test_decode_publishes_signed_digests_of_what_it_holds():
    h = decode_turn(scheduler())
    assert h["remote_num_tokens"] == 99
    assert h["bidirkv_blocks"]["n"] == 99 // BS and h["bidirkv_blocks"]["v"] == 2
    assert h[MAC_KEY] == sign(h, KEY)
    # D's ids stay with D (its retention), which hands them over with the grant.
    assert h[COUNTS_KEY] == [7] and "remote_block_ids" not in h


def test_exact_extension_pulls_every_full_block():
    d, p = scheduler(), scheduler()
    h = decode_turn(d)
    prompt = PROMPT1 + OUTPUT1[:-1] + [OUTPUT1[-1]] + list(range(3000, 3040))
    params, count, out = prefill_turn(p, h, prompt)
    assert count == 96 and params["remote_num_tokens"] == 96
    assert read_ids(params) == [list(range(50, 56))]
    rep = out["bidirkv"]
    assert rep["reused_tokens"] == rep["offered_tokens"] == 96 and rep["verified"]
    assert rep["reason"] == "match" and rep["held_tokens"] == 99
    assert rep["recomputed_tokens"] == len(prompt) - 96
    assert out[MAC_KEY] == sign(out, KEY)  # P's own handle, for D
    counted = reuse_of(p).tally.take()
    assert counted[tally.REUSE] == {"match": 1} and counted[tally.REUSED_TOKENS] == 96
    assert counted[tally.RECOMPUTED_TOKENS] == len(prompt) - 96


def test_edited_history_pulls_only_the_blocks_before_the_edit():
    d, p = scheduler(), scheduler()
    h = decode_turn(d)
    prompt = PROMPT1 + OUTPUT1 + list(range(3000, 3040))
    prompt[75] = 7  # in block 4 (tokens 64-79)
    params, count, out = prefill_turn(p, h, prompt)
    assert count == 64 and read_ids(params) == [list(range(50, 54))]
    rep = out["bidirkv"]
    assert (rep["reused_tokens"], rep["offered_tokens"], rep["reason"]) == (64, 96, "mismatch")


def test_edit_in_block_zero_pulls_nothing_but_still_lets_d_free():
    d, p = scheduler(), scheduler()
    h = decode_turn(d)
    prompt = [1] + PROMPT1[1:] + OUTPUT1 + [5]
    params, count, out = prefill_turn(p, h, prompt)
    assert count == 0 and params["remote_num_tokens"] == 0
    # The block list stays, so vLLM notifies D, which frees the blocks.
    assert read_ids(params) == [list(range(50, 57))]
    assert out["bidirkv"]["reused_tokens"] == 0 and out["bidirkv"]["verified"]


def test_shorter_prompt_reads_the_leading_blocks_not_the_last_ones():
    d, p = scheduler(), scheduler()
    h = decode_turn(d)
    prompt = PROMPT1[:40]  # 2 full blocks + 8
    params, count, out = prefill_turn(p, h, prompt)
    assert count == 32 and read_ids(params) == [[50, 51]]
    assert out["bidirkv"]["reason"] == "prompt_shorter"


def test_other_dtype_on_prefill_reuses_nothing():
    h = decode_turn(scheduler())
    params, count, out = prefill_turn(scheduler(dtype="torch.bfloat16"), h,
                                      PROMPT1 + OUTPUT1 + [1])
    assert count == 0 and out["bidirkv"]["reason"] == "model_mismatch"


def test_local_cache_threshold_and_failed_read_are_reported():
    h = decode_turn(scheduler())
    prompt = PROMPT1 + OUTPUT1 + [1]
    _, count, out = prefill_turn(scheduler(), h, prompt, local_cached=96)
    assert count == 0 and out["bidirkv"]["reason"] == "local_cache"
    h = decode_turn(scheduler())
    _, count, out = prefill_turn(scheduler(threshold=200), h, prompt)
    assert count == 0 and out["bidirkv"]["reason"] == "below_threshold"
    h = decode_turn(scheduler())
    _, count, out = prefill_turn(scheduler(), h, prompt, fail=True)
    assert count == 96
    assert out["bidirkv"]["reused_tokens"] == 0 and out["bidirkv"]["reason"] == "load_failed"


def test_a_request_back_from_a_failed_read_recomputes_instead_of_waiting_again():
    h = decode_turn(scheduler())
    p = scheduler()
    req = request("p3", PROMPT1 + OUTPUT1 + [1], dict(h, do_remote_decode=True))
    on_new(p, req)
    assert matched(p, req, 0) == (96, True)
    req.kv_transfer_params["_remote_blocks_processed"] = True  # vLLM, after allocation
    # The read failed (or the request was preempted): vLLM asks again from scratch.
    assert matched(p, req, 0) == (0, False)


@pytest.mark.parametrize("mutate, reason", [
    (lambda h: h.update({COUNTS_KEY: [6]}), "unauthenticated"),
    (lambda h: h.update(remote_block_ids=[[1, 2, 3, 4, 5, 6, 7]]), "malformed"),
    (lambda h: h.pop(MAC_KEY), "malformed"),
    (lambda h: h.update(remote_port="x"), "malformed"),
])
def test_untrusted_handles_are_reported_and_not_read(mutate, reason):
    h = decode_turn(scheduler())
    mutate(h)
    p = scheduler()
    params, count, out = prefill_turn(p, h, PROMPT1 + OUTPUT1 + [1])
    assert count == 0 and "remote_block_ids" not in params
    rep = out["bidirkv"]
    assert (rep["reused_tokens"], rep["verified"], rep["reason"]) == (0, False, reason)
    counted = reuse_of(p).tally.take()
    assert counted[tally.DROPPED] == {reason: 1} and counted[tally.REUSE] == {reason: 1}
    assert reuse_of(p).tally.take() is None  # handed over once


def test_a_handle_is_read_at_most_once_per_prefill_engine():
    p = scheduler()
    h = decode_turn(scheduler())
    prompt = PROMPT1 + OUTPUT1 + [1]
    assert prefill_turn(p, h, prompt)[1] == 96
    _, count, out = prefill_turn(p, h, prompt)
    assert count == 0 and out["bidirkv"]["reason"] == "replayed"


def test_unsigned_digests_without_a_record_are_refused():
    d = scheduler()
    h = decode_turn(d)
    del h["bidirkv_blocks"]
    h[MAC_KEY] = sign(h, KEY)
    params, count, out = prefill_turn(scheduler(), h, PROMPT1 + OUTPUT1 + [1])
    assert count == 0 and out["bidirkv"]["reason"] == "no_digest"


def test_prompt_embeddings_are_never_reused():
    h = decode_turn(scheduler())
    adm = admit(dict(h, do_remote_decode=True), KEY, 4096)
    rep = plan(adm, 99, None, b"s", b"r", BS, True)
    assert isinstance(rep, Report) and rep.reason == "unsupported_prompt"
    assert adm.params["remote_num_tokens"] == 0


def test_a_failing_check_costs_reuse_not_the_engine(caplog):
    broken = Reuse(scheduler(), KEYS)
    broken.state = None  # the check itself raises
    req = request("p9", PROMPT1, {"do_remote_prefill": True, "remote_block_ids": [[1]]})
    broken.on_new_request(req)
    assert req.kv_transfer_params == {}
    assert "served without KV transfer" in caplog.text
