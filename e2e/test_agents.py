"""Agents as they call, on real servers (the shared stack): a session named by
`X-Session-ID` alone, and a parent's forks and sub-agent reading the prefix decode holds
for it, with the reuse-off output, while the parent keeps its handle, also when the
parent's own read-back runs at the same time as the children's reads. The client is the
`openai` SDK (installed with vLLM), sending the headers as an agent's client does."""

from __future__ import annotations

import importlib.util
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    pytest.skip("the vLLM CPU engine stack is not installed (make engine)",
                allow_module_level=True)

from bidirkv.local.model import random_text  # noqa: E402

from .vllm_stack import (  # noqa: E402
    GEN,
    MODEL,
    REQUEST_TIMEOUT,
    chat,
    metric,
    metric_reaches,
    running_router,
    turn,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(420)]
PLACED = "X-Bidirkv-Placement"
LONG_APPEND = {"policy": "thresholds", "localPrefillTokens": 64, "maxLocalPrefillTokens": 128}
# Short appends run whole on the holder; a holder busy with one leg takes no more.
POLICY = {"policy": "thresholds", "localPrefillTokens": 64, "maxLocalPrefillTokens": 2048,
          "decodeBusyRequests": 1}


@pytest.fixture(scope="module")
def stack(traced):
    return traced[0]  # the shared stack (e2e/conftest.py)


def client(url: str, tenant: str = "agent-key"):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key=tenant, timeout=REQUEST_TIMEOUT,
                         max_retries=0)


def ask(c, messages: list[dict], headers: dict[str, str]) -> tuple[str, str]:
    """One turn through the router: its text and its placement header."""
    extra = {k: v for k, v in GEN.items() if k not in ("temperature", "max_tokens")}
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=GEN["temperature"],
        max_tokens=GEN["max_tokens"], extra_body=extra, extra_headers=headers)
    return raw.parse().choices[0].message.content, raw.headers.get(PLACED, "")


def first_turn(c, headers: dict[str, str], seed: int) -> list[dict]:
    """A parent's first turn (a 300-word system message, a 40-word task); its history."""
    msgs = [{"role": "system", "content": random_text(300, seed=seed)},
            {"role": "user", "content": random_text(40, seed=seed + 1)}]
    text, _ = ask(c, msgs, headers)
    return msgs + [{"role": "assistant", "content": text}]


def reuse_off(stack, messages: list[dict]) -> str:
    """The output of the two legs with no handle: P recomputes every token."""
    return turn(stack, chat(messages), None, streamed=False)[0]


def test_a_session_id_alone_names_the_conversation(stack):
    """As vLLM's multi-turn benchmark client sends its turns: `X-Session-ID` the only id.
    A second turn whose history is not the first answer verbatim still finds the handle
    (P reads the verified prefix back), where a history-named turn would find none."""
    with running_router(stack, "router-session", placement={"policy": "alwaysDisaggregate"}
                        ) as (url, _):
        c = client(url)
        session = {"X-Session-ID": "bench-session-1"}
        user1 = {"role": "user", "content": random_text(400, seed=431)}
        text1, _ = ask(c, [user1], session)
        edited = [user1, {"role": "assistant", "content": "re-rendered " + text1},
                  {"role": "user", "content": random_text(20, seed=432)}]
        ask(c, edited, session)
        # P took the handle (whole or verified in part): the edit is past its full blocks.
        assert metric(url, 'bidirkv_router_reuse_total{outcome="hit"}') + metric(
            url, 'bidirkv_router_reuse_total{outcome="verified-partial"}') == 1
        assert metric(url, 'bidirkv_router_reuse_tokens_total{source="bidirkv"}') >= 128


