"""The P -> D flow over HTTP against fake engines: handles, identity, stripping, bodies."""

import asyncio

import pytest
from fake_engine import Cluster

from bidirkv.wire import VERSION, VERSION_KEY

pytestmark = pytest.mark.timeout(30)

U1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def gens(engine):
    return engine.generations()


def assert_handle_from(p_request, d_engine, turn_rid=None):
    kv = p_request.kv
    assert p_request.has_handle, kv
    assert kv["do_remote_decode"] is True and kv["do_remote_prefill"] is False
    assert kv["remote_engine_id"] == d_engine.engine_id
    # D's own side-channel address, as D signed it: the router never rewrites it.
    assert kv["remote_host"] == d_engine.nixl_host
    if turn_rid is not None:
        assert kv["remote_request_id"] == turn_rid


@pytest.mark.parametrize("stream", [False, True])
async def test_turn2_with_explicit_id_sends_decode_handle_to_prefill(stream):
    async with Cluster() as c:
        r1 = await c.chat(U1, stream, conversation_id="conv-1",
                          headers={"X-Request-Id": "rid-1"})
        assert r1["status"] == 200 and r1["text"] == "Hello from the fake."
        p1 = gens(c.p[0])[0]
        assert not p1.has_handle and p1.kv["remote_block_ids"] is None
        turn2 = U1 + [r1["message"], {"role": "user", "content": "more"}]
        r2 = await c.chat(turn2, stream, conversation_id="conv-1")
        assert r2["status"] == 200
        assert_handle_from(gens(c.p[0])[1], c.d[0], turn_rid="rid-1")
        # The id is ours: never forwarded to an engine.
        for rec in gens(c.p[0]) + gens(c.d[0]):
            assert "conversation_id" not in rec.body
        metrics = await c.metrics()
        assert 'bidirkv_router_reuse_total{outcome="hit"} 1.0' in metrics
        assert 'bidirkv_router_reuse_total{outcome="miss"} 1.0' in metrics
        assert "bidirkv_router_reuse_tokens_total{source=\"bidirkv\"}" in metrics


async def test_both_legs_carry_the_wire_version_and_a_handle_of_another_is_not_stored():
    async with Cluster() as c:
        c.d[0].behaviour.wire_version = VERSION + 1  # a decode engine of another release
        r1 = await c.chat(U1, False, conversation_id="conv-v")
        assert r1["status"] == 200
        for rec in gens(c.p[0]) + gens(c.d[0]):
            assert rec.kv[VERSION_KEY] == VERSION
        turn2 = U1 + [r1["message"], {"role": "user", "content": "more"}]
        assert (await c.chat(turn2, False, conversation_id="conv-v"))["status"] == 200
        assert not gens(c.p[0])[1].has_handle
        # Both turns' handles were refused.
        assert 'bidirkv_router_handle_evictions_total{reason="wire_version"} 2.0' in (
            await c.metrics())


async def test_header_conversation_id():
    async with Cluster() as c:
        h = {"X-Conversation-Id": "hdr-conv"}
        await c.chat(U1, headers=h)
        await c.chat(U1 + [{"role": "user", "content": "x"}], headers=h)
        p2 = gens(c.p[0])[1]
        assert p2.has_handle
        assert "X-Conversation-Id" not in p2.headers


async def test_a_session_id_alone_keys_the_conversation_not_its_history():
    """As vLLM's multi-turn benchmark client calls: X-Session-ID its only id, and a
    history that is not the last answer verbatim (it re-renders it) still finds the
    handle; vLLM's body field does the same and reaches the engines."""
    async with Cluster() as c:
        for n, (ids, body) in enumerate(((({"X-Session-ID": "bench-1"}), {}),
                                         ({}, {"session_id": "agent-7"}))):
            await c.chat(U1, headers=ids, **body)
            edited = U1 + [{"role": "assistant", "content": "re-rendered"},
                           {"role": "user", "content": "x"}]
            await c.chat(edited, headers=ids, **body)
            p2 = gens(c.p[0])[2 * n + 1]
            assert p2.has_handle, ids or body
            assert p2.body.get("session_id") == body.get("session_id")


