"""The long-context phase's schedule, its router-restart row and its tables (pure).

One conversation grows in a few large appends (a word is a token with the tiny model) to
64k tokens and more, and after each an agent's turn (a short append, what a tool result
or a user's reply adds): ON, OFF and the lower bound each turn. The large appends get
there in a few turns; the agent's turns are what a long conversation costs turn after
turn, and where reading the history back pays (OFF recomputes all of it either way).
The ON stack then runs two short turns with the same append, one before a router restart
and one after it, so the turn after the restart is measured against the same turn
without one: a router that forgot the conversation would recompute the whole history
(OFF's cost), one that recalled it reads the history back from decode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bidirkv.bench import stats
from bidirkv.bench.stats import _int, _ms, _x

STEP, BEFORE, AFTER = "step", "before restart", "after restart"
# "At >= 32k / >= 64k tokens": the contexts the phase reports OFF/ON at.
REPORT_CONTEXTS = (32768, 65536)
# A turn that adds at most this many words is an agent's turn (a tool result, a reply).
AGENT_WORDS = 4096
# The restart is meant at a context whose note passed decode's former 64 KiB cap (~1,500
# blocks of 32 tokens): the figure says whether the run got there.
RESTART_MIN_CONTEXT = 56000


@dataclass(frozen=True)
class LongTurn:
    turn: int  # 1-based
    words: int  # user words this turn adds
    kind: str  # STEP, BEFORE or AFTER


def plan_turns(steps: Sequence[int], restart_words: int) -> list[LongTurn]:
    """The growing turns, then the turns before and after the router restart."""
    if not steps:
        raise ValueError("steps: at least one append is needed")
    for value in (*steps, restart_words):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"steps and restart words: {value!r}: each must be an integer "
                             ">= 1 (user words a turn adds)")
    turns = [LongTurn(i + 1, w, STEP) for i, w in enumerate(steps)]
    n = len(turns)
    return [*turns, LongTurn(n + 1, restart_words, BEFORE),
            LongTurn(n + 2, restart_words, AFTER)]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def restart_row(records: Sequence[Mapping[str, Any]], plan: Sequence[LongTurn],
                restart: Mapping[str, Any]) -> dict[str, Any]:
    """The ON run's turn after the router restart against its turn before it (the same
    append); `restart`: how the restart went (pids, stop and start seconds, recall)."""
    kind = {t.turn: t.kind for t in plan}
    by_kind = {kind.get(int(r["turn"])): r for r in records}
    before, after = by_kind.get(BEFORE), by_kind.get(AFTER)
    if before is None or after is None:
        raise ValueError("the ON run has no turn before and after the router restart")
    metrics = after.get("metrics") or {}
    at = (before.get("context_tokens") or 0) + (before.get("output_tokens") or 0)
    return {
        "turn": after["turn"],
        "restart_at_tokens": at,
        "restart_at_or_past_aim": at >= RESTART_MIN_CONTEXT,
        "context_before_tokens": before.get("context_tokens"),
        "context_tokens": after.get("context_tokens"),
        "ttft_after_s": after["ttft_s"],
        "ttft_before_s": before["ttft_s"],
        "after_over_before": _ratio(after["ttft_s"], before["ttft_s"]),
        # The router's count, from P's reuse report, and P's own (tokens loaded from D).
        "reused_tokens": metrics.get("reused_tokens"),
        "p_loaded_tokens": metrics.get("p_external_hit_tokens"),
        "reuse": after.get("reuse"),
        "reason": after.get("reason"),
        **dict(restart),
    }


def agent_turns(plan: Sequence[LongTurn]) -> set[int]:
    """The turns of `plan` that add at most AGENT_WORDS (an agent's turn)."""
    return {t.turn for t in plan if t.kind == STEP and t.words <= AGENT_WORDS}


def _lowest(rows: Sequence[Mapping[str, Any]], floor: int) -> dict[str, Any] | None:
    big = [r for r in rows if (r.get("context_tokens") or 0) >= floor
           and r.get("speedup") is not None]
    worst = min(big, key=lambda r: r["speedup"]) if big else None
    return None if worst is None else {
        "ratio": worst["speedup"], "turn": worst["turn"],
        "context_tokens": worst["context_tokens"]}


def report_ratios(rows: Sequence[Mapping[str, Any]],
                  agents: set[int] | None = None) -> dict[str, Any]:
    """The lowest OFF/ON at each of REPORT_CONTEXTS and above, over every turn and over
    the agent's turns (`agents`), and the highest ON/bound over the turns that came back
    (a first turn has nothing to read back)."""
    out: dict[str, Any] = {}
    mine = [r for r in rows if r["turn"] in (agents or set())]
    for floor in REPORT_CONTEXTS:
        out[f"off_over_on_at_{floor}"] = _lowest(rows, floor)
        out[f"agent_off_over_on_at_{floor}"] = _lowest(mine, floor)
    bounded = [r for r in rows if r["turn"] > 1 and r.get("on_over_lower_bound") is not None]
    worst = max(bounded, key=lambda r: r["on_over_lower_bound"]) if bounded else None
    out["on_over_bound_max"] = None if worst is None else {
        "ratio": worst["on_over_lower_bound"], "turn": worst["turn"],
        "context_tokens": worst["context_tokens"]}
    return out


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _mb(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e6:.0f}"


LONG_COLUMNS = [
    ("turn", "turn", _int),
    ("context_tokens", "context", _int),
    ("ttft_on_s", "TTFT ON s", _s),
    ("ttft_off_s", "TTFT OFF s", _s),
    ("speedup", "OFF/ON", _x),
    ("lower_bound_s", "lower bound s", _s),
    ("on_over_lower_bound", "ON/bound", _x),
    ("compute_on_s", "P compute ON s", _s),
    ("transfer_on_s", "KV read ON ms", _ms),
    ("transfer_on_bytes", "read MB", _mb),
    ("reused_tokens_on", "reused tok", _int),
    ("reason_on", "ON reuse", lambda v: v or "-"),
]

RESTART_COLUMNS = [
    ("restart_at_tokens", "restart at", _int),
    ("context_tokens", "next turn's context", _int),
    ("ttft_after_s", "TTFT after restart s", _s),
    ("ttft_before_s", "TTFT before (same append) s", _s),
    ("after_over_before", "after/before", _x),
    ("reused_tokens", "reused tok (P's report)", _int),
    ("reason", "reuse", lambda v: v or "-"),
    ("router_back_s", "router serving after s", _s),
    ("recall_s", "handle recalled after s", _s),
]


def long_table(rows: Sequence[Mapping[str, Any]]) -> str:
    return stats.table(rows, LONG_COLUMNS)


def restart_table(row: Mapping[str, Any]) -> str:
    return stats.table([row], RESTART_COLUMNS)


def ratios_text(ratios: Mapping[str, Any]) -> str:
    lines = []
    for floor in REPORT_CONTEXTS:
        for key, what in (("agent_off_over_on_at_", "an agent's turn"),
                          ("off_over_on_at_", "any turn, growth steps included")):
            r = ratios.get(f"{key}{floor}")
            lines.append(f"- OFF/ON at >= {floor} tokens, {what}: " + (
                "no turn got there" if r is None else
                f"{r['ratio']:.2f}x (lowest; turn {r['turn']}, "
                f"{r['context_tokens']:.0f} tokens)"))
    r = ratios.get("on_over_bound_max")
    lines.append("- ON/lower bound: " + ("not measured" if r is None else
                 f"at most {r['ratio']:.2f}x (turn {r['turn']}, "
                 f"{r['context_tokens']:.0f} tokens)"))
    return "\n".join(lines)
