"""A router with the in-process store, restarted, keeps reuse: real vLLM CPU servers.

The router leaves a note beside each kept handle on decode; a new router process of the
same resource (the same handle key: the same owner) recalls them, and the next turn of a
conversation decode still holds reads it back, with the reuse-off output (float32,
greedy).
"""

from __future__ import annotations

import importlib.util
import json
import time
import urllib.request

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    pytest.skip("the vLLM CPU engine stack is not installed (make engine)",
                allow_module_level=True)

from bidirkv.local.model import random_text  # noqa: E402
from bidirkv.proof import residency_headers, residency_target  # noqa: E402
from bidirkv.router.pool.notes import stable_owner  # noqa: E402
from bidirkv.wire import RESIDENCY_PATH, RESIDENCY_VERSION_FIELD, VERSION  # noqa: E402

from .vllm_stack import (  # noqa: E402
    KEY,
    chat,
    metric,
    metric_reaches,
    post,
    running_router,
    running_stack,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


def handles(url: str, n: int, timeout: float = 30.0) -> float:
    """The router's stored handles once they reach `n` (or the last count)."""
    deadline = time.monotonic() + timeout
    while (got := metric(url, "bidirkv_router_handles")) < n and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


def as_router(d_url: str, **fields) -> dict:
    """Decode's residency answer to a call as the router's owner (which only renews its
    lease, and reads what a recall from `recall` would)."""
    raw = json.dumps({"owner": stable_owner(KEY.encode()), "leaseSeconds": 30,
                      RESIDENCY_VERSION_FIELD: VERSION, **fields}).encode()
    req = urllib.request.Request(d_url + RESIDENCY_PATH, raw, {
        "Content-Type": "application/json",
        **residency_headers(KEY.encode(), residency_target(d_url), RESIDENCY_PATH, raw)})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def notes_held(d_url: str, n: int, timeout: float = 30.0) -> int:
    """Decode's count of the router's notes once it reaches `n`."""
    deadline = time.monotonic() + timeout
    while True:
        got = as_router(d_url).get("notesHeld", 0)
        if got >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_a_restarted_router_reuses_what_decode_holds_with_the_reuse_off_output(tmp_path):
    """Three conversations (the benchmark, benchmarks/lifecycle_bench.py, runs eight), the
    router stopped as a rollout stops it and started again: every returning turn reads its
    history back, and its output is the reuse-off one."""
    fast = {"healthCheckIntervalSeconds": 0.5}
    convs = [f"c{i}" for i in range(3)]
    with running_stack(tmp_path) as s:
        def turn(url, cid, msgs):
            status, out = post(url + "/v1/chat/completions",
                               {**chat(msgs), "conversation_id": cid})
            assert status == 200, out
            return out["choices"][0]["message"]["content"]

        def reference(msgs):  # reuse off: prefill serves the whole request, nothing read
            status, out = post(s.p_url + "/v1/chat/completions", chat(msgs))
            assert status == 200, out
            return out["choices"][0]["message"]["content"]

        history = {c: [{"role": "user", "content": random_text(300, seed=70 + i)}]
                   for i, c in enumerate(convs)}
        with running_router(s, "router-a", **fast) as (url, _):
            for c, msgs in history.items():
                msgs.append({"role": "assistant", "content": turn(url, c, msgs)})
            assert handles(url, len(convs)) == len(convs)
            assert notes_held(s.d_url, len(convs)) == len(convs)
        # A note does not grow with the history: the digest record stays with decode,
        # which gives it back beside each note (the block ids never leave decode).
        page = as_router(s.d_url, recall=0)
        assert len(page["notes"]) == len(convs)
        for rid, note in page["notes"].items():
            assert len(note) <= 1024 and "remote_block_ids" not in note, note
            bulk = page["recallHandles"][rid]
            assert set(bulk) == {"bidirkv_blocks"} and bulk["bidirkv_blocks"]["n"] >= 2
        refs = {}
        for i, (c, msgs) in enumerate(history.items()):
            msgs.append({"role": "user", "content": random_text(40, seed=90 + i)})
            refs[c] = reference(msgs)
        with running_router(s, "router-b", **fast) as (url, _):
            assert handles(url, len(convs)) == len(convs), "the new router recalled too little"
            for c, msgs in history.items():
                reused = metric(s.p_url, "vllm:bidirkv_reused_tokens_total")
                assert turn(url, c, msgs) == refs[c], c
                assert metric_reaches(s.p_url, "vllm:bidirkv_reused_tokens_total",
                                      reused + 1) > reused, f"{c} recomputed after the restart"