@pytest.mark.parametrize("stream", [False, True])
async def test_turn2_without_id_is_identified_from_history(stream):
    async with Cluster() as c:
        r1 = await c.chat(U1, stream)
        turn2 = U1 + [r1["message"], {"role": "user", "content": "go on"}]
        r2 = await c.chat(turn2, stream)
        assert r2["status"] == 200
        assert_handle_from(gens(c.p[0])[1], c.d[0])
        # Turn 3 continues from turn 2's reply.
        turn3 = turn2 + [r2["message"], {"role": "user", "content": "and?"}]
        await c.chat(turn3, stream)
        assert gens(c.p[0])[2].has_handle
        # An edited history does not match anything.
        edited = U1 + [{"role": "assistant", "content": "something else"},
                       {"role": "user", "content": "go on"}]
        await c.chat(edited, stream)
        assert not gens(c.p[0])[3].has_handle


async def test_auto_identification_with_tool_calls_and_text_parts():
    async with Cluster() as c:
        r1 = await c.chat(U1, stream=True)
        reply_parts = {"role": "assistant", "content": [{"type": "text", "text": r1["text"]}],
                       "reasoning_content": "dropped by clients"}
        await c.chat(U1 + [reply_parts, {"role": "user", "content": "next"}])
        assert gens(c.p[0])[1].has_handle


async def test_other_tenant_never_gets_the_handle():
    async with Cluster() as c:
        alice = {"Authorization": "Bearer alice"}
        bob = {"Authorization": "Bearer bob"}
        r1 = await c.chat(U1, conversation_id="shared-id", headers=alice)
        turn2 = U1 + [r1["message"], {"role": "user", "content": "more"}]
        await c.chat(turn2, conversation_id="shared-id", headers=bob)
        assert not gens(c.p[0])[1].has_handle
        await c.chat(turn2, conversation_id="shared-id", headers=alice)
        assert gens(c.p[0])[2].has_handle
        # Same for history-identified conversations.
        r4 = await c.chat([{"role": "user", "content": "solo"}], headers=alice)
        turn = [{"role": "user", "content": "solo"}, r4["message"],
                {"role": "user", "content": "x"}]
        await c.chat(turn, headers=bob)
        assert not gens(c.p[0])[4].has_handle
        await c.chat(turn)  # anonymous is a tenant of its own too
        assert not gens(c.p[0])[5].has_handle
        await c.chat(turn, headers=alice)
        assert gens(c.p[0])[6].has_handle
        # The client's credential reaches the engines (they may check it).
        assert gens(c.d[0])[0].headers["Authorization"] == "Bearer alice"


async def test_configured_tenant_header():
    async with Cluster(config={"tenantHeader": "X-Tenant"}) as c:
        r1 = await c.chat(U1, conversation_id="c", headers={"X-Tenant": "t1"})
        turn2 = U1 + [r1["message"]]
        await c.chat(turn2, conversation_id="c", headers={"X-Tenant": "t2"})
        assert not gens(c.p[0])[1].has_handle
        await c.chat(turn2, conversation_id="c", headers={"X-Tenant": "t1"})
        assert gens(c.p[0])[2].has_handle


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_prompt_prefix_identification(stream):
    async with Cluster() as c:
        r1 = await c.complete("Once upon a time", stream)
        assert r1["status"] == 200
        r2 = await c.complete("Once upon a time" + r1["text"] + " Then", stream)
        assert r2["status"] == 200
        assert_handle_from(gens(c.p[0])[1], c.d[0])
        await c.complete("Unrelated prompt", stream)
        assert not gens(c.p[0])[2].has_handle


