"""The agent trace's figures (pure): per kind of request, ON against OFF and the bound,
what reused, whether the outputs equal OFF's, and the aims.

A record is one request of one run (bidirkv/demoagents.py writes them): the trace's step,
session, turn and kind, its TTFT, the tokens it shares with the history it extends
(bench/agenttrace.py), the OFF run's lower bound, and what the router and the engines
counted around it. ON and OFF are matched by step: the same trace, one request at a time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bidirkv.bench import stats, turns
from bidirkv.bench.agenttrace import FORK_FIRST, KINDS, PARENT_AFTER, SUB_FIRST
from bidirkv.bench.stats import Aim, _int, _median, _ms, _ratio, _x

# Aims of the benchmark: a child's first turn at this share of OFF's TTFT or less, where
# it shares this many tokens or more with its parent; the parent's next turn always reused.
CHILD_AIM = 0.5
CHILD_MIN_SHARED = 4000
PARENT_REUSED_AIM = 1.0
CHILD_FIRST = (SUB_FIRST, FORK_FIRST)

Record = Mapping[str, Any]


def reused(rec: Record) -> bool:
    """The request reused KV another request left: read back by P, extended on decode, a
    reuse kind the router counted, or tokens decode's prefix cache had (a turn it ran whole)."""
    return (rec.get("reason") in turns.REUSED or rec.get("reuse_kind") is not None
            or (rec.get("reused_tokens") or 0) > 0)


def _by_step(records: Sequence[Record]) -> dict[int, Record]:
    return {int(r["step"]): r for r in records}


def _count(n: int, of: int) -> str:
    return f"{n}/{of}"


def kind_rows(on: Sequence[Record], off: Sequence[Record]) -> list[dict[str, Any]]:
    """One row per kind present in ON: medians of TTFT (ON, OFF, OFF's bound) and of the
    shared tokens, their ratios, and counts of the ON turns that reused and of the outputs
    equal to OFF's."""
    offs = _by_step(off)
    rows = []
    for kind in KINDS:
        mine = [r for r in on if r["kind"] == kind]
        if not mine:
            continue
        pairs = [(r, offs.get(int(r["step"]))) for r in mine]
        ttft_on = _median(r["ttft_s"] for r in mine)
        ttft_off = _median(o["ttft_s"] for _, o in pairs if o)
        bound = _median(o.get("lower_bound_s") for _, o in pairs if o)
        compared = [(r, o) for r, o in pairs if o]
        rows.append({
            "kind": kind, "n": len(mine),
            "shared_tokens": _median(r.get("shared_tokens") for r in mine),
            "ttft_on_s": ttft_on, "ttft_off_s": ttft_off, "lower_bound_s": bound,
            "off_over_on": _ratio(ttft_off, ttft_on), "on_over_bound": _ratio(ttft_on, bound),
            "reused": _count(sum(reused(r) for r in mine), len(mine)),
            "equal": _count(sum(r["text_sha"] == o["text_sha"] for r, o in compared),
                            len(compared)),
        })
    return rows


def step_rows(on: Sequence[Record], off: Sequence[Record]) -> list[dict[str, Any]]:
    """One row per request, in trace order."""
    offs = _by_step(off)
    out = []
    for r in sorted(on, key=lambda r: int(r["step"])):
        o = offs.get(int(r["step"])) or {}
        out.append({
            "step": int(r["step"]) + 1, "session": r["session"], "turn": r["turn"],
            "kind": r["kind"], "context_tokens": r.get("context_tokens"),
            "shared_tokens": r.get("shared_tokens"), "ttft_on_s": r["ttft_s"],
            "ttft_off_s": o.get("ttft_s"), "lower_bound_s": o.get("lower_bound_s"),
            "bound_cached_tokens": o.get("bound_cached_tokens"),
            "on_over_off": _ratio(r["ttft_s"], o.get("ttft_s")),
            "reused_tokens": r.get("reused_tokens"),
            "reuse": "/".join(x for x in (r.get("reason"), r.get("reuse_kind")) if x) or None,
            "placement": r.get("placement"),
            "equal": None if not o else r["text_sha"] == o["text_sha"],
        })
    return out


