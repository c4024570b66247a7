"""Placement by cost: the decision function against tables of inputs, and the cost model."""

from __future__ import annotations

import asyncio
import random
import statistics

import pytest

from bidirkv.router.config import Placement
from bidirkv.router.pool.placement import (
    ALWAYS_DISAGGREGATE,
    CHARS_PER_TOKEN_MAX,
    CHARS_PER_TOKEN_MIN,
    CHARS_SAMPLES,
    COST,
    EXTEND,
    MEDIA_PART_CHARS,
    MOVE,
    ON_DECODE,
    PREFILL,
    READ_BACK,
    REASONS,
    THRESHOLDS,
    CostModel,
    Costs,
    Inputs,
    Line,
    message_chars,
    new_tokens,
    place,
    prompt_chars,
)

CP = Placement(policy=COST)
COSTS = Costs(prefill_ms=0.5, read_ms=0.05, hop_ms=20.0)


def inp(held=4000, new=200, p_busy=0, d_busy=0, other=None):
    return Inputs(held_tokens=held, new_tokens=new, prefill_inflight=p_busy,
                  holder_inflight=d_busy, other_inflight=other)


@pytest.mark.parametrize("inputs, policy, want", [
    # No handle: the turn has nothing on decode to extend.
    (inp(held=None, other=None), CP, (PREFILL, "no_handle")),  # no decode replica to take it
    (inp(held=None, new=10, other=0), Placement(policy=THRESHOLDS), (PREFILL, "no_handle")),
    (inp(held=None, new=10, other=0), Placement(policy=ALWAYS_DISAGGREGATE),
     (PREFILL, "no_handle")),
    # cost, idle: 512 tokens on D (256 ms) beat 20 ms + 2.6 ms of pull + 256 ms on P.
    (inp(held=None, new=512, other=0), CP, (ON_DECODE, "cheaper_on_decode")),
    # D decoding one (512 ahead) against an idle P: the two legs.
    (inp(held=None, new=512, other=1), CP, (PREFILL, "cheaper_disaggregated")),
    # Both with one ahead: the hop tips it to D again (the servers share the prompts).
    (inp(held=None, new=512, p_busy=1, other=1), CP, (ON_DECODE, "cheaper_on_decode")),
    (inp(held=None, new=1025, other=0), CP, (PREFILL, "prompt_over_cap")),
    (inp(held=None, new=10, other=4), CP, (PREFILL, "decode_busy")),
    # No prompt's token count seen yet: nothing can be sized against the cap.
    (Inputs(None, 10, 0, 0, other_inflight=0, sized=False), CP, (PREFILL, "learning")),
    (Inputs(4000, 10, 0, 0, sized=False), CP, (READ_BACK, "learning")),
    # Today's behaviour on request.
    (inp(new=10), Placement(policy=ALWAYS_DISAGGREGATE), (READ_BACK, "policy")),
    # The cap and a busy holder win over any policy that could extend.
    (inp(new=1025), CP, (READ_BACK, "append_over_cap")),
    (inp(new=1025), Placement(policy=THRESHOLDS), (READ_BACK, "append_over_cap")),
    (inp(new=10, d_busy=4), CP, (READ_BACK, "decode_busy")),
    # A busy holder and a less busy replica: prefill reads the blocks, the other decodes.
    (inp(new=10, d_busy=4, other=1), CP, (MOVE, "decode_busy")),
    (inp(new=10, d_busy=4, other=4), CP, (READ_BACK, "decode_busy")),
    (inp(new=700, p_busy=2, d_busy=5, other=0), Placement(policy=THRESHOLDS),
     (MOVE, "decode_busy")),
    (inp(new=10, d_busy=3), CP, (EXTEND, "cheaper_on_decode")),
    # cost: 200 new tokens on D (100 ms) against 20 ms + 4000 read (200 ms) + 100 ms.
    (inp(new=200), CP, (EXTEND, "cheaper_on_decode")),
    # A short history read back is cheap: 20 + 3.5 + 5 + 300 ms against 600 ms on D.
    (inp(held=100, new=600, d_busy=1), CP, (READ_BACK, "cheaper_disaggregated")),
    # A queue on prefill makes the two-leg path dearer.
    (inp(held=100, new=600, p_busy=2, d_busy=1), CP, (EXTEND, "cheaper_on_decode")),
    # thresholds: the llm-d / Dynamo style knobs.
    (inp(new=256), Placement(policy=THRESHOLDS), (EXTEND, "short_append")),
    (inp(new=257), Placement(policy=THRESHOLDS), (READ_BACK, "long_append")),
    (inp(new=700, p_busy=2), Placement(policy=THRESHOLDS), (EXTEND, "prefill_busy")),
    (inp(new=700, p_busy=2, d_busy=5), Placement(policy=THRESHOLDS), (READ_BACK, "decode_busy")),
    # An explicit id, or a history shorter than what D holds: the append is unknown.
    (Inputs(4000, 10, 0, 0, extends_held=False), CP, (READ_BACK, "prefix_unknown")),
    (Inputs(4000, 10, 0, 0, extends_held=False), Placement(policy=THRESHOLDS),
     (READ_BACK, "prefix_unknown")),
])
def test_decisions(inputs, policy, want):
    d = place(inputs, policy, COSTS)
    assert (d.path, d.reason) == want
    assert d.reason in REASONS


