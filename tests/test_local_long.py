"""Long contexts on the local stack: examples/local-long.yaml renders what a 64k-token
history needs (32-token blocks, chunked prefill, a long max_model_len, KV that holds it),
the tiny model takes that length, and the long-context phase's schedule and figures."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

from bidirkv.bench.longrun import (
    AFTER,
    BEFORE,
    STEP,
    LongTurn,
    agent_turns,
    plan_turns,
    report_ratios,
    restart_row,
)
from bidirkv.demolong import parse_args
from bidirkv.local.model import TinyModelConfig
from bidirkv.local.plan import local_spec, plan_stack, read_spec_file

ROOT = pathlib.Path(__file__).resolve().parent.parent
LONG = ROOT / "examples" / "local-long.yaml"
BASE = ROOT / "examples" / "local.yaml"
GIB = 1024**3


@pytest.fixture
def plan(tmp_path):
    raw = read_spec_file(LONG)
    (tmp_path / raw["model"]["name"]).mkdir(parents=True)  # as --tiny-model would
    return plan_stack(local_spec(raw, tmp_path), [9000, 9001, 9002, 9003, 9004], tmp_path)


def arg(argv: list[str], name: str) -> str:
    """The value of `--name=value` or `--name value` in an argv."""
    for i, a in enumerate(argv):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name:
            return argv[i + 1]
    raise AssertionError(f"{name} not in {argv}")


def kv_bytes_per_token(cfg: TinyModelConfig, dtype_bytes: int) -> int:
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * dtype_bytes


def test_the_long_example_renders_32_token_blocks_chunked_prefill_and_a_64k_context(plan):
    for server in plan.engines:
        assert arg(server.argv, "--block-size") == "32", server.name
        assert "--enable-chunked-prefill" in server.argv, server.name
        assert int(arg(server.argv, "--max-model-len")) >= 65536, server.name
        # A step smaller than the context: the prompt is computed in chunks.
        assert int(arg(server.argv, "--max-num-batched-tokens")) < \
            int(arg(server.argv, "--max-model-len"))
    # The router waits for OFF's recompute of a long history.
    assert plan.router_config["timeouts"]["prefillSeconds"] >= 1800


def test_the_long_examples_kv_cache_holds_a_history_and_the_turn_extending_it(plan):
    cfg = TinyModelConfig()
    for server in plan.engines:
        max_len = int(arg(server.argv, "--max-model-len"))
        space = float(server.env["VLLM_CPU_KVCACHE_SPACE"]) * GIB
        # float32 (the dtype on a CPU without native bf16) is the larger case: decode keeps
        # a retained history and the turn that extends it, both up to max_model_len.
        assert space >= 2 * max_len * kv_bytes_per_token(cfg, 4), server.name
    assert kv_bytes_per_token(cfg, 2) == 4096  # what the example's comment says


def test_the_tiny_model_takes_the_long_examples_context():
    assert read_spec_file(LONG)["model"]["maxModelLen"] <= TinyModelConfig().max_position_embeddings
    assert TinyModelConfig().max_position_embeddings >= 131072


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed")
def test_the_built_model_config_has_the_longer_position_embeddings(tmp_path):
    from bidirkv.local.model import build_model

    small = TinyModelConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=64, vocab_size=64)
    path = build_model(tmp_path / "m", small, dtype="float32")
    config = json.loads((path / "config.json").read_text())
    assert config["max_position_embeddings"] == 131072


def test_the_long_example_is_the_base_example_but_for_what_long_contexts_need():
    long, base = read_spec_file(LONG), read_spec_file(BASE)
    for spec in (long, base):
        spec["model"].pop("maxModelLen")
        spec["engine"].pop("extraArgs")
        spec["engine"]["extraEnv"] = [e for e in spec["engine"]["extraEnv"]
                                      if e["name"] != "VLLM_CPU_KVCACHE_SPACE"]
        spec["router"].pop("timeouts", None)
    assert long == base


def test_plan_turns_grows_then_restarts():
    plan = plan_turns([16384, 16384], 1024)
    assert plan == [LongTurn(1, 16384, STEP), LongTurn(2, 16384, STEP),
                    LongTurn(3, 1024, BEFORE), LongTurn(4, 1024, AFTER)]
    with pytest.raises(ValueError, match="at least one append"):
        plan_turns([], 1024)
    with pytest.raises(ValueError, match=r"0: each must be an integer >= 1"):
        plan_turns([16384, 0], 1024)


def test_the_default_phase_reaches_64k_tokens_and_restarts_past_56k():
    args = parse_args([])
    steps = [t.words for t in args.plan if t.kind == STEP]
    assert sum(steps) >= 65536
    # An agent's turn past 32k and past 64k tokens, measured ON, OFF and the bound.
    agents = agent_turns(args.plan)
    reached = {t.turn: sum(steps[:t.turn]) for t in args.plan if t.kind == STEP}
    assert any(reached[t] >= 32768 for t in agents)
    assert any(reached[t] >= 65536 for t in agents)
    with pytest.raises(SystemExit):
        parse_args(["--steps", "-5"])


def record(turn: int, ctx: int, ttft: float, **metrics) -> dict:
    return {"turn": turn, "context_tokens": ctx, "output_tokens": 48, "ttft_s": ttft,
            "reuse": "hit", "reason": "hit", "metrics": metrics}


def test_the_restart_row_compares_the_turn_after_with_the_same_append_before():
    plan = plan_turns([32768, 32768], 1024)
    recs = [record(1, 32800, 60.0), record(2, 65600, 100.0),
            record(3, 66700, 8.0, reused_tokens=65600, p_external_hit_tokens=65568),
            record(4, 67800, 8.8, reused_tokens=66700, p_external_hit_tokens=66688)]
    row = restart_row(recs, plan, {"recall_s": 1.5})
    assert row["turn"] == 4 and row["restart_at_tokens"] == 66748
    assert row["restart_at_or_past_aim"] is True
    assert row["ttft_before_s"] == 8.0 and row["ttft_after_s"] == 8.8
    assert row["after_over_before"] == pytest.approx(1.1)
    assert row["reused_tokens"] == 66700 and row["p_loaded_tokens"] == 66688
    assert row["recall_s"] == 1.5
    with pytest.raises(ValueError, match="before and after the router restart"):
        restart_row(recs[:3], plan, {})


def test_report_ratios_take_the_lowest_off_over_on_past_32k_and_64k():
    rows = [{"turn": 1, "context_tokens": 16400, "speedup": 1.0, "on_over_lower_bound": 1.3},
            {"turn": 2, "context_tokens": 32800, "speedup": 2.0, "on_over_lower_bound": 1.1},
            {"turn": 3, "context_tokens": 49200, "speedup": 2.5, "on_over_lower_bound": 1.0},
            {"turn": 4, "context_tokens": 65600, "speedup": 2.4, "on_over_lower_bound": None}]
    got = report_ratios(rows, agents={3})
    assert got["off_over_on_at_32768"]["ratio"] == 2.0
    assert got["off_over_on_at_65536"] == {"ratio": 2.4, "turn": 4, "context_tokens": 65600}
    assert got["agent_off_over_on_at_32768"]["ratio"] == 2.5  # the agent's turns alone
    assert got["agent_off_over_on_at_65536"] is None
    assert got["on_over_bound_max"]["ratio"] == 1.1  # turn 1 has nothing to read back
    assert report_ratios(rows[:1])["off_over_on_at_32768"] is None


def test_report_prints_both_tables_and_writes_json_and_png(tmp_path, capsys):
    from bidirkv.bench import stats
    from bidirkv.demolong import report

    args = parse_args(["--steps", "1000", "1000", "--restart-words", "100",
                       "--out", str(tmp_path)])
    args.out = tmp_path
    on_recs = [record(1, 1003, 0.5), record(2, 2051, 0.6, p_external_hit_tokens=1024),
               record(3, 2199, 0.3, p_external_hit_tokens=2048),
               record(4, 2347, 0.35, reused_tokens=2176, p_external_hit_tokens=2176)]
    off_recs = [{**record(1, 1003, 0.5), "lower_bound_s": 0.4},
                {**record(2, 2051, 1.2), "lower_bound_s": 0.5}]
    on = {"per_turn": stats.per_turn(on_recs), "records": on_recs}
    off = {"per_turn": stats.per_turn(off_recs), "records": off_recs}
    meta = {"cpu": {"model": "Some CPU"}, "dtype": {"dtype": "float32"}}
    doc = report(on, off, {"recall_s": 2.0, "router_back_s": 1.5}, meta, args, "Some CPU")
    out = capsys.readouterr().out
    assert "| turn | context | TTFT ON s | TTFT OFF s | OFF/ON |" in out
    assert "| restart at | next turn's context | TTFT after restart s |" in out
    assert "below the 56000 aimed at" in out  # a short run says it did not get there
    assert [r["turn"] for r in doc["rows"]] == [1, 2]  # the short turns are the restart row's
    assert doc["rows"][1]["speedup"] == pytest.approx(2.0)
    assert doc["restart"]["reused_tokens"] == 2176
    written = json.loads((tmp_path / "long.json").read_text())
    assert written["kind"] == "bidirkv-bench-long" and written["plan"][-1]["kind"] == AFTER
    assert (tmp_path / "ttft_long.png").stat().st_size > 0


def test_a_bench_run_ends_with_its_exit_status_and_says_why(capsys):
    from bidirkv.bench.stamp import Clock
    from bidirkv.demolong import finished

    def fails(exc):
        def run():
            raise exc
        return run

    assert finished("bench-x", lambda: None, Clock()) == 0
    assert "done in" in capsys.readouterr().out
    assert finished("bench-x", fails(ValueError("bad trace")), Clock()) == 1
    assert "bench-x: bad trace\nbench-x: every process it started is stopped" \
        in capsys.readouterr().err
    assert finished("bench-x", fails(KeyboardInterrupt()), Clock()) == 130
    assert "interrupted" in capsys.readouterr().err
