"""The drop-vs-drain benchmark's pure parts (bidirkv/bench/lifecycle.py): when its events
fire, which turns each is judged on, the table and the verdict."""

from __future__ import annotations

import pytest

from bidirkv.bench import lifecycle as lc


def test_schedule_places_three_events_with_turns_after_each():
    evs = lc.schedule(8)
    assert [(e.target, e.action, e.after_turn) for e in evs] == [
        ("decode-0", lc.RESTART, 2), ("decode-1", lc.LEAVE, 4), ("router", lc.RESTART, 6)]
    assert [e.after_turn for e in lc.schedule(4)] == [1, 2, 3]
    for turns in range(4, 30):
        at = [e.after_turn for e in lc.schedule(turns)]
        assert at == sorted(set(at)) and 1 <= at[0] and at[-1] < turns
    # The pause falls on the first turn after the scale-down: decode-1 waits for it.
    assert lc.pause_turn(evs) == 5
    with pytest.raises(ValueError, match=r"turns 3: the three events need at least 4 turns"):
        lc.schedule(3)


def test_next_step_holds_conversations_at_the_event_barrier():
    evs = lc.schedule(4)  # after turns 1, 2, 3
    due = {0: 5.0, 1: 1.0, 2: 1.0}
    # Ties on the due time go by index; a conversation past the barrier waits.
    assert lc.next_step({0: 0, 1: 0, 2: 0}, due, evs, 0, 4) == ("turn", 1)
    assert lc.next_step({0: 0, 1: 1, 2: 0}, due, evs, 0, 4) == ("turn", 2)
    assert lc.next_step({0: 0, 1: 1, 2: 1}, due, evs, 0, 4) == ("turn", 0)
    # Every conversation answered turn 1: the first event, before any turn 2.
    assert lc.next_step({0: 1, 1: 1, 2: 1}, due, evs, 0, 4) == ("event", 0)
    assert lc.next_step({0: 1, 1: 1, 2: 1}, due, evs, 1, 4) == ("turn", 1)
    # Past the last event the trace runs out its turns, then ends.
    assert lc.next_step({0: 3, 1: 4, 2: 3}, due, evs, 3, 4) == ("turn", 2)
    assert lc.next_step({0: 4, 1: 4, 2: 4}, due, evs, 3, 4) is None


def rec(conv, turn, ttft, reason="hit", sha="a", failed=0):
    return {"conversation": conv, "turn": turn, "ttft_s": ttft, "reason": reason,
            "text_sha": sha, "failed_attempts": failed}


def event(mode, held, after=2, target="decode-0", stop_s=10.0):
    return {"event": {"name": f"rollout of {target}", "target": target, "action": "restart",
                      "after_turn": after}, "mode": mode, "held": held, "stop_s": stop_s,
            "start_s": 50.0, "drain_end": "drained" if mode == "drain" else None}


def runs_of(drop_recs, drain_recs, base_recs, off_recs, drop_stop=0.1, drain_stop=12.0):
    return {
        "off": {"records": off_recs, "events": [], "failed_attempts": 0},
        "baseline": {"records": base_recs, "events": [], "failed_attempts": 0},
        "drop": {"records": drop_recs, "events": [event("drop", [0, 1], stop_s=drop_stop)],
                 "failed_attempts": sum(r["failed_attempts"] for r in drop_recs)},
        "drain": {"records": drain_recs, "events": [event("drain", [0, 1],
                                                          stop_s=drain_stop)],
                  "failed_attempts": 0},
    }


BASE = [rec(0, 3, 0.5), rec(1, 3, 0.7), rec(2, 3, 0.6)]


def test_an_event_is_judged_on_the_first_turn_after_it_of_each_held_conversation():
    drain = [rec(0, 2, 0.4), rec(0, 3, 0.6), rec(1, 3, 0.8, "released by the router"),
             rec(2, 3, 9.9), rec(0, 4, 9.9)]
    row = lc.event_row({"records": drain}, event("drain", [0, 1]), BASE, grace_s=180.0)
    assert (row["held"], row["returned"], row["reused"], row["reuse_share"]) == (2, 2, 1, 0.5)
    # Nearest rank: p50 of two is the lower, p99 the higher; conversation 2 (not held)
    # and turn 4 (not the first after) are not counted.
    assert (row["ttft_p50_s"], row["ttft_p99_s"]) == (0.6, 0.8)
    assert (row["base_p50_s"], row["base_p99_s"]) == (0.5, 0.7)
    assert row["reasons"] == {"hit": 1, "released by the router": 1}
    assert (row["grace_s"], row["within_grace"]) == (180.0, True)
    late = lc.event_row({"records": drain}, event("drain", [0], stop_s=200.0), BASE, 180.0)
    assert late["within_grace"] is False
    # A drop has no drain to time, nor a router restart.
    assert lc.event_row({"records": drain}, event("drop", [0]), BASE, 180.0)["grace_s"] is None
    router = lc.event_row({"records": drain}, event("drain", [0], target="router"), BASE, 180)
    assert router["within_grace"] is None


def test_table_and_verdict():
    drop = [rec(0, 3, 2.0, "released by the router"), rec(1, 3, 2.1, "none held", failed=1)]
    drain = [rec(0, 3, 0.5), rec(1, 3, 0.6, "extended")]
    off = [rec(0, 3, 2.0), rec(1, 3, 2.0)]
    runs = runs_of(drop, drain, BASE, off)
    rows = lc.rows(runs, grace_s=180.0)
    assert [(r["mode"], r["reused"]) for r in rows] == [("drop", 0), ("drain", 2)]
    text = lc.table_text(rows)
    lines = text.splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:4]] == ["event", "mode", "held"]
    assert [ln.split("|")[2].strip() for ln in lines[2:]] == ["drop", "drain"]
    assert "2/2 (100 %)" in text and "0/2 (0 %)" in text
    aims = {a.name: a for a in lc.verdict(rows, runs)}
    assert aims["drain: >= 90% of the returning turns held on the leaving server reuse, "
                "per event"].met is True
    assert aims["drop: no failed request"].met is False
    assert aims["drain: no failed request"].met is True
    assert aims["drain: outputs equal reuse-off"].met is True
    assert aims["drain: each drain within the grace period"].met is True

    # One output that differs from reuse-off, a drain past the grace period, one
    # returning turn of two that recomputed: each is named as not met.
    drain_bad = [rec(0, 3, 0.5, sha="b"), rec(1, 3, 0.6, "none held")]
    runs = runs_of(drop, drain_bad, BASE, off, drain_stop=181.0)
    rows = lc.rows(runs, grace_s=180.0)
    aims = {a.name: a for a in lc.verdict(rows, runs)}
    reuse = aims["drain: >= 90% of the returning turns held on the leaving server reuse, "
                 "per event"]
    assert reuse.met is False and "lowest 1/2" in reuse.detail
    equal = aims["drain: outputs equal reuse-off"]
    assert equal.met is False and "1/2 equal" in equal.detail and "[0, 3]" in equal.detail
    assert aims["drain: each drain within the grace period"].met is False


def test_verdict_without_runs_says_not_measured():
    aims = lc.verdict([], {})
    assert [a.met for a in aims] == [None]
