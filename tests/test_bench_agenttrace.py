"""The agent trace of `make bench-agents` (pure, no servers): seeded, its file form, where
it spawns and which headers each session sends, the tokens each request shares, its
example stack, and the figures per kind of request with the aims."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
from dataclasses import replace

import pytest

from bidirkv.bench import agentreport as ar
from bidirkv.bench.agenttrace import (
    CHILD_LATER,
    FORK,
    FORK_FIRST,
    FULL,
    PARENT,
    PARENT_AFTER,
    PARENT_HEADERS,
    PARENT_TURN,
    QUICK,
    SUB_FIRST,
    SUBAGENT,
    Replay,
    Shape,
    build_trace,
    plan,
    read_trace,
    tokens,
    trace_from_json,
    trace_json,
    write_trace,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "local-agents.yaml"


@pytest.fixture(scope="module")
def full():
    return build_trace(0)


@pytest.fixture(scope="module")
def full_plan(full):
    return plan(full)


def test_the_same_seed_gives_the_same_trace_and_another_seed_another(full):
    assert build_trace(0) == full
    other = build_trace(1)
    assert other != full
    assert other.system_prompt != full.system_prompt
    assert [s.user for s in other.steps] != [s.user for s in full.steps]


def test_the_trace_round_trips_through_its_file(tmp_path, full):
    assert trace_from_json(json.loads(json.dumps(trace_json(full)))) == full
    path = write_trace(tmp_path / "agents" / "trace.json", full)
    assert read_trace(path) == full
    quick = build_trace(5, QUICK)
    assert read_trace(write_trace(tmp_path / "q.json", quick)) == quick


@pytest.mark.parametrize(("edit", "match"), [
    (lambda d: d.update(kind="other"), r"kind: 'other': must be 'bidirkv-agent-trace'"),
    (lambda d: d.update(version=2), r"version: 2: this benchmark reads version 1"),
    (lambda d: d["shape"].update(turns=3), r"shape: \['turns'\]: unknown keys"),
    (lambda d: d["shape"].update(spawn_after=[8]), r"spawn_after: \(8,\): distinct"),
    (lambda d: d["steps"][0].update(session="nobody"),
     r"steps\[0\].session: 'nobody': not a session of the trace"),
    (lambda d: d["steps"].pop(1), r"steps\[1\].turn: 3: turn 2 of parent comes next"),
    (lambda d: d["steps"].insert(0, d["steps"].pop(3)),
     r"steps\[0\].session: 't3-sub1': a child starts after its parent's turn 3"),
    (lambda d: d["sessions"][1].update(parent="ghost"), r"sessions\[1\].parent: 'ghost'"),
    (lambda d: d["steps"][2].update(kind="other"), r"steps\[2\].kind: 'other': one of"),
])
def test_a_bad_trace_file_names_the_field(tmp_path, full, edit, match):
    doc = trace_json(full)
    doc = json.loads(json.dumps(doc))
    edit(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=match):
        read_trace(path)


def test_bad_shapes_name_the_field_the_value_and_what_is_allowed():
    with pytest.raises(ValueError, match=r"spawn_after: \(3, 3\): distinct parent turns"):
        Shape(spawn_after=(3, 3))
    with pytest.raises(ValueError, match=r"system_tokens: 100: more than the 406 tokens"):
        Shape(system_tokens=100)
    with pytest.raises(ValueError, match=r"parent_header: 'x-parent': one of"):
        Shape(parent_header="x-parent")
    with pytest.raises(ValueError, match=r"task_words: \(5, 1\): a pair"):
        Shape(task_words=(5, 1))
    with pytest.raises(ValueError, match=r"parent_tokens: 2200: room for"):
        Shape(parent_tokens=2200)


def test_the_parent_spawns_after_its_turns_3_and_6_and_goes_on_after_its_children(full):
    order = [(s.session, s.turn, s.kind) for s in full.steps]
    parent = [i for i, (name, _, _) in enumerate(order) if name == PARENT]
    assert len(parent) == 8
    for spawn in (3, 6):
        start, nxt = parent[spawn - 1], parent[spawn]
        between = order[start + 1:nxt]
        firsts = [x for x in between if x[1] == 1]
        assert [k for _, _, k in firsts] == [SUB_FIRST] * 3 + [FORK_FIRST] * 2
        assert all(n.startswith(f"t{spawn}-") for n, _, _ in between)
        # Every first turn before any later one; each child has 1 or 2 later turns.
        assert between[:5] == firsts
        later = [x for x in between[5:]]
        assert all(k == CHILD_LATER for _, _, k in later)
        for name, _, _ in firsts:
            assert 1 <= sum(n == name for n, _, _ in later) <= 2
        assert order[nxt][2] == PARENT_AFTER
    kinds = [k for n, _, k in order if n == PARENT]
    assert kinds == [PARENT_TURN] * 3 + [PARENT_AFTER] + [PARENT_TURN] * 2 + [PARENT_AFTER,
                                                                           PARENT_TURN]


def test_each_session_sends_its_own_id_and_only_a_sub_agent_names_its_parent(full):
    roles = {s.name: s.role for s in full.sessions}
    assert sorted(roles.values()).count(SUBAGENT) == 6 and list(roles.values()).count(FORK) == 4
    replay = Replay(full, "run7")
    for step in full.steps:
        s = full.session(step.session)
        got = replay.headers(step)
        want = {"X-Session-ID": f"run7-{s.name}"}
        if s.role == SUBAGENT:
            want["x-claude-code-parent-agent-id"] = "run7-parent"
        assert got == want, step.session
    other = build_trace(0, replace(FULL, parent_header="X-Dynamo-Parent-Session-ID"))
    sub = other.session("t3-sub1")
    assert sub.headers == {"X-Session-ID": "t3-sub1", "X-Dynamo-Parent-Session-ID": "parent"}


def test_shared_tokens_sub_agents_share_the_system_message_forks_the_whole_history(
        full, full_plan):
    by = {(r["session"], r["turn"]): r for r in full_plan}
    system = len(full.system_message()["content"].split())
    assert system == FULL.system_tokens  # the prompt and the tools' schemas: 2k tokens
    out = FULL.output_tokens
    for spawn in (3, 6):
        parent = by[(PARENT, spawn)]
        history = parent["prompt_tokens"] + out  # its prompt and its answer
        for i in (1, 2, 3):
            # <s>, <|system|>, the system message, and the <|user|> that follows it.
            assert by[(f"t{spawn}-sub{i}", 1)]["shared_tokens"] == system + 3
        for i in (1, 2):
            fork = by[(f"t{spawn}-fork{i}", 1)]
            assert fork["shared_tokens"] == history >= 4000
            assert fork["prompt_tokens"] > history
        assert by[(PARENT, spawn + 1)]["shared_tokens"] == history
    # The parent grows to about 8k tokens; a child's later turn extends its own history.
    assert abs(by[(PARENT, 8)]["prompt_tokens"] - 8192) < 0.1 * 8192
    assert by[(PARENT, 1)]["shared_tokens"] == 0
    for r in full_plan:
        if r["kind"] == CHILD_LATER:
            assert r["shared_tokens"] == by[(r["session"], r["turn"] - 1)]["prompt_tokens"] + out


def test_a_fork_opens_with_the_parents_history_after_its_spawn_a_sub_agent_with_the_system():
    trace = build_trace(3, QUICK)
    replay = Replay(trace, "r")
    for step in trace.steps:
        conv = replay.conversation(step)
        if step.session == "t2-fork1" and step.turn == 1:
            assert conv.messages == replay.after[(PARENT, 2)]
            assert conv.messages[-1]["role"] == "assistant"
        if step.session == "t2-sub1" and step.turn == 1:
            assert conv.messages == [trace.system_message()]
        conv.ask(step.user)
        conv.answer(f"answer {step.session} {step.turn}")
        replay.answered(step)
    assert replay.source(trace.steps[0]) is None
    assert replay.source(next(s for s in trace.steps if s.session == "t2-sub1")) == (PARENT, 2)


def test_the_quick_trace_is_a_smoke_runs_size():
    trace = build_trace(0, QUICK)
    kinds = [s.kind for s in trace.steps]
    assert kinds.count(PARENT_TURN) + kinds.count(PARENT_AFTER) == 3
    assert kinds.count(SUB_FIRST) == 1 and kinds.count(FORK_FIRST) == 1
    assert PARENT_AFTER in kinds
    assert max(r["prompt_tokens"] for r in plan(trace)) < 1500


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed")
def test_the_token_count_is_the_tiny_models_own():
    from bidirkv.local.model import TinyModelConfig, build_tokenizer

    tok = build_tokenizer(TinyModelConfig())
    trace = build_trace(2, QUICK)
    replay = Replay(trace, "r")
    for step in trace.steps[:4]:
        prompt = replay.prompt(step)
        # As vLLM does: the template rendered, then tokenized without adding specials.
        text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(tokens(prompt)), step.session
        conv = replay.conversation(step)
        conv.ask(step.user)
        conv.answer(" ".join(["x"] * QUICK.output_tokens))
        replay.answered(step)


def test_the_example_stack_is_1p2d_float32_with_the_placement_header(tmp_path, full_plan):
    from bidirkv.local.plan import local_spec, plan_stack, read_spec_file

    raw = read_spec_file(EXAMPLE)
    (tmp_path / raw["model"]["name"]).mkdir(parents=True)
    stack = plan_stack(local_spec(raw, tmp_path), list(range(9000, 9007)), tmp_path)
    roles = [e.role for e in stack.engines]
    assert roles == ["prefill", "decode", "decode"]
    for e in stack.engines:
        assert e.argv[e.argv.index("--dtype") + 1] == "float32"
        want = "--enable-prefix-caching" if e.role == "decode" else "--no-enable-prefix-caching"
        assert want in e.argv, e.name
    assert stack.router_config["placementHeader"] is True
    assert stack.router_config["placement"]["policy"] == "cost"
    assert stack.router_config["bidirectional"] is True
    # The trace's longest prompt and its answer fit.
    longest = max(r["prompt_tokens"] for r in full_plan) + FULL.output_tokens
    assert longest <= raw["model"]["maxModelLen"]


def test_the_bench_reads_the_routers_placement_header_and_reuse_kinds():
    from bidirkv.bench.runner import PLACEMENT_HEADER, REUSE_KINDS, reuse_kind
    from bidirkv.router.datapath.relay import PLACEMENT_HEADER as ROUTER
    from bidirkv.router.metrics import REUSE_KINDS as ROUTER_KINDS
    from bidirkv.router.request.validation import ID_SOURCES

    assert PLACEMENT_HEADER == ROUTER
    assert REUSE_KINDS == ROUTER_KINDS
    assert reuse_kind({"reuse_kind_fork": 1.0, "reuse_kind_child": 0.0}) == "fork"
    assert reuse_kind({"reuse_kind_fork": None}) is None  # a router that does not count it
    assert ("header", "X-Session-ID") in ID_SOURCES  # the id every session sends


def test_the_parent_headers_are_the_routers_defaults():
    from bidirkv.knobs import PARENT_HEADERS as ROUTER

    assert [h.lower() for h in PARENT_HEADERS] == [h.lower() for h in ROUTER]


# -- the figures ---------------------------------------------------------------------------

def records(trace, ttft, **extra):
    """A run's records of `trace`: `ttft(kind)` seconds each, reused where `extra` says."""
    out = []
    for i, r in enumerate(plan(trace)):
        s = trace.session(r["session"])
        out.append({"step": i, "session": r["session"], "turn": r["turn"], "kind": r["kind"],
                    "conversation": trace.sessions.index(s), "ttft_s": ttft(r["kind"]),
                    "shared_tokens": r["shared_tokens"], "context_tokens": r["prompt_tokens"],
                    "planned_tokens": r["prompt_tokens"], "text_sha": f"sha{i}",
                    "reason": "first turn" if r["turn"] == 1 else "hit", "reuse_kind": None,
                    "placement": None, "reused_tokens": 0, "failures": 0,
                    "lower_bound_s": None, **extra})
    return out