@pytest.mark.parametrize("stream", [False, True])
# alone: the stream patch's chunk (vLLM 0.32); native: vLLM 0.33's own streaming (null on
# every chunk, the params on the finish chunk)
@pytest.mark.parametrize("shape", ["alone", "last_chunk", "native"])
@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_params_never_reach_the_client(stream, shape, kind):
    async with Cluster() as c:
        c.d[0].behaviour.params_on_last_chunk = shape == "last_chunk"
        c.d[0].behaviour.native_stream_params = shape == "native"
        if kind == "chat":
            r = await c.chat(U1, stream, conversation_id="x")
        else:
            r = await c.complete("abc", stream, conversation_id="x")
        assert r["status"] == 200
        assert b"kv_transfer_params" not in r["raw"]
        assert b"10.0.2.2" not in r["raw"] and b"remote_block_ids" not in r["raw"]
        if stream:
            events = r["events"]
            assert events[-1] == "[DONE]"
            finishes = [ch.get("finish_reason") for e in events if isinstance(e, dict)
                        for ch in e["choices"]]
            assert finishes[-1] == "stop"  # the chunk that carried params too survives
            assert all(e["choices"] for e in events if isinstance(e, dict))
        assert len(c.router.ctx.store) == 1


async def test_client_sent_kv_transfer_params_are_dropped():
    async with Cluster() as c:
        evil = {"do_remote_decode": True, "remote_block_ids": [[666]], "remote_host": "evil"}
        r = await c.chat(U1, kv_transfer_params=evil)
        assert r["status"] == 200
        p, d = gens(c.p[0])[0], gens(c.d[0])[0]
        assert p.kv["remote_block_ids"] is None and p.kv["remote_host"] is None
        assert d.kv["remote_block_ids"] != [[666]] and d.kv["remote_host"] == "10.0.1.1"


async def test_leg_bodies_and_request_id():
    async with Cluster() as c:
        extra = {"max_completion_tokens": 50, "min_tokens": 2, "temperature": 0.3,
                 "stream_options": {"include_usage": True}, "top_p": 0.9}
        r = await c.chat(U1, stream=True, headers={"X-Request-Id": "client-rid"}, **extra)
        assert r["status"] == 200 and r["headers"]["X-Request-Id"] == "client-rid"
        p, d = gens(c.p[0])[0], gens(c.d[0])[0]
        assert p.body["stream"] is False and p.body["max_tokens"] == 1
        for gone in ("max_completion_tokens", "min_tokens", "stream_options"):
            assert gone not in p.body
        assert p.body["temperature"] == 0.3 and p.body["messages"] == U1
        assert d.body["stream"] is True and d.body["max_completion_tokens"] == 50
        assert d.body["stream_options"] == {"include_usage": True} and d.body["top_p"] == 0.9
        assert "max_tokens" not in d.body
        # D gets P's params as P signed them (its own host), the owner and no proof
        # (this router has no handle key).
        assert d.kv["do_remote_prefill"] is True and d.kv["remote_engine_id"] == \
            c.p[0].engine_id and d.kv["remote_host"] == c.p[0].nixl_host
        assert d.kv["bidirkv_owner"] == c.router.ctx.residency.owner
        assert "bidirkv_proof" not in d.kv and "bidirkv_owner" not in p.kv
        # The tenant's label (no credential): D reclaims fairly between tenants.
        tenant = c.router.ctx.keys.tenant_of(None)
        assert d.kv["bidirkv_tenant"] == tenant.hex()[:32] and "bidirkv_tenant" not in p.kv
        assert p.headers["X-Request-Id"] == d.headers["X-Request-Id"] == "client-rid"
        await c.chat(U1)
        p2, d2 = gens(c.p[0])[1], gens(c.d[0])[1]
        assert p2.headers["X-Request-Id"] == d2.headers["X-Request-Id"]
        assert p2.headers["X-Request-Id"] != "client-rid"


