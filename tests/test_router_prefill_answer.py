"""What the router reads of P's answer (legs.prefill_answer): the reuse it reports and
the work the cost model learns from, from P's bidirkv report or, without one, usage."""

from __future__ import annotations

import pytest

from bidirkv.router.datapath.legs import PrefillWork, ReuseReport, prefill_answer

USAGE = {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 40}}


@pytest.mark.parametrize("where", ["kv_transfer_params", "beside"])
def test_the_bidirkv_report_wins_over_usage(where):
    report = {"reused_tokens": 60, "offered_tokens": 64, "recomputed_tokens": 38}
    body = {"usage": USAGE, **({"kv_transfer_params": {"bidirkv": report}}
                               if where == "kv_transfer_params" else {"bidirkv": report})}
    assert prefill_answer(body) == (ReuseReport(60, "bidirkv", True), PrefillWork(100, 38, 60))


def test_without_recomputed_tokens_p_computed_what_it_did_not_read():
    body = {"usage": {"prompt_tokens": 100},
            "kv_transfer_params": {"bidirkv": {"reused_tokens": 64, "offered_tokens": 64}}}
    assert prefill_answer(body) == (ReuseReport(64, "bidirkv", False), PrefillWork(100, 36, 64))


def test_without_a_report_usage_cached_tokens_are_the_reuse_and_read_nothing():
    assert prefill_answer({"usage": USAGE}) == (ReuseReport(40, "usage_cached", False),
                                                PrefillWork(100, 60, 0))


@pytest.mark.parametrize("body", [
    {}, {"usage": "x"}, {"usage": {"prompt_tokens": 0}}, {"usage": {"prompt_tokens": True}},
    {"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": -1}}}])
def test_what_p_does_not_say_is_not_guessed(body):
    report, work = prefill_answer(body)
    assert report is None
    assert work == (PrefillWork(9, 9, 0) if body.get("usage", {}) == {
        "prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": -1}} else None)