def test_the_cap_is_configurable():
    wide = Placement(policy=COST, max_local_prefill_tokens=4096)
    assert place(inp(new=2000), wide, COSTS).path == EXTEND
    never = Placement(policy=COST, max_local_prefill_tokens=0, local_prefill_tokens=0)
    assert place(inp(new=10), never, COSTS).reason == "append_over_cap"
    assert place(inp(new=0), never, COSTS).reason == "append_over_cap"  # 0 means never


def test_the_default_is_cost():
    assert Placement().policy == COST
    assert place(inp(new=10), Placement(), COSTS).path == EXTEND


def test_the_second_hop_grows_with_the_tokens_decode_pulls():
    c = Costs(prefill_ms=0.5, read_ms=0.05, hop_ms=20.0, pull_ms=0.1)
    assert c.hop(1000) == 120.0
    # 300 new tokens on a 20k history: 150 ms on D against 20 + 2030 ms of pull + 1000 ms
    # of read + 150 ms; with a free pull, the read back would still cost more.
    assert place(inp(held=20_000, new=300), CP, c).path == EXTEND
    # A dear pull makes even an idle prefill's path dearer than D's queue of two.
    cheap = Costs(prefill_ms=0.5, read_ms=0.0, hop_ms=0.0, pull_ms=0.0)
    assert place(inp(held=1000, new=300, d_busy=2), CP, cheap).path == READ_BACK
    assert place(inp(held=1000, new=300, d_busy=2), CP,
                 Costs(**{**cheap.__dict__, "pull_ms": 0.5})).path == EXTEND


def test_a_line_is_learned_online_and_never_goes_negative():
    line = Line(fixed=20.0, per_x=0.005)
    line.add(0, 8.0)  # the first sample replaces the default fixed part
    assert (line.fixed, line.per_x) == (8.0, 0.005)
    for _ in range(3):  # no spread in x yet: only the fixed part is learned
        line.add(100, 9.0)
    assert line.per_x == 0.005
    for i in range(200):
        x = (i % 10) * 1000
        line.add(x, 5.0 + 0.002 * x)
    assert line.fixed == pytest.approx(5.0, rel=1e-6)
    assert line.per_x == pytest.approx(0.002, rel=1e-6)
    for i in range(200):  # costs that fall with size (noise): a flat line at their mean
        x = (i % 10) * 1000
        line.add(x, 50.0 - 0.001 * x)
    assert line.per_x == 0.0 and line.fixed == pytest.approx(45.5, rel=0.05)
    for i in range(200):  # a negative intercept: the line through the origin instead
        x = 1000 + (i % 10) * 1000
        line.add(x, -10.0 + 0.01 * x)
    assert line.fixed == 0.0 and line.per_x > 0


def test_new_tokens_from_the_prompt_size():
    assert new_tokens(4400, 1000, 4.0) == 100
    assert new_tokens(1000, 1000, 4.0) == 0  # never negative (an edited, shorter history)
    # With the characters of what D holds, only the append is estimated: a ratio off by
    # 10% is off by 10% of the append, not of the whole history.
    assert new_tokens(80_400, 20_000, 4.4, held_chars=80_000) == 91
    assert new_tokens(80_400, 20_000, 4.4) == 0