def failed(*runs: Mapping[str, Any]) -> int:
    """Requests that failed in the runs (each one sent again, up to its attempts),
    the lower bound's included."""
    return sum(sum(r.get("failures") or 0 for r in run["records"])
               + (run.get("bound_failures") or 0) for run in runs)


def _child_aim(on: Sequence[Record], off: Sequence[Record]) -> Aim:
    offs = _by_step(off)
    name = (f"children's first turns: TTFT <= {CHILD_AIM:g}x OFF at >= {CHILD_MIN_SHARED} "
            "shared tokens")
    pairs = [(r, offs[int(r["step"])]) for r in on if r["kind"] in CHILD_FIRST
             and (r.get("shared_tokens") or 0) >= CHILD_MIN_SHARED
             and int(r["step"]) in offs]
    if not pairs:
        return Aim(name, None, f"no child's first turn shares {CHILD_MIN_SHARED} tokens")
    worst, o = max(pairs, key=lambda p: p[0]["ttft_s"] / p[1]["ttft_s"])
    ratio = worst["ttft_s"] / o["ttft_s"]
    return Aim(name, ratio <= CHILD_AIM,
               f"highest ON/OFF {ratio:.2f}x ({worst['session']}, {worst['shared_tokens']} "
               f"shared tokens) over {len(pairs)} first turns")


def aims(on: Sequence[Record], off: Sequence[Record], failures: int) -> list[Aim]:
    after = [r for r in on if r["kind"] == PARENT_AFTER]
    n = sum(reused(r) for r in after)
    share = n / len(after) if after else None
    compared, differ = stats.outputs_identical(on, off)
    names = {(r["conversation"], r["turn"]): f"{r['session']} turn {r['turn']}" for r in on}
    return [
        _child_aim(on, off),
        Aim("the parent's next turn after a spawn reused: 100 %",
            None if share is None else share >= PARENT_REUSED_AIM,
            f"{n} of {len(after)} reused" + "".join(
                f"; turn {r['turn']}: {r.get('placement') or r.get('reason') or '-'}"
                for r in after)),
        Aim("outputs equal to OFF's (float32)", None if not compared else not differ,
            f"{compared - len(differ)} of {compared} equal"
            + (f"; differ: {', '.join(names[k] for k in differ)}" if differ else "")),
        Aim("no failed request", failures == 0, f"{failures} failed"),
    ]


def _text(v: Any) -> str:
    return "-" if v is None else str(v)


def _eq(v: bool | None) -> str:
    return "-" if v is None else "yes" if v else "NO"


KIND_COLUMNS = [
    ("kind", "kind", _text),
    ("n", "n", _int),
    ("shared_tokens", "shared tok", _int),
    ("ttft_on_s", "TTFT ON ms", _ms),
    ("ttft_off_s", "TTFT OFF ms", _ms),
    ("lower_bound_s", "bound ms", _ms),
    ("off_over_on", "OFF/ON", _x),
    ("on_over_bound", "ON/bound", _x),
    ("reused", "reused ON", _text),
    ("equal", "= OFF", _text),
]

STEP_COLUMNS = [
    ("step", "#", _int),
    ("session", "session", _text),
    ("turn", "turn", _int),
    ("kind", "kind", _text),
    ("context_tokens", "context", _int),
    ("shared_tokens", "shared", _int),
    ("ttft_on_s", "TTFT ON ms", _ms),
    ("ttft_off_s", "TTFT OFF ms", _ms),
    ("lower_bound_s", "bound ms", _ms),
    ("bound_cached_tokens", "bound cached", _int),
    ("on_over_off", "ON/OFF", _x),
    ("reused_tokens", "reused tok", _int),
    ("reuse", "ON reuse", _text),
    ("placement", "ON placement", _text),
    ("equal", "= OFF", _eq),
]


def kind_table(rows: Sequence[Mapping[str, Any]]) -> str:
    return stats.table(rows, KIND_COLUMNS)


def step_table(rows: Sequence[Mapping[str, Any]]) -> str:
    return stats.table(rows, STEP_COLUMNS)