async def test_handle_is_refreshed_each_turn_and_single_use():
    async with Cluster() as c:
        msgs = list(U1)
        rids = []
        for i in range(3):
            rid = f"turn-{i}"
            rids.append(rid)
            r = await c.chat(msgs, conversation_id="c", headers={"X-Request-Id": rid})
            msgs += [r["message"], {"role": "user", "content": f"q{i}"}]
        ps = gens(c.p[0])
        assert not ps[0].has_handle
        assert ps[1].kv["remote_request_id"] == "turn-0"
        assert ps[2].kv["remote_request_id"] == "turn-1"
        assert len(c.router.ctx.store) == 1


async def test_a_streamed_turns_reuse_is_counted_before_its_answer_ends():
    """A benchmark reads the router's counters after each answer: a streamed turn's
    outcome is counted at its decode leg's first byte, not after the handler ends."""
    async with Cluster() as c:
        r1 = await c.chat(U1, True, conversation_id="conv-1")
        c.d[0].behaviour.chunk_delay = 0.3  # five chunks: 1.5 s of answer
        turn2 = asyncio.create_task(c.chat(U1 + [r1["message"], {"role": "user",
                                                                 "content": "more"}],
                                           True, conversation_id="conv-1"))
        hit = 'bidirkv_router_reuse_total{outcome="hit"} 1.0'
        for _ in range(40):
            if hit in await c.metrics() or turn2.done():
                break
            await asyncio.sleep(0.05)
        assert not turn2.done() and hit in await c.metrics()
        assert (await turn2)["status"] == 200
        assert hit in await c.metrics()  # once


async def test_decode_hears_when_the_conversation_is_expected_back():
    """From the second turn on, the decode leg carries the conversation's moving-average
    idle time (what decode releases by under pressure), and the stored handle keeps it."""
    async with Cluster() as c:
        msgs = list(U1)
        for i, pause in enumerate((0.0, 0.4, 0.0)):
            await asyncio.sleep(pause)
            r = await c.chat(msgs, conversation_id="c")
            msgs += [r["message"], {"role": "user", "content": f"q{i}"}]
        first, second, third = (g.kv for g in gens(c.d[0]))
        assert "bidirkv_return_s" not in first  # no history yet
        assert 0.4 <= second["bidirkv_return_s"] < 5
        # Half the newest idle time (about 0) and half the previous average.
        assert second["bidirkv_return_s"] / 2 <= third["bidirkv_return_s"] < second[
            "bidirkv_return_s"]
        (entry,) = list(c.router.ctx.store)
        assert entry.gap == pytest.approx(third["bidirkv_return_s"], abs=1e-3)
        assert entry.kept_at > 0


async def test_decode_affinity_follows_the_conversation():
    async with Cluster(decode=2) as c:
        first = await c.chat(U1, conversation_id="a")
        holder = 0 if gens(c.d[0]) else 1
        other = c.d[1 - holder]
        other_before = len(gens(other))
        msgs = U1 + [first["message"]]
        for i in range(4):
            r = await c.chat(msgs + [{"role": "user", "content": str(i)}], conversation_id="a")
            msgs = msgs + [{"role": "user", "content": str(i)}, r["message"]]
        assert len(gens(c.d[holder])) == 5 and len(gens(other)) == other_before
        # Conversations without a handle spread over both replicas.
        for i in range(4):
            await c.chat([{"role": "user", "content": f"new {i}"}], conversation_id=f"n{i}")
        assert len(gens(other)) >= 1


async def test_plain_pd_when_bidirectional_is_off():
    async with Cluster(config={"bidirectional": False}) as c:
        r1 = await c.chat(U1, conversation_id="c")
        await c.chat(U1 + [r1["message"]], conversation_id="c")
        assert not gens(c.p[0])[1].has_handle
        assert len(c.router.ctx.store) == 0
        assert b"kv_transfer_params" not in r1["raw"]
        assert 'bidirkv_router_reuse_total{outcome="off"} 2.0' in await c.metrics()