def test_characters_per_token_are_the_median_of_the_last_samples_within_the_band():
    rnd = random.Random(7)
    m, seen = CostModel(), []
    for i in range(3 * CHARS_SAMPLES):
        chars, tokens = rnd.randint(100, 9000), rnd.randint(100, 1500)
        if i % 17 == 0:  # repeats: one of them leaves the window, the other stays
            chars, tokens = 4000, 1000
        m.observe_prompt(chars, tokens)
        seen.append(chars / tokens)
        window = seen[-CHARS_SAMPLES:]
        assert m.chars_per_token == min(float(CHARS_PER_TOKEN_MAX), max(
            CHARS_PER_TOKEN_MIN, statistics.median(window))), i


def test_the_cost_model_learns_from_the_legs():
    m = CostModel(Costs(prefill_ms=1.0, read_ms=0.1, hop_ms=20.0))
    m.observe_prompt(prompt_chars=5600, prompt_tokens=1000)
    assert m.chars_per_token == 5.6  # the first real ratio replaces the default
    m.observe_prefill(ms=300.0, computed=1000)
    # The first measurement replaces the default; decode prefills as fast as prefill
    # (the same engine).
    assert m.costs.prefill_ms == 0.3
    for _ in range(40):
        m.observe_prefill(ms=100.0, computed=1000)  # 0.1 ms a token
        m.observe_hop(5.0, tokens=1000)
        m.observe_prompt(prompt_chars=3000, prompt_tokens=1000)
    c = m.costs
    assert c.prefill_ms == pytest.approx(0.1, rel=0.01)
    assert c.hop(1000) == pytest.approx(5.0, rel=0.01)  # one size: only the sum is known
    for _ in range(40):  # extends on long histories: dearer a token, on both engines alike
        m.observe_extend(ms=60.0, computed=200)
    assert m.costs.prefill_ms == pytest.approx(0.3, rel=0.01)
    # So a fresh prompt on an idle decode server still beats prefill plus the second hop.
    fresh = Inputs(held_tokens=None, new_tokens=512, prefill_inflight=0, holder_inflight=0,
                   other_inflight=0)
    assert place(fresh, CP, m.costs).path == ON_DECODE
    for _ in range(40):
        m.observe_prefill(ms=100.0, computed=1000)
    assert m.chars_per_token == pytest.approx(3.0, rel=0.01)
    for _ in range(40):  # a read leg: what the prefilled part does not explain
        m.observe_prefill(ms=30.0, computed=100, read=1000)
    assert m.costs.read_ms == pytest.approx(0.02, rel=0.01)
    m.observe_prefill(ms=5.0, computed=0)  # nothing to learn from
    m.observe_prompt(0, 0)
    assert m.costs.read_ms == pytest.approx(0.02, rel=0.01)
    # A few tokens say more about a leg's fixed cost than its cost per token.
    m.observe_prefill(ms=30.0, computed=3)
    m.observe_extend(ms=30.0, computed=3)
    assert m.costs.prefill_ms == pytest.approx(0.1, rel=0.01)


# -- over HTTP, against fake engines ------------------------------------------------------

from fake_engine import Cluster  # noqa: E402

U1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def placement(cluster_config=None, **over):
    return {"placement": {"policy": THRESHOLDS, **over}, **(cluster_config or {})}


def released(engine):
    return [rid for call in engine.residency_calls for rid in call.get("release") or ()]


