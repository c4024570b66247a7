"""Benchmark statistics, comparison, table, aims and metric deltas (pure)."""

from __future__ import annotations

import pytest

from bidirkv.bench import promtext, stats
from bidirkv.bench.conversation import Conversation, chat_body, user_text, with_conversation_id
from bidirkv.bench.runner import BenchConfig, reuse_outcome


def rec(turn, conv, ttft, ctx, lb=None, **metrics):
    return {"turn": turn, "conversation": conv, "ttft_s": ttft, "context_tokens": ctx,
            "lower_bound_s": lb, "reuse": metrics.pop("reuse", None), "metrics": metrics,
            "text_sha": metrics.pop("sha", f"{conv}-{turn}")}


def test_per_turn_takes_medians_over_conversations():
    records = [
        rec(1, 0, 0.30, 1000, reuse="miss", prefill_s=0.25, p_compute_s=0.2, p_transfer_s=0.0),
        rec(1, 1, 0.50, 1000, reuse="miss", prefill_s=0.45, p_compute_s=0.4, p_transfer_s=0.0),
        rec(1, 2, 9.00, 1000, reuse="miss", prefill_s=0.35, p_compute_s=0.3, p_transfer_s=0.0),
        rec(2, 0, 0.40, 2050, lb=0.3, reuse="hit", prefill_s=0.3, p_compute_s=0.2,
            p_transfer_s=0.02, p_external_hit_tokens=1024, reused_tokens=900,
            p_transfer_bytes=4e6),
    ]
    rows = stats.per_turn(records)
    assert [r["turn"] for r in rows] == [1, 2]
    one, two = rows
    assert one["n"] == 3 and one["ttft_s"] == 0.5  # the 9 s outlier does not move it
    assert one["prefill_s"] == 0.35 and one["compute_s"] == 0.3
    assert one["other_s"] == pytest.approx(0.05)
    assert one["reuse"] == "miss" and one["lower_bound_s"] is None
    # P's own count wins over the router's.
    assert two["reused_tokens"] == 1024 and two["reused_tokens_router"] == 900
    assert two["transfer_s"] == 0.02 and two["lower_bound_s"] == 0.3


def test_split_other_never_negative_and_needs_a_prefill():
    assert stats.split_other(None, 0.1, 0.1) is None
    assert stats.split_other(0.5, 0.3, 0.1) == pytest.approx(0.1)
    assert stats.split_other(0.3, 0.3, 0.1) == 0.0
    assert stats.split_other(0.3, None, None) == 0.3


def rows(*turns):
    return [{"turn": t, "context_tokens": c, "ttft_s": s, "lower_bound_s": lb,
             "prefill_s": s, "compute_s": s, "transfer_s": 0.0, "other_s": 0.0}
            for t, c, s, lb in turns]


def test_compare_ratios_and_lower_bound_from_either_run():
    on = rows((1, 1000, 0.4, None), (2, 8400, 1.0, None))
    off = rows((1, 1000, 0.3, 0.25), (2, 8400, 5.0, 0.9))
    cmp = stats.compare(on, off)
    assert cmp[0]["speedup"] == pytest.approx(0.75)
    assert cmp[1]["speedup"] == pytest.approx(5.0)
    assert cmp[1]["lower_bound_s"] == 0.9
    assert cmp[1]["on_over_lower_bound"] == pytest.approx(1.0 / 0.9)
    # A turn missing from OFF compares to nothing rather than failing.
    only_on = stats.compare(rows((3, 9000, 1.0, None)), off)
    assert only_on[0]["speedup"] is None and only_on[0]["ttft_off_s"] is None


def test_aims():
    cmp = stats.compare(rows((1, 4100, 1.2, None), (2, 8200, 1.5, None), (3, 9000, 1.0, None)),
                        rows((1, 4100, 2.0, 1.0), (2, 8200, 4.0, 1.4), (3, 9000, 6.0, 0.9)))
    speed, bound = stats.check_aims(cmp)
    # OFF/ON at >= 8k: 2.67x (turn 2) and 6x: the lowest decides.
    assert speed.met is False and "2.67x (turn 2, context 8200)" in speed.detail
    # ON/bound at >= 4k: 1.2, 1.07, 1.11: the highest decides.
    assert bound.met is True and "1.20x (turn 1" in bound.detail
    none = stats.check_aims(stats.compare(rows((1, 2000, 1.0, None)), rows((1, 2000, 2, None))))
    assert [a.met for a in none] == [None, None]
    text = stats.format_aims([speed, bound, none[0]])
    assert "NOT met" in text and "not measured" in text and ": met" in text


def test_the_placement_run_beside_on_and_off_with_its_aims():
    from bidirkv.bench.report import compare_document, comparison_text

    def run(ttfts, lb=None, reason="hit"):
        records = [{**rec(t, 0, x, 1000 * t, lb=lb and lb[t - 1]), "reason": reason}
                   for t, x in enumerate(ttfts, 1)]
        return {"per_turn": stats.per_turn(records), "records": records}

    on = run([1.0, 0.5, 0.6])
    off = run([1.0, 1.0, 1.2], lb=[None, 0.20, 0.25], reason="off")
    cost = {**run([1.0, 0.21, 0.26], reason="extended"), "placements": {"extend/x": 2.0}}
    doc = compare_document(on, off, cost=cost)
    assert [r["ttft_cost_s"] for r in doc["rows"]] == [1.0, 0.21, 0.26]
    pl = doc["placement"]
    assert (pl["cost"]["p50_s"], pl["bound"]["p50_s"], pl["off"]["p99_s"]) == (0.21, 0.20, 1.2)
    assert [a["met"] for a in pl["aims"]] == [True, True]  # 1.05x the bound; under OFF
    text = comparison_text(doc)
    assert "TTFT cost ms" in text and "aggregated bound" in text and "extend/x 2" in text
    # Without the placement run the document is as before.
    assert "placement" not in compare_document(on, off)