def test_forks_and_a_sub_agent_read_the_parents_held_prefix_and_the_parent_keeps_it(stack):
    with running_router(stack, "router-agents", placement=POLICY, placementHeader=True
                        ) as (url, _):
        c, other_tenant = client(url), client(url, "someone-else")
        parent = {"X-Session-ID": "agent-1"}
        system = {"role": "system", "content": random_text(300, seed=441)}
        msgs = [system, {"role": "user", "content": random_text(40, seed=442)}]
        text1, _ = ask(c, msgs, parent)
        msgs += [{"role": "assistant", "content": text1},
                 {"role": "user", "content": random_text(8, seed=443)}]
        text2, placed2 = ask(c, msgs, parent)
        assert placed2 == "extend; reason=short_append"
        history = msgs + [{"role": "assistant", "content": text2}]
        p_done = metric(stack.p_url, "vllm:request_success_total")
        hits = metric(stack.d_url, "vllm:prefix_cache_hits_total")
        # Two forks, found by their history; a sub-agent, by the parent header.
        children = [
            (history + [{"role": "user", "content": random_text(8, seed=444 + i)}],
             {"X-Session-ID": f"fork-{i}"}, "fork") for i in range(2)]
        children.append(([system, {"role": "user", "content": random_text(8, seed=447)}],
                         {"X-Session-ID": "sub-0", "x-claude-code-parent-agent-id": "agent-1"},
                         "child"))
        answers = []
        for messages, headers, kind in children:
            text, placed = ask(c, messages, headers)
            assert placed.startswith("extend;") and placed.endswith(f"kind={kind}"), placed
            answers.append((messages, text))
        # The parent's next turn still has its handle: extended on its own blocks.
        msgs = history + [{"role": "user", "content": random_text(8, seed=448)}]
        text3, placed3 = ask(c, msgs, parent)
        assert placed3 == "extend; reason=short_append"
        answers.append((msgs, text3))
        # Decode served them all from the blocks it holds: P was never asked, and
        # decode's prefix cache gave at least the system prompt's blocks to each.
        assert metric(stack.p_url, "vllm:request_success_total") == p_done
        assert metric_reaches(stack.d_url, "vllm:prefix_cache_hits_total",
                              hits + 4 * 128) >= hits + 4 * 128
        for messages, text in answers:
            assert text == reuse_off(stack, messages)
        assert metric(url, 'bidirkv_router_reuse_kind_total{kind="returning"}') == 2
        assert metric(url, 'bidirkv_router_reuse_kind_total{kind="fork"}') == 2
        assert metric(url, 'bidirkv_router_reuse_kind_total{kind="child"}') == 1
        # Another tenant naming the same parent gets nothing of it.
        fork = history + [{"role": "user", "content": random_text(8, seed=449)}]
        text, placed = ask(other_tenant, fork, {"X-Session-ID": "fork-x",
                                                "X-Dynamo-Parent-Session-ID": "agent-1"})
        assert "parent=" not in placed
        assert text == reuse_off(stack, fork)


def test_a_long_fork_reads_the_parents_blocks_shared_and_the_parent_reads_them_after(stack):
    """A fork whose own part is over the cap is read back: P reads the parent's blocks
    with a shared read, which leaves them retained on decode, so the parent's own next
    turn (over the cap too) reads the same blocks back once more; both outputs are the
    reuse-off outputs."""
    with running_router(stack, "router-shared", placement=LONG_APPEND, placementHeader=True
                        ) as (url, _):
        c = client(url)
        parent = {"X-Session-ID": "agent-2"}
        history = first_turn(c, parent, seed=451)
        reused = 'bidirkv_router_reuse_tokens_total{source="bidirkv"}'
        before = metric(url, reused)
        fork = history + [{"role": "user", "content": random_text(200, seed=453)}]
        text_f, placed_f = ask(c, fork, {"X-Session-ID": "fork-long"})
        assert placed_f.startswith("read_back; reason=append_over_cap; parent="), placed_f
        assert placed_f.endswith("kind=fork")
        after_fork = metric(url, reused)
        assert after_fork - before >= 2 * 128  # P read the parent's blocks from decode
        own = history + [{"role": "user", "content": random_text(200, seed=454)}]
        text_p, placed_p = ask(c, own, parent)
        assert placed_p == "read_back; reason=append_over_cap"
        assert metric(url, reused) - after_fork >= 2 * 128  # still there to read, once
        assert metric(url, 'bidirkv_router_reuse_kind_total{kind="fork"}') == 1
        assert metric(url, 'bidirkv_router_reuse_total{outcome="hit"}') + metric(
            url, 'bidirkv_router_reuse_total{outcome="verified-partial"}') == 1
    assert text_f == reuse_off(stack, fork)
    assert text_p == reuse_off(stack, own)


def decode_reports(url: str, field: str) -> float:
    """A field of decode's residency report, as the router last heard it."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    got = re.findall(r'^bidirkv_router_decode_residency\{[^}]*field="' + field
                     + r'"[^}]*\} (\S+)$', text, re.M)
    return sum(float(v) for v in got)


def test_forks_and_the_parent_read_the_same_blocks_at_once(stack):
    """Two long forks read the parent's blocks shared while the parent's own long turn
    reads them to spend them: the parent's read is granted (decode frees the blocks
    after the children's reads, and holds nothing granted once all are answered), and
    every output is the reuse-off output."""
    with running_router(stack, "router-at-once", placement=LONG_APPEND,
                        healthCheckIntervalSeconds=0.5) as (url, _):
        c = client(url)
        parent = {"X-Session-ID": "agent-3"}
        history = first_turn(c, parent, seed=461)
        turns = [(history + [{"role": "user", "content": random_text(200, seed=463 + i)}],
                  {"X-Session-ID": f"fork-at-once-{i}"}) for i in range(2)]
        turns.append((history + [{"role": "user", "content": random_text(200, seed=466)}],
                      parent))
        time.sleep(1.5)  # three health rounds: the router's reading is after the turn
        grants = decode_reports(url, "grants")
        with ThreadPoolExecutor(len(turns)) as pool:
            texts = list(pool.map(lambda t: ask(c, *t)[0], turns))
        time.sleep(1.5)
        deadline = time.monotonic() + 30
        while decode_reports(url, "granted_blocks") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert decode_reports(url, "granted_blocks") == 0
        # The parent's own read, whether or not the children's were in flight.
        assert decode_reports(url, "grants") - grants == 1
    for (messages, _), text in zip(turns, texts, strict=True):
        assert text == reuse_off(stack, messages)
