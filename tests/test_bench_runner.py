"""The benchmark runner and `bidir-kv bench` against the real router with fake engines:
turn order, history sent back, conversation ids, per-request metric deltas, output files."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from fake_engine import Cluster

from bidirkv.bench.client import RequestFailed, chat, first_model, sse_events
from bidirkv.bench.conversation import Conversation
from bidirkv.bench.runner import BenchConfig, Runner
from bidirkv.cli import main as cli_main

SMALL = {"conversations": 2, "turns": 3, "new_tokens": 20, "output_tokens": 5,
         "warmup_turns": 1, "settle_s": 0.0}


async def run_bench(cluster: Cluster, **kw) -> list:
    cfg = BenchConfig(url=cluster.url, label="t", **{**SMALL, **kw})
    # The runner's client blocks; the servers live on this event loop.
    return await asyncio.to_thread(Runner(cfg, progress=False).run)


async def test_turns_history_ids_and_reuse_deltas():
    async with Cluster() as c:
        records = await run_bench(c)
        assert [(r.turn, r.conversation) for r in records] == [
            (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
        assert all(r.text == "Hello from the fake." for r in records)
        assert all(r.ttft_s <= r.total_s for r in records)
        # Deltas of the router's counters belong to each request.
        assert [r.reuse for r in records] == ["miss", "miss"] + ["hit"] * 4
        assert all(r.metrics["reused_tokens"] > 0 for r in records if r.turn > 1)
        assert all(r.metrics["prefill_s"] > 0 for r in records)
        assert all(r.metrics["p_transfer_s"] is None for r in records)  # no P metrics URL
        # The decode engine saw each conversation's real answers sent back.
        bodies = [g.body for g in c.d[0].generations()]
        last = bodies[-1]["messages"]
        assert [m["role"] for m in last] == ["user", "assistant"] * 2 + ["user"]
        assert all(m["content"] == "Hello from the fake." for m in last if
                   m["role"] == "assistant")
        assert all(len(m["content"].split()) == 20 for m in last if m["role"] == "user")
        assert bodies[-1]["min_tokens"] == bodies[-1]["max_tokens"] == 5
        # Warm-up (1 turn) first, then the measured conversations, each with its own id.
        prefill_ids = [g.body for g in c.p[0].generations()]
        assert len(prefill_ids) == 1 + 6
        assert "conversation_id" not in bodies[-1]  # consumed by the router


async def test_lower_bound_goes_straight_to_its_server():
    async with Cluster() as c:
        records = await run_bench(c, lower_bound_url=c.d[0].url, turns=2, conversations=1,
                                  warmup_turns=0)
        assert all(r.lower_bound_s is not None and r.lower_bound_s > 0 for r in records)
        direct = [g.body for g in c.d[0].generations() if "kv_transfer_params" not in g.body]
        assert len(direct) == 2
        assert all(b["max_tokens"] == 1 and "conversation_id" not in b for b in direct)


async def test_a_replayed_turn_sends_its_text_and_headers_and_records_the_placement():
    """A trace's turn: its own user message, its session id as a header (no id of the
    runner's), and the router's placement header on the record."""
    async with Cluster(config={"placement": {"policy": "cost"}}) as c:
        cfg = BenchConfig(url=c.url, label="t", id_mode="none", warmup_turns=0, settle_s=0.0,
                          output_tokens=3)
        runner = Runner(cfg, progress=False)
        conv = Conversation(0, "unused")
        recs = [await asyncio.to_thread(runner.turn, conv, t, True, text=text,
                                        headers={"X-Session-ID": "agent-1"})
                for t, text in ((1, "read the file"), (2, "now fix it"))]
        assert [m["content"] for m in conv.messages if m["role"] == "user"] == [
            "read the file", "now fix it"]
        last = c.d[0].generations()[-1].body["messages"]
        assert last[-1] == {"role": "user", "content": "now fix it"}
        # The header named the conversation: its second turn found the first's handle.
        assert recs[0].reuse == "miss" and recs[1].reuse in ("hit", "extended")
        assert recs[0].placement == "prefill; reason=learning"  # its first prompt
        assert recs[1].placement is not None


async def test_bench_cli_writes_a_run_and_compares_two(tmp_path, capsys):
    async with Cluster() as c:
        for label in ("on", "off"):
            args = ["bench", "--url", c.url, "--label", label, "--turns", "2",
                    "--conversations", "1", "--new-tokens", "10", "--output-tokens", "3",
                    "--warmup-turns", "0", "--settle", "0", "--no-progress",
                    "--out", str(tmp_path)]
            assert await asyncio.to_thread(cli_main, args) == 0
    run = json.loads((tmp_path / "on.json").read_text())
    assert run["kind"] == "bidirkv-bench-run"
    assert [r["turn"] for r in run["per_turn"]] == [1, 2]
    assert "json: " in capsys.readouterr().out
    out = tmp_path / "cmp"
    assert cli_main(["bench", "--compare", str(tmp_path / "on.json"), str(tmp_path / "off.json"),
                     "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| turn | context | TTFT ON ms |" in text and "Aims:" in text
    doc = json.loads((out / "bench.json").read_text())
    assert doc["outputs"]["compared"] == 2 and doc["outputs"]["differ"] == []
    for png in ("ttft_vs_context.png", "prefill_split.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_bench_cli_errors_are_one_line(tmp_path, capsys):
    assert cli_main(["bench", "--url", "http://127.0.0.1:1", "--no-progress",
                     "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("bidir-kv bench: GET http://127.0.0.1:1/v1/models failed")
    assert cli_main(["bench", "--state-dir", str(tmp_path)]) == 1
    assert "no local stack recorded" in capsys.readouterr().err
    (tmp_path / "x.json").write_text("{}")
    assert cli_main(["bench", "--compare", str(tmp_path / "x.json"),
                     str(tmp_path / "x.json")]) == 1
    assert "is not a benchmark run" in capsys.readouterr().err


def test_sse_events_stop_at_done_and_refuse_garbage():
    lines = [b"data: {\"a\": 1}\n", b"\n", b": comment\n", b"data: [DONE]\n", b"data: {}\n"]
    assert list(sse_events(iter(lines))) == [{"a": 1}]
    with pytest.raises(RequestFailed, match="not JSON"):
        list(sse_events(iter([b"data: {oops\n"])))


async def test_client_reports_http_errors_and_empty_streams():
    async def error(_):
        return web.json_response({"error": {"message": "bad"}}, status=400)

    async def no_content(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n'
                         b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/err/v1/chat/completions", error)
    app.router.add_post("/empty/v1/chat/completions", no_content)
    app.router.add_get("/err/v1/models", error)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        with pytest.raises(RequestFailed, match="HTTP 400 from .*bad"):
            await asyncio.to_thread(chat, base + "/err", {"stream": True})
        with pytest.raises(RequestFailed, match="ended without any content"):
            await asyncio.to_thread(chat, base + "/empty", {"stream": True})
        with pytest.raises(RequestFailed, match="HTTP 400"):
            await asyncio.to_thread(first_model, base + "/err")
    finally:
        await runner.cleanup()


async def test_think_time_orders_turns_by_when_each_conversation_is_due():
    from bidirkv.bench.turns import Think

    # Every conversation pauses 0.6 s before its turn 2; the first turns go back to back.
    think = Think(min_s=0.0, max_s=0.0, pause_s=0.6, pause_turns=(2,))
    async with Cluster() as c:
        records = await run_bench(c, conversations=2, turns=3, warmup_turns=0, think=think,
                                  decode_residency=c.d[0].url + "/bidirkv/residency")
    assert [(r.turn, r.conversation) for r in records][:2] == [(1, 0), (1, 1)]
    assert all(r.gap_s >= 0.6 for r in records if r.turn == 2)
    assert all(r.think_s == (0.6 if r.turn == 2 else 0.0) for r in records)
    assert [r.reason for r in records if r.turn == 1] == ["first turn"] * 2
    assert all(r.reason == "hit" for r in records if r.turn > 1)
    assert all(r.refusals == {} for r in records)


async def test_a_turn_and_the_warm_up_take_their_own_word_counts():
    async with Cluster() as c:
        cfg = BenchConfig(url=c.url, label="t", **{**SMALL, "warmup_turns": 2})
        runner = Runner(cfg, progress=False)
        conv = Conversation(0, "c0")

        def go() -> None:
            runner.warm_up("w", words=7)
            runner.turn(conv, 1, measure=False, words=300)
            runner.turn(conv, 2, measure=False)  # the config's new_tokens
            with pytest.raises(ValueError, match="words 0: a turn adds at least 1 word"):
                runner.turn(conv, 3, measure=False, words=0)

        await asyncio.to_thread(go)
        users = [[len(m["content"].split()) for m in g.body["messages"] if m["role"] == "user"]
                 for g in c.p[0].generations()]
        assert users == [[7], [7, 7], [300], [300, 20]]