def test_kind_rows_give_medians_ratios_and_counts(full):
    on = records(full, lambda k: 0.2 if k in (SUB_FIRST, FORK_FIRST) else 0.3)
    off = [{**r, "ttft_s": 1.0, "lower_bound_s": 0.25, "bound_cached_tokens": 2048}
           for r in records(full, lambda k: 1.0)]
    off[6]["text_sha"] = "other"  # t3-fork1's first turn answered otherwise
    rows = {r["kind"]: r for r in ar.kind_rows(on, off)}
    assert list(rows) == [PARENT_AFTER, SUB_FIRST, FORK_FIRST, CHILD_LATER, PARENT_TURN]
    fork = rows[FORK_FIRST]
    assert fork["n"] == 4 and fork["ttft_on_s"] == 0.2 and fork["ttft_off_s"] == 1.0
    assert fork["off_over_on"] == pytest.approx(5.0)
    assert fork["on_over_bound"] == pytest.approx(0.8)
    assert fork["shared_tokens"] == pytest.approx((4629 + 6695) / 2)
    assert fork["reused"] == "0/4" and fork["equal"] == "3/4"
    assert rows[PARENT_AFTER]["reused"] == "2/2"  # a returning turn's hit
    text = ar.kind_table(ar.kind_rows(on, off))
    assert re.search(r"\| +kind \| +n \| shared tok \| TTFT ON ms \| TTFT OFF ms \| bound ms \| "
                     r"OFF/ON \|", text)
    steps = ar.step_rows(on, off)
    assert [r["step"] for r in steps] == list(range(1, len(full.steps) + 1))
    assert steps[6]["equal"] is False and steps[0]["equal"] is True
    assert steps[6]["bound_cached_tokens"] == 2048  # what the bound's replica had cached
    assert re.search(r"\| +# \| +session \| turn \| +kind \|", ar.step_table(steps))