async def test_handles_of_a_restarted_decode_are_dropped():
    async with Cluster() as c:
        r1 = await c.chat(U1, conversation_id="a")
        await c.chat([{"role": "user", "content": "b"}], conversation_id="b")
        assert len(c.router.ctx.store) == 2
        c.d[0].engine_id = "decode-restarted"
        await c.chat([{"role": "user", "content": "c"}], conversation_id="c")
        assert len(c.router.ctx.store) == 1  # only c's, from the new engine
        await c.chat(U1 + [r1["message"]], conversation_id="a")
        assert not gens(c.p[0])[3].has_handle
        assert 'handle_evictions_total{reason="engine_changed"} 2.0' in await c.metrics()


async def test_configured_model_fills_a_missing_model():
    async with Cluster(config={"model": "served"}) as c:
        status, _, _ = await c.post("/v1/chat/completions", {"messages": U1})
        assert status == 200
        assert gens(c.p[0])[0].body["model"] == gens(c.d[0])[0].body["model"] == "served"
        await c.chat(U1)  # the client's own model is kept
        assert gens(c.d[0])[1].body["model"] == "fake-model"


async def test_expired_handle_is_a_miss():
    async with Cluster() as c:
        r1 = await c.chat(U1, conversation_id="a")
        for entry in c.router.ctx.store:
            entry.expires_at = 0
        await c.chat(U1 + [r1["message"]], conversation_id="a")
        assert not gens(c.p[0])[1].has_handle
        assert 'bidirkv_router_reuse_total{outcome="expired"} 1.0' in await c.metrics()


def record_steps(router, monkeypatch):
    """The steps of each turn, as the spine (`Flow.serve`) takes them, recorded on the
    router's own parts; the legs' sends recorded too, to show where they fall."""
    from bidirkv.router.datapath.admission import Slot

    steps = []

    def wrap(owner, name, step):
        real = getattr(owner, name)

        def sync(*args, **kwargs):
            steps.append(step)
            return real(*args, **kwargs)

        async def coro(*args, **kwargs):
            steps.append(step)
            return await real(*args, **kwargs)

        monkeypatch.setattr(owner, name, coro if asyncio.iscoroutinefunction(real) else sync)

    flow, runner = router.flow, router.runner
    wrap(router.intake, "admit", "admit")
    wrap(router.conversations, "identify", "identify")
    wrap(flow.placing, "plan", "plan")
    wrap(runner, "run", "run")
    wrap(runner.legs, "prefill_leg", "prefill leg")
    wrap(runner.legs, "decode_leg", "decode leg")
    wrap(flow, "end", "end")
    real_exit = Slot.__aexit__

    async def slot_freed(self, *exc):
        steps.append("slot freed")
        return await real_exit(self, *exc)

    monkeypatch.setattr(Slot, "__aexit__", slot_freed)
    return steps


@pytest.mark.parametrize("stream", [False, True])
async def test_a_turn_runs_its_steps_once_in_order(stream, monkeypatch):
    """Admitted (its slot held until the turn ends), named, placed, run, ended: each step
    once, in that order, for a first turn and for one that returns with a handle."""
    async with Cluster() as c:
        steps = record_steps(c.router, monkeypatch)
        order = ["admit", "identify", "plan", "run", "prefill leg", "decode leg", "end",
                 "slot freed"]
        r1 = await c.chat(U1, stream, conversation_id="order")
        assert r1["status"] == 200 and steps == order
        steps.clear()
        r2 = await c.chat(U1 + [r1["message"], {"role": "user", "content": "more"}], stream,
                          conversation_id="order")
        assert r2["status"] == 200 and steps == order
        assert gens(c.p[0])[1].has_handle


async def test_a_refused_request_is_admitted_no_further(monkeypatch):
    """A body the router cannot parse is refused inside its slot: it is never named,
    placed or run."""
    async with Cluster() as c:
        steps = record_steps(c.router, monkeypatch)
        status, _, _ = await c.post("/v1/chat/completions", {"messages": "not a list"})
        assert status == 400
        assert steps == ["admit", "slot freed"]