async def busy_with(engine, request):
    """`request` (a coroutine) streaming slowly on `engine`, once it has reached it: its
    task, still streaming, so the router counts a leg in flight there."""
    seen = len(engine.generations())
    engine.behaviour.chunk_delay = 0.3
    task = asyncio.create_task(request)
    for _ in range(100):
        if len(engine.generations()) > seen:
            break
        await asyncio.sleep(0.01)
    engine.behaviour.chunk_delay = 0.0  # the next request's chunks come at once
    return task


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_short_append_is_extended_on_the_decode_replica_holding_it(stream):
    async with Cluster(config=placement(), handle_key=b"k" * 32) as c:
        r1 = await c.chat(U1, stream, headers={"X-Request-Id": "t1"})
        assert r1["headers"]["X-Bidirkv-Placement"] == "prefill; reason=no_handle"
        turn2 = U1 + [r1["message"], {"role": "user", "content": "and then?"}]
        r2 = await c.chat(turn2, stream, headers={"X-Request-Id": "t2"})
        assert r2["status"] == 200 and r2["text"] == r1["text"]
        assert r2["headers"]["X-Bidirkv-Placement"] == "extend; reason=short_append"
        # P saw only turn 1; D took turn 2 whole, with the router's proof and no P params.
        assert len(c.p[0].generations()) == 1
        d2 = c.d[0].generations()[1]
        kv = d2.kv
        assert kv["do_remote_prefill"] is False and kv["do_remote_decode"] is False
        assert "bidirkv_proof" in kv and "remote_block_ids" not in kv
        # Turn 2's handle replaced turn 1's, whose blocks D frees now.
        t1 = c.d[0].generations()[0]
        for _ in range(50):
            if released(c.d[0]):
                break
            await asyncio.sleep(0.02)
        assert released(c.d[0]) == [t1.headers["X-Request-Id"]]
        # Turn 3 extends on turn 2's handle.
        turn3 = turn2 + [r2["message"], {"role": "user", "content": "more"}]
        r3 = await c.chat(turn3, stream)
        assert r3["headers"]["X-Bidirkv-Placement"] == "extend; reason=short_append"
        assert len(c.p[0].generations()) == 1
        text = await c.metrics()
        assert ('bidirkv_router_placements_total{decision="extend",reason="short_append"} '
                '2.0') in text
        assert 'bidirkv_router_reuse_total{outcome="extended"} 2.0' in text


@pytest.mark.timeout(30)
async def test_an_explicit_id_extends_only_a_prompt_that_extends_the_last_one():
    """With an explicit id the router keeps a keyed hash of the prompt's messages: the
    next turn is extended only when its first messages are those (a client that edited
    or compacted its history gets the read back of the verified prefix instead)."""
    async with Cluster(config=placement()) as c:
        r1 = await c.chat(U1, conversation_id="a")
        turn2 = U1 + [r1["message"], {"role": "user", "content": "ok"}]
        r2 = await c.chat(turn2, conversation_id="a")
        assert r2["headers"]["X-Bidirkv-Placement"] == "extend; reason=short_append"
        # Turn 2's key was hashed in the pass that showed it extends turn 1's.
        turn3 = turn2 + [r2["message"], {"role": "user", "content": "more"}]
        r3 = await c.chat(turn3, conversation_id="a")
        assert r3["headers"]["X-Bidirkv-Placement"] == "extend; reason=short_append"
        edited = [{"role": "system", "content": "be verbose"}, *turn3[1:], r3["message"],
                  {"role": "user", "content": "again"}]
        r4 = await c.chat(edited, conversation_id="a")
        assert r4["headers"]["X-Bidirkv-Placement"] == "read_back; reason=prefix_unknown"
        assert c.p[0].generations()[-1].has_handle


@pytest.mark.timeout(30)
async def test_always_disaggregate_decides_nothing():
    async with Cluster(config={"placement": {"policy": ALWAYS_DISAGGREGATE}}) as c:
        r1 = await c.chat(U1)
        r2 = await c.chat(U1 + [r1["message"], {"role": "user", "content": "ok"}])
        assert "X-Bidirkv-Placement" not in r2["headers"]
        assert c.p[0].generations()[-1].has_handle
        assert "bidirkv_router_placements_total{" not in await c.metrics()


@pytest.mark.timeout(30)
async def test_a_long_append_takes_the_read_back():
    async with Cluster(config=placement(localPrefillTokens=4, maxLocalPrefillTokens=8)) as c:
        r1 = await c.chat(U1)
        long = {"role": "user", "content": "tell me " * 40}
        r2 = await c.chat(U1 + [r1["message"], long])
        assert r2["headers"]["X-Bidirkv-Placement"] == "read_back; reason=append_over_cap"
        p2 = c.p[0].generations()[1]
        assert p2.has_handle  # P reads what D holds


