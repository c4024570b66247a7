"""Per-turn statistics, ON/OFF comparison, the printed table and the aims (pure).

A turn's figure is the median over conversations (robust to one request that met a
noisy neighbour on a shared 2-core machine).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# Aims on the CPU stack (2 cores, tiny model, any CPU and dtype), from the issues.
SPEEDUP_AIM = 3.0  # OFF/ON TTFT ...
SPEEDUP_MIN_CONTEXT = 8000  # ... at this context and above
LOWER_BOUND_AIM = 1.3  # ON/lower bound TTFT ...
LOWER_BOUND_MIN_CONTEXT = 4000  # ... at this context and above


def _median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _metric(rec: Mapping[str, Any], key: str) -> float | None:
    value = (rec.get("metrics") or {}).get(key)
    return float(value) if value is not None else None


def per_turn(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per turn of one run: medians over its conversations."""
    turns = sorted({int(r["turn"]) for r in records})
    rows = []
    for t in turns:
        rs = [r for r in records if int(r["turn"]) == t]
        prefill = _median(_metric(r, "prefill_s") for r in rs)
        transfer = _median(_metric(r, "p_transfer_s") for r in rs)
        compute = _median(_metric(r, "p_compute_s") for r in rs)
        reused_router = _median(_metric(r, "reused_tokens") for r in rs)
        reused_p = _median(_metric(r, "p_external_hit_tokens") for r in rs)
        outcomes = sorted({r.get("reuse") for r in rs if r.get("reuse")})
        reasons = sorted({r.get("reason") for r in rs if r.get("reason")})
        rows.append({
            "turn": t,
            "n": len(rs),
            "context_tokens": _median(r.get("context_tokens") for r in rs),
            "ttft_s": _median(r["ttft_s"] for r in rs),
            "lower_bound_s": _median(r.get("lower_bound_s") for r in rs),
            "prefill_s": prefill,
            "transfer_s": transfer,
            "compute_s": compute,
            "other_s": split_other(prefill, compute, transfer),
            "transfer_bytes": _median(_metric(r, "p_transfer_bytes") for r in rs),
            # P's own count (tokens loaded from D) when its metrics are reachable, else the
            # router's (from P's bidirkv report).
            "reused_tokens": reused_p if reused_p is not None else reused_router,
            "reused_tokens_router": reused_router,
            "reuse": "/".join(outcomes) or None,
            "reason": "/".join(reasons) or None,
            "gap_s": _median(r.get("gap_s") for r in rs),
        })
    return rows


def split_other(prefill: float | None, compute: float | None, transfer: float | None
                ) -> float | None:
    """Prefill leg time that is neither P's compute nor its KV read: HTTP, queueing,
    scheduling, waiting for the transfer to be polled. Never negative (clock skew)."""
    if prefill is None:
        return None
    return max(0.0, prefill - (compute or 0.0) - (transfer or 0.0))


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def compare(on: Sequence[Mapping[str, Any]], off: Sequence[Mapping[str, Any]]
            ) -> list[dict[str, Any]]:
    """Rows of per_turn(ON) and per_turn(OFF) side by side, by turn. The lower bound is
    taken from whichever run measured it."""
    off_by_turn = {r["turn"]: r for r in off}
    out = []
    for r_on in on:
        r_off = off_by_turn.get(r_on["turn"], {})
        lb = r_on.get("lower_bound_s") or r_off.get("lower_bound_s")
        out.append({
            "turn": r_on["turn"],
            "context_tokens": r_on.get("context_tokens") or r_off.get("context_tokens"),
            "ttft_on_s": r_on.get("ttft_s"),
            "ttft_off_s": r_off.get("ttft_s"),
            "speedup": _ratio(r_off.get("ttft_s"), r_on.get("ttft_s")),
            "lower_bound_s": lb,
            "on_over_lower_bound": _ratio(r_on.get("ttft_s"), lb),
            "prefill_on_s": r_on.get("prefill_s"),
            "compute_on_s": r_on.get("compute_s"),
            "transfer_on_s": r_on.get("transfer_s"),
            "other_on_s": r_on.get("other_s"),
            "prefill_off_s": r_off.get("prefill_s"),
            "compute_off_s": r_off.get("compute_s"),
            "transfer_off_s": r_off.get("transfer_s"),
            "other_off_s": r_off.get("other_s"),
            "transfer_on_bytes": r_on.get("transfer_bytes"),
            "reused_tokens_on": r_on.get("reused_tokens"),
            "reuse_on": r_on.get("reuse"),
            "reason_on": r_on.get("reason"),
            "gap_on_s": r_on.get("gap_s"),
        })
    return out


