"""Decode's retained KV yields, and reuse stays safe: real vLLM CPU servers.

Decode has only DECODE_BLOCKS blocks of 128 tokens, so a few finished conversations fill
it. Every test checks both invariants of bidirkv/connector/core/residency.py: prefill never reads
blocks decode released (it recomputes, and the output is the reuse-off output), and no
request waits on blocks that are only kept for reuse.
"""

from __future__ import annotations

import importlib.util
import json
import time
import urllib.error
import urllib.request

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    pytest.skip("the vLLM CPU engine stack is not installed (make engine)",
                allow_module_level=True)

from bidirkv.connector.core import lease  # noqa: E402
from bidirkv.local.model import build_model, random_text  # noqa: E402
from bidirkv.proof import residency_headers, residency_target  # noqa: E402
from bidirkv.wire import (  # noqa: E402
    COUNTS_KEY,
    RESIDENCY_PATH,
    RESIDENCY_VERSION_FIELD,
    SHARED_BLOCKS_KEY,
    VERSION,
    VERSION_KEY,
)

from .vllm_stack import (  # noqa: E402
    BLOCK,
    KEY,
    chat,
    decode_leg,
    metric,
    metric_reaches,
    post,
    prefill_leg,
    proof,
    running_router,
    running_stack,
    spec_for,
    stream,
    stream_text,
    turn,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(420)]

DECODE_BLOCKS = 24
MAX_LEN = 2048


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("residency-e2e")
    doc = spec_for(build_model(root / "model", dtype="float32"), max_model_len=MAX_LEN)
    # No watermark on decode: these tests fill it to show the waiting-request path.
    doc["kvTransfer"]["retentionWatermark"] = 1.0
    with running_stack(root, doc, {"decode": ["--num-gpu-blocks-override",
                                              str(DECODE_BLOCKS)]}) as s:
        yield s


def signed_post(url: str, body: dict, key: str = KEY) -> tuple[int, dict]:
    """POST to the residency route as the router does: signed with the handle key, for
    the engine at `url`."""
    raw = json.dumps(body).encode()
    req = urllib.request.Request(url, raw, {
        "Content-Type": "application/json",
        **residency_headers(key.encode(), residency_target(url), RESIDENCY_PATH, raw)})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def residency(s, **body) -> dict:
    status, out = signed_post(s.d_url + RESIDENCY_PATH,
                              {**body, RESIDENCY_VERSION_FIELD: VERSION})
    assert status == 200, out
    return out


def settled(s, what, timeout: float = 10.0) -> dict:
    """Poll decode's residency until `what(stats)` holds (a step or two after a release)."""
    deadline = time.monotonic() + timeout
    while True:
        out = residency(s)
        if what(out) or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def first_turn(s, seed: int, words: int = 500, owner: str | None = None):
    user = {"role": "user", "content": random_text(words, seed=seed)}
    body = chat([user])
    p_out = prefill_leg(s, body)
    if owner is not None:
        p_out = dict(p_out, kv_transfer_params=dict(p_out["kv_transfer_params"],
                                                    bidirkv_owner=owner))
    text, handle, _ = decode_leg(s, body, p_out, streamed=False)
    return user, text, handle


def next_body(user: dict, text: str, seed: int) -> dict:
    return chat([user, {"role": "assistant", "content": text},
                 {"role": "user", "content": random_text(60, seed=seed)}])


def reference(s, body: dict) -> str:
    return turn(s, body, None, streamed=False)[0]


def test_residency_route_reports_capacity(stack):
    out = residency(stack)
    assert out["enabled"] and out["numBlocks"] == DECODE_BLOCKS
    status, err = signed_post(stack.d_url + RESIDENCY_PATH,
                              {"release": "all", RESIDENCY_VERSION_FIELD: VERSION})
    assert status == 400 and "release must be a list" in err["error"]["message"]
    # A caller of another wire version (or none) is refused as a whole, and told which.
    status, err = signed_post(stack.d_url + RESIDENCY_PATH, {"release": []})
    assert status == 409 and err["error"]["type"] == "wire_version", err
    assert err["error"]["version"] == VERSION
    # Only holders of the handle key may call: unsigned, or signed with another key.
    for status, err in (post(stack.d_url + RESIDENCY_PATH, {RESIDENCY_VERSION_FIELD: VERSION}),
                        signed_post(stack.d_url + RESIDENCY_PATH,
                                    {RESIDENCY_VERSION_FIELD: VERSION}, key="not the key")):
        assert status == 401 and err["error"]["type"] == "unauthorized", err


