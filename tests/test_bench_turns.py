"""Think time between a conversation's turns and why each turn reused or not (pure)."""

import pytest

from bidirkv.bench.turns import Think, reason, refusals_delta, summary, summary_text


def test_think_time_is_seeded_within_its_range_with_pauses_on_top():
    t = Think(min_s=2, max_s=5, pause_s=40, pause_turns=(3,))
    times = [t.before(7, c, turn) for c in range(3) for turn in range(2, 6)]
    assert times == [t.before(7, c, turn) for c in range(3) for turn in range(2, 6)]
    assert times != [t.before(8, c, turn) for c in range(3) for turn in range(2, 6)]
    for c in range(3):
        assert t.before(7, c, 1) == 0  # the first turn waits for nothing
        assert 2 <= t.before(7, c, 2) <= 5
        assert 42 <= t.before(7, c, 3) <= 45
    assert Think().before(0, 0, 5) == 0
    assert Think(pause_s=31, pause_turns=(2,)).before(0, 0, 2) == 31


@pytest.mark.parametrize("kw, word", [
    ({"min_s": 3, "max_s": 1}, "min <= max"), ({"min_s": -1, "max_s": 1}, "min <= max"),
    ({"pause_s": -1}, ">= 0"), ({"pause_turns": (1,)}, ">= 2"),
])
def test_bad_think_settings_say_what_is_allowed(kw, word):
    with pytest.raises(ValueError, match=word):
        Think(**kw)


@pytest.mark.parametrize("turn, outcome, reused, refusals, want", [
    (2, "hit", 1024, {}, "hit"),
    (2, "extended", 0, {}, "extended"),  # ran whole on the decode server holding it
    (1, "miss", 0, {}, "first turn"),
    (3, "off", None, {}, "off"),
    (4, "hit", 0, {"near_expiry": 1}, "near expiry"),
    (4, "verified-partial", 0, {"released_pressure": 1}, "released under pressure"),
    (4, "hit", None, {"released_watermark": 1}, "released under pressure"),
    (4, "hit", 0, {"released_router": 1}, "released by the router"),
    (4, "hit", 0, {"released_owner_gone": 1}, "released by the router"),
    (4, "miss", 0, {}, "released by the router"),
    (4, "expired", 0, {}, "released by the router"),
    (4, "hit", 0, {"unknown": 1}, "none held"),
    (4, "dropped", 0, {}, "dropped"),
    (4, "hit", 0, {}, "other"),
])
def test_each_turn_gets_the_reason_its_counters_show(turn, outcome, reused, refusals, want):
    assert reason(turn, outcome, reused, refusals) == want


def test_refusals_between_two_residency_reports():
    before = {"refusals": {"near_expiry": 2, "unknown": 1}}
    after = {"refusals": {"near_expiry": 3, "unknown": 1, "released_pressure": 1}}
    assert refusals_delta(before, after) == {"near_expiry": 1, "released_pressure": 1}
    assert refusals_delta(None, after) == {}  # no decode report: nothing to attribute


def test_summary_counts_reasons_and_returns_within_the_cap():
    recs = [{"turn": 1, "reason": "first turn", "gap_s": None},
            {"turn": 2, "reason": "hit", "gap_s": 45.0},
            {"turn": 3, "reason": "near expiry", "gap_s": 70.0},
            {"turn": 4, "reason": "hit", "gap_s": 5.0}]
    s = summary(recs, cap_s=60)
    assert s["by_reason"] == {"hit": 2, "first turn": 1, "near expiry": 1}
    assert (s["returned_within_cap"], s["hits_within_cap"], s["returned_beyond_cap"]) == (2, 2, 1)
    assert s["max_gap_s"] == 70
    assert "2/2 later turns back within the 60 s retention cap reused" in summary_text("ON", s)


def test_agent_appends_are_seeded_within_range_with_tool_outputs():
    from bidirkv.bench.conversation import Appends

    a = Appends(50, 2000, tool_every=3, tool_words=4000)
    sizes = [a.words(0, c, t) for c in range(12) for t in range(1, 7)]
    assert sizes == [a.words(0, c, t) for c in range(12) for t in range(1, 7)]  # seeded
    assert [a.words(0, 0, t) for t in (3, 6)] == [4000, 4000]
    plain = [a.words(0, c, t) for c in range(12) for t in (1, 2, 4, 5)]
    assert all(50 <= n <= 2000 for n in plain) and len(set(plain)) > 20
    with pytest.raises(ValueError, match="need 1 <= min <= max"):
        Appends(10, 5)
    with pytest.raises(ValueError, match="words >= 1"):
        Appends(1, 5, tool_every=2)