def test_a_turn_reused_by_the_routers_count_ps_read_or_decodes_cache():
    base = {"reason": "first turn", "reuse_kind": None, "reused_tokens": 0}
    assert not ar.reused(base)
    assert ar.reused({**base, "reason": "extended"})
    assert ar.reused({**base, "reuse_kind": "child"})
    assert ar.reused({**base, "reused_tokens": 2048})


def test_the_aims_judge_first_turns_at_4k_shared_the_parents_next_turn_outputs_failures(full):
    on = records(full, lambda k: 0.4 if k == FORK_FIRST else 0.9)
    off = records(full, lambda k: 1.0)
    aims = ar.aims(on, off, failures=0)
    child, parent, outputs, failed = aims
    assert child.met is True and "over 4 first turns" in child.detail  # forks only: >= 4k
    assert "0.40x" in child.detail
    assert parent.met is True and parent.detail.startswith("2 of 2 reused")
    assert outputs.met is True and failed.met is True
    # A slow fork, a parent turn that recomputed, an output that differs, one failure.
    on[21]["ttft_s"] = 0.6
    on[14]["reason"] = "released by the router"
    off[3]["text_sha"] = "x"
    child, parent, outputs, failed = ar.aims(on, off, failures=1)
    assert child.met is False and "0.60x (t6-fork2, 6695 shared tokens)" in child.detail
    assert parent.met is False and parent.detail.startswith("1 of 2 reused")
    assert outputs.met is False and "differ: t3-sub1 turn 1" in outputs.detail
    assert failed.met is False and failed.detail == "1 failed"
    # The quick trace shares fewer than 4k tokens: the first aim is not measured.
    quick = build_trace(0, QUICK)
    assert ar.aims(records(quick, lambda k: 1.0), records(quick, lambda k: 1.0), 0)[0].met \
        is None