def test_the_prompt_counts_every_part_that_reaches_it():
    """Images, tools and tool-call arguments reach the prompt: none counts as nothing."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert prompt_chars({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is this"}, image]}]}) \
        == len("what is this") + MEDIA_PART_CHARS
    args = '{"path": "/etc/hosts", "mode": "r"}'
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read", "arguments": args}}]}
    assert message_chars(call) == len("read") + len(args)
    tools = [{"type": "function", "function": {"name": "read", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    assert prompt_chars(body) > 2 + 60
    # Reasoning does not reach the next prompt (clients and templates drop it).
    assert message_chars({"role": "assistant", "content": "ok",
                          "reasoning_content": "hmm " * 1000}) == 2
    # Token ids count at the densest ratio the router assumes.
    assert prompt_chars({"prompt": [1, 2, 3]}) == 3 * CHARS_PER_TOKEN_MAX
    # A whole prompt is its messages' sum, text with tool calls included.
    spoken = {**call, "content": "let me look"}
    mixed = [{"role": "user", "content": "hi"}, call, spoken, "junk",
             {"role": "user", "content": [{"type": "text", "text": "what is this"}, image]}]
    assert prompt_chars({"messages": mixed}) == sum(message_chars(m) for m in mixed) == (
        2 + 2 * (len("read") + len(args)) + len("let me look") + len("what is this")
        + MEDIA_PART_CHARS)


def test_a_few_skewed_prompts_do_not_move_the_ratio_and_none_leave_the_band():
    m = CostModel()
    for _ in range(20):
        m.observe_prompt(4000, 1000)
    for _ in range(5):  # one tenant's odd prompts (an EWMA went from 4.0 to 21.5)
        m.observe_prompt(100_000, 1000)
    assert m.chars_per_token == 4.0
    for _ in range(100):
        m.observe_prompt(100_000, 1000)
    assert m.chars_per_token == CHARS_PER_TOKEN_MAX
    for _ in range(100):
        m.observe_prompt(100, 1000)
    assert m.chars_per_token == CHARS_PER_TOKEN_MIN
    # So a 4,000-token append of English text (~4 characters a token) is never estimated
    # under 2/3 of its tokens: over a 1,024 cap it stays over.
    assert new_tokens(16_000, 0, CHARS_PER_TOKEN_MAX) > 1024


@pytest.mark.timeout(30)
async def test_an_appended_image_is_not_extended_as_if_it_were_nothing():
    async with Cluster(config=placement(localPrefillTokens=64, maxLocalPrefillTokens=64)) as c:
        r1 = await c.chat(U1)
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        r2 = await c.chat(U1 + [r1["message"], {"role": "user", "content": [image]}])
        assert r2["headers"]["X-Bidirkv-Placement"] == "read_back; reason=append_over_cap"


@pytest.mark.timeout(30)
async def test_an_explicit_ids_held_text_is_its_prompt_not_decodes_tokens():
    """Without the answer's text (an explicit id collects none), what decode holds is
    counted as the turn's prompt: its tokens, reasoning included, are not all in the next
    prompt, which would have a long append look short."""
    async with Cluster(config=placement(localPrefillTokens=64, maxLocalPrefillTokens=64)) as c:
        c.d[0].behaviour.reply = [""] * 4000  # held tokens the client never sends back
        r1 = await c.chat(U1, conversation_id="c")
        long = {"role": "user", "content": "tell me " * 60}
        r2 = await c.chat(U1 + [r1["message"], long], conversation_id="c")
        assert r2["headers"]["X-Bidirkv-Placement"] == "read_back; reason=append_over_cap"


@pytest.mark.timeout(30)
async def test_a_busy_holder_sends_the_turn_to_prefill():
    async with Cluster(decode=1, config=placement(decodeBusyRequests=1)) as c:
        r1 = await c.chat(U1)
        # Another conversation keeps D busy.
        other = await busy_with(c.d[0], c.chat([{"role": "user", "content": "x"}], True))
        r2 = await c.chat(U1 + [r1["message"], {"role": "user", "content": "ok"}])
        assert r2["headers"]["X-Bidirkv-Placement"] == "read_back; reason=decode_busy"
        assert c.p[0].generations()[-1].has_handle
        await other


@pytest.mark.timeout(30)
async def test_an_extend_that_fails_before_a_byte_takes_the_two_legs_elsewhere():
    async with Cluster(decode=2, config=placement()) as c:
        r1 = await c.chat(U1)
        holder = next(d for d in c.d if d.generations())
        other = next(d for d in c.d if d is not holder)
        holder.behaviour.fail_next = 1
        r2 = await c.chat(U1 + [r1["message"], {"role": "user", "content": "ok"}])
        assert r2["status"] == 200
        assert r2["headers"]["X-Bidirkv-Placement"] == "prefill; reason=extend_failed"
        assert 'bidirkv_router_reuse_total{outcome="dropped"} 1.0' in await c.metrics()
        # The turn went P -> the other replica, without the failed holder's handle.
        assert not c.p[0].generations()[-1].has_handle
        assert other.generations()
        assert "extend_failed" in await c.metrics()


@pytest.mark.timeout(30)
async def test_cost_serves_a_first_turn_whole_on_an_idle_decode_replica():
    async with Cluster(decode=2, config={"placement": {"policy": COST}}) as c:
        # Until prefill has reported a prompt's tokens the router cannot size a turn
        # against the cap: the first turn after a start takes the legs.
        r0 = await c.chat([{"role": "user", "content": "warm up"}], True)
        assert r0["headers"]["X-Bidirkv-Placement"] == "prefill; reason=learning"
        seen = [len(d.generations()) for d in c.d]
        r1 = await c.chat(U1, True)
        assert r1["status"] == 200
        assert r1["headers"]["X-Bidirkv-Placement"] == "decode; reason=cheaper_on_decode"
        assert len(c.p[0].generations()) == 1  # no prefill leg for this turn
        (holder,) = [d for d, n in zip(c.d, seen, strict=True) if len(d.generations()) > n]
        kv = holder.generations()[-1].kv
        assert kv["do_remote_prefill"] is False and "remote_block_ids" not in kv
        text = await c.metrics()
        assert 'bidirkv_router_reuse_total{outcome="miss"} 2.0' in text
        # Decode kept it: the next turn is extended on the same replica.
        n = len(holder.generations())
        r2 = await c.chat(U1 + [r1["message"], {"role": "user", "content": "ok"}], True)
        assert r2["headers"]["X-Bidirkv-Placement"] == "extend; reason=cheaper_on_decode"
        assert len(holder.generations()) == n + 1 and len(c.p[0].generations()) == 1


@pytest.mark.timeout(30)
async def test_a_first_turn_takes_the_legs_when_decode_is_busy():
    async with Cluster(config={"placement": {"policy": COST, "decodeBusyRequests": 1}}) as c:
        await c.chat([{"role": "user", "content": "warm up"}])  # sizes turns from now on
        # Another conversation keeps D busy.
        other = await busy_with(c.d[0], c.chat([{"role": "user", "content": "x"}], True))
        r = await c.chat(U1)
        assert r["headers"]["X-Bidirkv-Placement"] == "prefill; reason=decode_busy"
        assert len(c.p[0].generations()) == 2
        await other


@pytest.mark.timeout(30)
async def test_a_busy_holders_turn_is_read_back_and_decoded_by_another_replica():
    async with Cluster(decode=2, config=placement(decodeBusyRequests=1)) as c:
        # Two conversations held by the same replica (first turns alternate replicas).
        firsts = []
        for i in range(3):
            msgs = [{"role": "user", "content": f"conversation {i}"}]
            firsts.append((msgs, await c.chat(msgs)))
        holder = next(d for d in c.d if len(d.generations()) >= 2)
        other = next(d for d in c.d if d is not holder)

        def decoded_on(msgs):
            return next(d for d in c.d
                        if any(g.body.get("messages") == msgs for g in d.generations()))

        (a_msgs, a), (b_msgs, b) = [(m, r) for m, r in firsts if decoded_on(m) is holder][:2]
        # b's next turn, extended, keeps the holder busy.
        busy = await busy_with(holder, c.chat(b_msgs + [b["message"],
                                                       {"role": "user", "content": "go"}], True))
        before = len(other.generations())
        r = await c.chat(a_msgs + [a["message"], {"role": "user", "content": "ok"}])
        assert r["status"] == 200
        assert r["headers"]["X-Bidirkv-Placement"] == "move; reason=decode_busy"
        assert c.p[0].generations()[-1].has_handle  # P read the holder's blocks
        assert len(other.generations()) == before + 1  # and the other replica decoded
        assert 'decision="move",reason="decode_busy"' in await c.metrics()
        await busy


@pytest.mark.timeout(30)
async def test_with_bidirectional_transfer_off_every_turn_takes_the_two_legs():
    async with Cluster(config={"bidirectional": False, "placement": {"policy": COST}}) as c:
        r = await c.chat(U1, True)
        assert r["status"] == 200 and "X-Bidirkv-Placement" not in r["headers"]
        assert len(c.p[0].generations()) == 1