def test_the_benchmark_knows_every_reuse_outcome_the_router_counts():
    from bidirkv.bench.runner import REUSE_OUTCOMES as BENCH
    from bidirkv.router.metrics import REUSE_OUTCOMES as ROUTER

    assert set(BENCH) == set(ROUTER)
    # An extended turn also counted as a hit at lookup is an extended turn.
    assert reuse_outcome({"reuse_hit": 1.0, "reuse_extended": 1.0}) == "extended"


def test_the_bench_waits_for_the_router_to_count_the_request():
    from bidirkv.bench.runner import request_pending

    def scrape(n):
        return promtext.parse(f'bidirkv_router_requests_total{{route="chat",outcome="ok"}} '
                              f"{n}\n")

    assert request_pending(scrape(3), scrape(3))  # answered, not counted yet
    assert not request_pending(scrape(3), scrape(4))
    assert not request_pending(scrape(3), promtext.parse("other_total 1\n"))  # not ours
    assert not request_pending(None, scrape(4)) and not request_pending(scrape(3), None)


def test_table_has_one_line_per_row_and_dashes_for_missing():
    cmp = stats.compare(rows((1, 1000, 0.4, None)), rows((1, 1000, 1.2, None)))
    text = stats.table(cmp, stats.COMPARE_COLUMNS)
    lines = text.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("| turn | context | TTFT ON ms | TTFT OFF ms | OFF/ON |")
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:5] == ["1", "1000", "400", "1200", "3.00x"]
    assert cells[5] == "-"  # no lower bound measured
    widths = {len(line) for line in lines}
    assert len(widths) == 1


def test_outputs_identical():
    on = [rec(1, 0, 0.1, 10, sha="a"), rec(2, 0, 0.1, 20, sha="b"), rec(3, 0, 0.1, 30)]
    off = [rec(1, 0, 0.2, 10, sha="a"), rec(2, 0, 0.2, 20, sha="x")]
    assert stats.outputs_identical(on, off) == (2, [(0, 2)])


PROM = """\
# TYPE bidirkv_router_reuse counter
bidirkv_router_reuse_total{outcome="hit"} 3.0
bidirkv_router_reuse_total{outcome="miss"} 1.0
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} 0.25
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 2.0
"""


def test_promtext_totals_and_deltas():
    before = promtext.parse(PROM)
    after = promtext.parse(PROM.replace("3.0", "4.0").replace("0.25", "0.5"))
    assert promtext.total(before, "bidirkv_router_reuse_total") == 4.0
    assert promtext.total(before, "bidirkv_router_reuse_total", outcome="hit") == 3.0
    assert promtext.total(before, "nope") is None
    assert promtext.delta(before, after, "vllm:nixl_xfer_time_seconds_sum") == 0.25
    # A series that appears between scrapes counts from zero; a missing scrape is None.
    assert promtext.delta({}, after, "bidirkv_router_reuse_total", outcome="hit") == 4.0
    assert promtext.delta(before, None, "bidirkv_router_reuse_total") is None
    m = promtext.deltas(before, after, {
        "hit": ("bidirkv_router_reuse_total", {"outcome": "hit"}),
        "miss": ("bidirkv_router_reuse_total", {"outcome": "miss"})})
    assert m == {"hit": 1.0, "miss": 0.0}
    assert reuse_outcome({"reuse_miss": 0.0, "reuse_hit": 1.0}) == "hit"
    assert reuse_outcome({"reuse_hit": None}) is None
    assert promtext.scrape(None) is None
    assert promtext.scrape("http://127.0.0.1:1/metrics") is None


def test_requests_and_conversations():
    text = user_text(0, 1, 2, 50)
    assert len(text.split()) == 50
    assert user_text(0, 1, 2, 50) == text and user_text(0, 1, 3, 50) != text
    conv = Conversation(0, "c0")
    body = chat_body("m", conv.ask("hello"), 8, stream=True)
    assert body["max_tokens"] == body["min_tokens"] == 8 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["skip_special_tokens"] is False and body["temperature"] == 0.0
    conv.answer(" a b")
    assert conv.turns_done == 1
    with pytest.raises(ValueError):
        conv.answer("again")
    b, h = with_conversation_id(body, "c0", "body")
    assert b["conversation_id"] == "c0" and h == {}
    b, h = with_conversation_id(body, "c0", "header")
    assert "conversation_id" not in b and h == {"X-Conversation-Id": "c0"}
    with pytest.raises(ValueError, match="must be one of body, header, none"):
        with_conversation_id(body, "c0", "cookie")
    assert "stream_options" not in chat_body("m", conv.messages, 8, stream=False)


def test_bench_config_refuses_nonsense():
    with pytest.raises(ValueError, match="new-tokens 0: must be >= 1"):
        BenchConfig(url="http://x", new_tokens=0)
    with pytest.raises(ValueError, match=">= 0"):
        BenchConfig(url="http://x", settle_s=-1)


def test_run_document_is_json_and_never_holds_the_handle_key():
    import json

    from bidirkv.bench.report import run_document
    cfg = BenchConfig(url="http://127.0.0.1:1", handle_key=b"secret-key")
    text = json.dumps(run_document(cfg, [], 1.0))
    assert "secret-key" not in text and "handle_key" not in text