def test_failed_counts_each_runs_requests_and_bounds():
    on = {"records": [{"failures": 1}, {"failures": 0}]}
    off = {"records": [{"failures": 2}], "bound_failures": 1}
    assert ar.failed(on, off) == 4


def test_report_prints_the_tables_and_writes_json_and_png(tmp_path, capsys):
    from bidirkv.demoagents import parse_args, report

    trace = build_trace(0, QUICK)
    args = parse_args(["--quick", "--out", str(tmp_path)])
    write_trace(tmp_path / "trace.json", trace)
    on = {"records": records(trace, lambda k: 0.1), "bound_failures": 0}
    off = {"records": [{**r, "lower_bound_s": 0.08}
                       for r in records(trace, lambda k: 0.3)], "bound_failures": 0}
    meta = {"cpu": {"model": "Some CPU"}, "dtype": {"dtype": "float32"}}
    doc = report(on, off, meta, args, "Some CPU (avx2)")
    out = capsys.readouterr().out
    assert "==> agents: 1P2D, per kind of request (Some CPU, float32)" in out
    assert re.search(r"\| +kind \| +n \| shared tok \|", out)
    assert re.search(r"\| +# \| +session \| turn \|", out)
    assert "- no failed request: met (0 failed)" in out
    written = json.loads((tmp_path / "agents.json").read_text())
    assert written["kind"] == "bidirkv-bench-agents"
    assert [r["kind"] for r in written["rows"]] == [r["kind"] for r in doc["rows"]]
    assert (tmp_path / "ttft_agents.png").read_bytes()[:4] == b"\x89PNG"