def with_run(rows: Sequence[Mapping[str, Any]], other: Sequence[Mapping[str, Any]],
             name: str) -> list[dict[str, Any]]:
    """`rows` with another run's per-turn TTFT and reuse reason as `ttft_<name>_s` and
    `reason_<name>` (the placement phase of the demo)."""
    by_turn = {r["turn"]: r for r in other}
    return [{**r, f"ttft_{name}_s": by_turn.get(r["turn"], {}).get("ttft_s"),
             f"reason_{name}": by_turn.get(r["turn"], {}).get("reason")} for r in rows]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    xs = sorted(values)
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, int(-(-q * len(xs) // 100)) - 1))]


def later_ttfts(records: Sequence[Mapping[str, Any]], key: str = "ttft_s") -> list[float]:
    """TTFTs (or lower bounds) of the turns that came back (turn > 1)."""
    return [r[key] for r in records if r.get("turn", 1) > 1 and r.get(key) is not None]


def placement_summary(runs: Mapping[str, Sequence[Mapping[str, Any]]],
                      bound: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """TTFT p50/p99 over the turns that came back, per run, and the aggregated bound (one
    engine with a warm prefix cache, measured before each turn of the OFF run); the aims
    of the placement: `cost` within 1.1x of the bound at p50 and at most OFF at p99."""
    out: dict[str, Any] = {}
    for name, recs in [*runs.items(), ("bound", bound)]:
        xs = later_ttfts(recs, "lower_bound_s" if name == "bound" else "ttft_s")
        out[name] = {"turns": len(xs), "p50_s": percentile(xs, 50), "p99_s": percentile(xs, 99)}
    cost, off, b = out.get("cost", {}), out.get("off", {}), out["bound"]
    p50 = _ratio(cost.get("p50_s"), b.get("p50_s"))
    p99 = _ratio(cost.get("p99_s"), off.get("p99_s"))
    out["aims"] = [
        asdict(Aim("placement cost: TTFT p50 within 1.1x of the aggregated bound",
                   _ok(p50, 1.1), f"cost/bound {_x(p50)}")),
        asdict(Aim("placement cost: TTFT p99 at most OFF's", _ok(p99, 1.0),
                   f"cost/OFF {_x(p99)}")),
    ]
    return out


def _ok(ratio: float | None, limit: float) -> bool | None:
    return None if ratio is None else ratio <= limit


def placement_text(summary: Mapping[str, Any]) -> str:
    lines = ["run                 turns  TTFT p50 ms  TTFT p99 ms"]
    labels = {"cost": "placement cost", "on": "alwaysDisaggregate", "off": "OFF",
              "bound": "aggregated bound"}
    for name, label in labels.items():
        s = summary.get(name)
        if s:
            lines.append(f"{label:<19} {s['turns']:>5}  {_ms(s['p50_s']):>11}  "
                         f"{_ms(s['p99_s']):>11}")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _int(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _mb(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e6:.1f}"


COMPARE_COLUMNS = [
    ("turn", "turn", _int),
    ("context_tokens", "context", _int),
    ("ttft_on_s", "TTFT ON ms", _ms),
    ("ttft_off_s", "TTFT OFF ms", _ms),
    ("speedup", "OFF/ON", _x),
    ("lower_bound_s", "lower bound ms", _ms),
    ("on_over_lower_bound", "ON/bound", _x),
    ("prefill_on_s", "prefill ON ms", _ms),
    ("compute_on_s", "compute ON", _ms),
    ("transfer_on_s", "KV read ON", _ms),
    ("prefill_off_s", "prefill OFF ms", _ms),
    ("compute_off_s", "compute OFF", _ms),
    ("reused_tokens_on", "reused tok", _int),
    ("transfer_on_bytes", "read MB", _mb),
    ("gap_on_s", "gap ON s", _int),
    ("reason_on", "ON reuse", lambda v: v or "-"),
]

# The placement phase's run (placement `cost`), beside ON and OFF.
COST_COLUMNS = [
    ("ttft_cost_s", "TTFT cost ms", _ms),
    ("reason_cost", "cost reuse", lambda v: v or "-"),
]

RUN_COLUMNS = [
    ("turn", "turn", _int),
    ("context_tokens", "context", _int),
    ("ttft_s", "TTFT ms", _ms),
    ("lower_bound_s", "lower bound ms", _ms),
    ("prefill_s", "prefill ms", _ms),
    ("compute_s", "compute ms", _ms),
    ("transfer_s", "KV read ms", _ms),
    ("reused_tokens", "reused tok", _int),
    ("transfer_bytes", "read MB", _mb),
    ("reuse", "router reuse", lambda v: v or "-"),
    ("gap_s", "gap s", _int),
    ("reason", "reason", lambda v: v or "-"),
]


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, Any]]) -> str:
    """A Markdown table (also readable as plain text)."""
    head = [title for _, title, _ in columns]
    body = [[fmt(row.get(key)) for key, _, fmt in columns] for row in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
              for i, h in enumerate(head)]
    lines = ["| " + " | ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for b in body:
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(b, widths, strict=True))
                     + " |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Aim:
    name: str
    met: bool | None  # None: no turn qualified (context too short, no lower bound)
    detail: str


def check_aims(rows: Sequence[Mapping[str, Any]]) -> list[Aim]:
    out = []
    big = [r for r in rows if (r.get("context_tokens") or 0) >= SPEEDUP_MIN_CONTEXT
           and r.get("speedup") is not None]
    if big:
        worst = min(big, key=lambda r: r["speedup"])
        met = worst["speedup"] >= SPEEDUP_AIM
        detail = (f"lowest OFF/ON at >= {SPEEDUP_MIN_CONTEXT} tokens: {worst['speedup']:.2f}x "
                  f"(turn {worst['turn']}, context {worst['context_tokens']:.0f})")
    else:
        met, detail = None, f"no turn reached {SPEEDUP_MIN_CONTEXT} tokens of context"
    out.append(Aim(f"OFF/ON >= {SPEEDUP_AIM:g}x at >= {SPEEDUP_MIN_CONTEXT} tokens", met, detail))
    near = [r for r in rows if (r.get("context_tokens") or 0) >= LOWER_BOUND_MIN_CONTEXT
            and r.get("on_over_lower_bound") is not None]
    if near:
        worst = max(near, key=lambda r: r["on_over_lower_bound"])
        met = worst["on_over_lower_bound"] <= LOWER_BOUND_AIM
        detail = (f"highest ON/bound at >= {LOWER_BOUND_MIN_CONTEXT} tokens: "
                  f"{worst['on_over_lower_bound']:.2f}x (turn {worst['turn']}, context "
                  f"{worst['context_tokens']:.0f})")
    else:
        met, detail = None, (f"no turn with a lower bound at >= {LOWER_BOUND_MIN_CONTEXT} "
                             "tokens")
    out.append(Aim(f"ON <= {LOWER_BOUND_AIM:g}x lower bound at >= {LOWER_BOUND_MIN_CONTEXT} "
                   "tokens", met, detail))
    return out


def format_aims(aims: Sequence[Aim]) -> str:
    mark = {True: "met", False: "NOT met", None: "not measured"}
    return "\n".join(f"- {a.name}: {mark[a.met]} ({a.detail})" for a in aims)


def outputs_identical(on: Sequence[Mapping[str, Any]], off: Sequence[Mapping[str, Any]]
                      ) -> tuple[int, list[tuple[int, int]]]:
    """(pairs compared, [(conversation, turn) that differ]) between two runs."""
    off_by = {(r["conversation"], r["turn"]): r["text_sha"] for r in off}
    compared, differ = 0, []
    for r in on:
        key = (r["conversation"], r["turn"])
        if key in off_by:
            compared += 1
            if off_by[key] != r["text_sha"]:
                differ.append(key)
    return compared, differ