def test_release_on_the_routers_word_then_prefill_recomputes(stack):
    user, text, handle = first_turn(stack, seed=1)
    rid = handle["remote_request_id"]
    held = -(-handle["remote_num_tokens"] // BLOCK)
    before = residency(stack)
    assert before["retainedBlocks"] >= held
    out = residency(stack, release=[rid])
    assert out["releasedBlocks"] == held
    after = settled(stack, lambda o: o["retainedBlocks"] <= before["retainedBlocks"] - held)
    assert after["retainedBlocks"] <= before["retainedBlocks"] - held, after
    # The router would not send this handle again; a replay of it must not read.
    body = next_body(user, text, seed=2)
    pulled = metric(stack.p_url, "vllm:nixl_bytes_transferred_sum")
    p_out = prefill_leg(stack, body, handle)
    assert metric(stack.p_url, "vllm:nixl_bytes_transferred_sum") == pulled
    rep = p_out["kv_transfer_params"]["bidirkv"]
    assert rep["reused_tokens"] == 0 and rep["reason"] == "load_failed", rep
    text2, _, _ = decode_leg(stack, body, p_out, streamed=False)
    assert text2 == reference(stack, body)


def test_a_granted_read_cannot_be_released(stack):
    """The race of a read and a release, decided under decode's lock in both orders."""
    user, text, handle = first_turn(stack, seed=3)
    rid = handle["remote_request_id"]
    answered = metric(stack.d_url, "vllm:bidirkv_grants_total")
    ok, why, ids = lease.confirm("127.0.0.1", handle["remote_port"], rid)
    # The grant brings the retained blocks' ids, as many as the handle counts.
    assert ok and [len(g) for g in ids] == handle[COUNTS_KEY], (why, ids)
    out = residency(stack, release=[rid])
    assert out["releasedBlocks"] == 0 and out["grantedBlocks"] > 0
    # Every worker of a reader (one per TP rank) asks for the same read: granted again,
    # the same ids, until the read frees the blocks.
    assert lease.confirm("127.0.0.1", handle["remote_port"], rid) == (True, "granted", ids)
    # Released first: the grant is refused.
    _, _, handle2 = first_turn(stack, seed=4)
    assert residency(stack, release=[handle2["remote_request_id"]])["releasedBlocks"] > 0
    ok, why, ids = lease.confirm("127.0.0.1", handle2["remote_port"],
                                 handle2["remote_request_id"])
    assert not ok and why.startswith(("released", "unknown")) and ids == [], why
    # Granted once, refused once: in D's /metrics once D's engine steps again.
    first_turn(stack, seed=5)
    assert metric_reaches(stack.d_url, "vllm:bidirkv_grants_total", answered + 2) >= answered + 2


def test_a_waiting_request_takes_retained_blocks(stack):
    # Retain until decode is nearly full (owner-less: only pressure can free them early).
    for seed in range(10, 20):
        first_turn(stack, seed=seed, words=600)
        if residency(stack)["freeBlocks"] < 8:
            break
    full = residency(stack)
    assert full["freeBlocks"] < 8, full
    released = metric(stack.d_url, "vllm:bidirkv_released_requests_total")
    # A request needing more than is free: served now, not after the 120 s TTL.
    body = chat([{"role": "user", "content": random_text(1400, seed=30)}], max_tokens=4)
    t = time.monotonic()
    status, out = post(stack.d_url + "/v1/chat/completions", body, timeout=60)
    took = time.monotonic() - t
    assert status == 200, out
    assert took < 20, took
    after = residency(stack)
    assert after["released"].get("pressure", 0) > full["released"].get("pressure", 0), after
    # The connector's counter in D's /metrics (vLLM's stats path) saw them too.
    grew = after["released"]["pressure"] - full["released"].get("pressure", 0)
    assert metric_reaches(stack.d_url, "vllm:bidirkv_released_requests_total",
                          released + grew) >= released + grew


def test_a_forks_handle_says_decode_kept_its_parents_blocks_already(stack):
    """A fork computed after its parent's turn takes the parent's retained blocks from
    decode's prefix cache: decode pins them once, and the fork's handle says how many of
    its blocks it had kept already (SHARED_BLOCKS_KEY), so the router counts them once."""
    user, text, parent = first_turn(stack, seed=71, words=400)
    parent_blocks = sum(parent[COUNTS_KEY])
    assert parent[SHARED_BLOCKS_KEY] == 0 and parent_blocks >= 2
    body = next_body(user, text, seed=72)
    _, fork, _ = decode_leg(stack, body, prefill_leg(stack, body), streamed=False)
    # Every full block of the parent's (its last may be partial: the fork writes its own).
    assert parent_blocks - 1 <= fork[SHARED_BLOCKS_KEY] <= parent_blocks
    assert sum(fork[COUNTS_KEY]) > fork[SHARED_BLOCKS_KEY]
    residency(stack, release=[parent["remote_request_id"], fork["remote_request_id"]])


def test_untracked_request_is_freed_on_release(stack):
    """Both flags false (no P handle): vLLM retained such requests and never freed them."""
    body = chat([{"role": "user", "content": random_text(300, seed=40)}], max_tokens=4)
    body["kv_transfer_params"] = {"do_remote_prefill": False, "do_remote_decode": False,
                                  "bidirkv_proof": proof(), VERSION_KEY: VERSION}
    status, out = post(stack.d_url + "/v1/chat/completions", body)
    assert status == 200, out
    handle = out["kv_transfer_params"]
    before = residency(stack)
    assert residency(stack, release=[handle["remote_request_id"]])["releasedBlocks"] > 0
    after = settled(stack, lambda o: o["retainedRequests"] < before["retainedRequests"])
    assert after["retainedRequests"] < before["retainedRequests"], after


def test_a_direct_caller_gets_no_handle_and_decode_keeps_nothing(stack):
    """Without the router's proof: the answer, no handle, no retained blocks."""
    before = residency(stack)["retainedRequests"]
    body = chat([{"role": "user", "content": random_text(300, seed=45)}], max_tokens=4)
    for kv in ({"do_remote_prefill": False, "do_remote_decode": False},
               {"do_remote_prefill": False, "do_remote_decode": False,
                "bidirkv_proof": "0.1.2"}):
        status, out = post(stack.d_url + "/v1/chat/completions",
                           dict(body, kv_transfer_params=kv))
        assert status == 200 and out["choices"][0]["message"]["content"]
        assert out.get("kv_transfer_params") is None
        assert residency(stack)["retainedRequests"] == before


def test_an_owner_that_stops_renewing_loses_its_blocks(stack):
    _, _, handle = first_turn(stack, seed=50, owner="router-a")
    assert handle is not None
    # The lease starts once the blocks are held: a lease given before a slow turn could
    # lapse (and the owner be forgotten) before decode retained anything for it.
    before = residency(stack, owner="router-a", leaseSeconds=1)["released"].get(
        "owner_gone", 0)
    time.sleep(1.5)
    out = settled(stack, lambda o: o["released"].get("owner_gone", 0) > before)
    assert out["released"].get("owner_gone", 0) > before, out


def delete(url: str) -> int:
    req = urllib.request.Request(url, method="DELETE")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_router_end_of_conversation_and_router_restart(stack):
    # Counters only ever grow, so blocks other tests left (which decode may release under
    # pressure meanwhile) cannot confuse what is counted here.
    fast = {"healthCheckIntervalSeconds": 0.5, "ownerLeaseSeconds": 2}
    user = {"role": "user", "content": random_text(400, seed=60)}

    def count(out, what, cause):
        return out[what].get(cause, 0)

    start = residency(stack)
    with running_router(stack, "router-a", **fast) as (url, _):
        for cid in ("c1", "c2"):
            events = stream(url + "/v1/chat/completions",
                            {**chat([user]), "conversation_id": cid, "stream": True})
            assert stream_text(events)
        assert delete(url + "/v1/conversations/c1") == 204
        out = settled(stack, lambda o: count(o, "freed", "released")
                      > count(start, "freed", "released"))
        # One release on the router's word, and its blocks are free.
        assert count(out, "released", "router") == count(start, "released", "router") + 1
        assert count(out, "freed", "released") >= count(start, "freed", "released") + 1
        assert delete(url + "/v1/conversations/c1") == 404
    # Router A is gone with c2's handle and no router of the resource renews its owner
    # (a restarted one is the same owner, e2e/test_router_restart.py): decode frees c2
    # once the lease lapses.
    out = settled(stack, lambda o: count(o, "released", "owner_gone")
                  > count(start, "released", "owner_gone"), 15)
    assert count(out, "released", "owner_gone") == \
        count(start, "released", "owner_gone") + 1, out
    with running_router(stack, "router-b", **fast) as (url, _):
        events = stream(url + "/v1/chat/completions",
                        {**chat([user]), "conversation_id": "c2", "stream": True})
        assert stream_text(events)


def test_engines_log_the_connector_and_the_residency_patches(stack):
    """The retention hooks and the grants are bidir-kv's connector's (its scheduler on
    D, its worker on P); the step and the route are global patches."""
    for proc in (stack.p, stack.d):
        log = proc.log_path.read_text(errors="replace")
        for name in ("connector NixlConnector (scheduler side", "connector NixlConnector "
                     "(worker side", "yield-retained-kv", "residency-utility"):
            assert name in log, (proc.name, name)