def test_the_command_line_builds_or_replays_a_trace(tmp_path):
    from bidirkv.demoagents import parse_args

    assert parse_args([]).trace is None
    assert parse_args(["--trace", str(tmp_path / "t.json")]).trace == tmp_path / "t.json"
    for bad in (["--trace", "t.json", "--quick"], ["--trace", "t.json", "--seed", "3"],
                ["--settle", "-1"], ["--parent-header", "x-parent"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


# -- the trace against the router (fake engines) ------------------------------------------

def ar_record(rec) -> dict:
    """A runner's record as the report reads it (P read nothing: fake engines)."""
    from bidirkv.bench.runner import reuse_kind

    return {**rec.to_json(), "reuse_kind": reuse_kind(rec.metrics), "reused_tokens": 0}


async def test_a_replayed_trace_sends_what_the_router_reads_as_children_and_forks():
    """The quick trace through the benchmark's runner, against the router and two fake
    decode replicas: the sub-agent is counted as a child, the fork as a fork, each
    placed by its parent, and the parent's next turn still reuses its own handle."""
    import asyncio

    from fake_engine import Cluster

    from bidirkv.bench.runner import BenchConfig, Runner, reuse_kind

    trace = build_trace(0, QUICK)
    config = {"placement": {"policy": "cost"}}  # the benchmark's, the default
    async with Cluster(decode=2, config=config) as c:
        runner = Runner(BenchConfig(url=c.url, label="t", id_mode="none", warmup_turns=0,
                                    settle_s=0.0, output_tokens=QUICK.output_tokens),
                        progress=False)
        replay, got = Replay(trace, "run"), {}
        for step in trace.steps:
            rec = await asyncio.to_thread(
                runner.turn, replay.conversation(step), step.turn, True, text=step.user,
                headers=replay.headers(step))
            replay.answered(step)
            got[(step.session, step.turn)] = rec
    sub, fork, after = got[("t2-sub1", 1)], got[("t2-fork1", 1)], got[(PARENT, 3)]
    assert reuse_kind(sub.metrics) == "child" and sub.placement.endswith("; kind=child")
    assert reuse_kind(fork.metrics) == "fork" and fork.placement.endswith("; kind=fork")
    assert "parent=" in sub.placement and "parent=" in fork.placement
    assert reuse_kind(after.metrics) == "returning" and after.reason in ("hit", "extended")
    assert ar.reused(ar_record(sub)) and ar.reused(ar_record(after))
