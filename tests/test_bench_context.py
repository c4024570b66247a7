"""What the cost-by-context-length benchmark stands on: histories of a given token count
(bidirkv/bench/histories.py) and the fake engines' realistic handles (tests/fake_engine.py)."""

import json

import pytest
from fake_engine import HANDLE_KEY, SEED, FakeEngine

from bidirkv.bench.histories import CHARS_PER_TOKEN, containers, history
from bidirkv.connector.core import digests
from bidirkv.connector.core.handles import signature_ok
from bidirkv.router.request.bodycheck import container_problem
from bidirkv.wire import BLOCKS_KEY, COUNTS_KEY


def _text_chars(doc):
    n = len(json.dumps(doc.get("tools", []), ensure_ascii=False)) if "tools" in doc else 0
    for m in doc["messages"]:
        content = m["content"]
        n += len(content) if isinstance(content, str) else sum(len(p["text"]) for p in content)
        for call in m.get("tool_calls", ()):
            n += len(call["function"]["arguments"])
    return n


@pytest.mark.parametrize("tool_every", [0, 3])
def test_a_history_holds_about_the_tokens_asked_for(tool_every):
    doc = history(32_000, tool_every)
    assert doc == history(32_000, tool_every)  # seeded
    assert 0.97 <= _text_chars(doc) / (32_000 * CHARS_PER_TOKEN) <= 1.03
    assert doc["messages"][-1]["role"] == "user"
    raw, n = json.dumps(doc).encode(), containers(doc)  # as maxJsonContainers counts them
    assert container_problem(raw, n) is None and container_problem(raw, n - 1) is not None
    if tool_every:
        calls = [c["id"] for m in doc["messages"] for c in m.get("tool_calls", ())]
        answers = [m["tool_call_id"] for m in doc["messages"] if m["role"] == "tool"]
        assert calls == answers and len(calls) > 20


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_realistic_handles_are_what_the_plugin_hands_out_at_that_length(role):
    engine = FakeEngine(role)
    engine.behaviour.block_size = 16
    params = engine._params("chatcmpl-1", 1000)
    assert signature_ok(params, HANDLE_KEY)
    # Either names its blocks by count (1000 / 16, rounded up); the reader asks for ids.
    assert params[COUNTS_KEY] == [63] and "remote_block_ids" not in params
    if role == "decode":
        held = digests.parse_held(params[BLOCKS_KEY], 63)
        assert held is not None and held.blocks == 62  # full blocks only
        points = digests.checkpoints(62)
        assert held.digests == tuple(digests.chain_at(SEED, range(1000), 16, points))
    else:
        assert BLOCKS_KEY not in params
