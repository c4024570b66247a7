"""The offline yardsticks of the pressure benchmark (bidirkv/bench/retention.py)."""

from __future__ import annotations

import pytest

from bidirkv.bench.retention import POLICIES, Request, requests_of, simulate, yardsticks


def round_robin(conversations: int, turns: int, blocks: int = 1) -> list[Request]:
    """One request at a time, conversations in turn: what LRU handles worst."""
    out, t = [], 0.0
    for turn in range(1, turns + 1):
        for c in range(conversations):
            out.append(Request(c, turn, t, t + 1.0, blocks))
            t += 2.0
    return out


def test_room_for_everyone_hits_every_returning_turn():
    reqs = round_robin(3, 3)
    for policy in POLICIES:
        out = simulate(reqs, capacity_blocks=10, policy=policy)
        assert (out.hits, out.returning, out.releases) == (6, 6, 0)


def test_round_robin_past_capacity_defeats_lru_not_the_oracle_nor_the_value_rule():
    # Three conversations, room for two blocks: LRU releases exactly the conversation
    # that comes back next, every time; the oracle keeps more than half, and so does the
    # rule decode follows, from the past alone (returns.py).
    reqs = round_robin(3, 4)
    lru = simulate(reqs, capacity_blocks=2, policy="lru")
    oracle = simulate(reqs, capacity_blocks=2, policy="oracle")
    value = simulate(reqs, capacity_blocks=2, policy="value")
    assert (lru.hits, lru.returning) == (0, 9)
    assert oracle.hits == 5 and value.hits == 5


def test_a_running_request_takes_room_from_what_is_kept():
    # A kept 2 blocks; B runs with 3 of a capacity of 4: A must go, whatever the policy.
    reqs = [Request(0, 1, 0.0, 1.0, 2), Request(1, 1, 2.0, 3.0, 3), Request(0, 2, 4.0, 5.0, 2)]
    for policy in POLICIES:
        out = simulate(reqs, capacity_blocks=4, policy=policy)
        assert (out.hits, out.releases) == (0, 2)


def test_records_become_requests_with_their_blocks():
    records = [
        {"conversation": 0, "turn": 1, "start_s": 0.0, "total_s": 1.5, "context_tokens": 1000},
        {"conversation": 0, "turn": 2, "start_s": 3.0, "total_s": None, "error": "HTTP 500",
         "context_tokens": None},
        {"conversation": 1, "turn": 1, "start_s": 0.5, "total_s": 1.0, "context_tokens": 97},
    ]
    reqs = requests_of(records, block_tokens=128, output_tokens=32)
    assert reqs == [Request(0, 1, 0.0, 1.5, 9), Request(1, 1, 0.5, 1.5, 2)]
    assert set(yardsticks(records, 128, 128, 32)) == {"lru", "value", "oracle"}


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy 'fifo': must be one of lru, value, oracle"):
        simulate([], 1, "fifo")


def test_the_demo_reports_measured_hits_against_both_yardsticks():
    from bidirkv.demo import PRESSURE, block_tokens, retention

    spec = {"engine": {"extraArgs": ["--enforce-eager", "--block-size=128"]}}
    assert block_tokens(spec) == 128 and block_tokens({}) == 16
    words = PRESSURE["first_tokens"]
    records = [{"conversation": c, "turn": t, "start_s": 10.0 * t + c, "total_s": 1.0,
                "context_tokens": words + 300 * (t - 1)}
               for t in (1, 2) for c in range(3)]
    doc = {"records": records, "router": {"reuse_hit": 1, "reuse_verified-partial": 1,
                                          "reuse_extended": 1}}
    figures, text = retention(doc, spec)
    assert "of 3 returning turns: measured 3" in text
    assert figures == {"measured_hits": 3, "returning": 3, "lru_hits": 3, "value_hits": 3,
                       "oracle_hits": 3}
    assert "(1.00x) and >= LRU (met)" in text
