"""Results of the concurrent benchmark (concurrent.py): summary, tables, JSON, PNG."""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from bidirkv.bench.stats import table

LOAD_KIND = "bidirkv-bench-load"
METHOD = {
    "ttft": "client side: request sent -> first streamed content token; N requests in flight",
    "throughput": "completed requests / wall time of the run (first request to last answer)",
    "hits": "router's bidirkv_router_reuse_total{outcome=hit} over the run: turns whose "
            "decode handle was still held and was sent to prefill",
    "statistic": "p50 / p99 over requests (linear interpolation), per turn and overall",
}


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks; None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(records: Sequence[Mapping[str, Any]], wall_s: float,
            router: Mapping[str, float | None] | None = None) -> dict[str, Any]:
    ok = [r for r in records if r.get("error") is None]
    ttft = [r["ttft_s"] for r in ok]
    per_turn = []
    for turn in sorted({r["turn"] for r in records}):
        rs = [r for r in records if r["turn"] == turn]
        t = [r["ttft_s"] for r in rs if r.get("error") is None]
        ctx = [r["context_tokens"] for r in rs if r.get("context_tokens")]
        per_turn.append({"turn": turn, "requests": len(rs), "errors": len(rs) - len(t),
                         "context_tokens": sum(ctx) / len(ctx) if ctx else None,
                         "ttft_p50_s": percentile(t, 50), "ttft_p99_s": percentile(t, 99)})
    router = dict(router or {})
    return {
        "requests": len(records), "errors": len(records) - len(ok), "wall_s": wall_s,
        "throughput_rps": len(ok) / wall_s if wall_s > 0 else None,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "ttft_max_s": max(ttft) if ttft else None,
        "reuse_hits": router.get("reuse_hit"), "reused_tokens": router.get("reused_tokens"),
        "per_turn": per_turn,
    }


def document(run: Any) -> dict[str, Any]:
    recs = [r.to_json() for r in run.records]
    return {"kind": LOAD_KIND, "config": asdict(run.cfg), "host": {"cpus": os.cpu_count()},
            "summary": summary(recs, run.wall_s, run.router), "router": run.router,
            "records": recs, "method": METHOD}


def write_json(path: pathlib.Path, doc: Mapping[str, Any]) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True), encoding="utf-8")
    return path


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _num(v: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


RUN_COLUMNS = [
    ("label", "run", str), ("requests", "requests", _num), ("errors", "errors", _num),
    ("wall_s", "wall s", lambda v: _num(v, "{:.1f}")),
    ("throughput_rps", "req/s", lambda v: _num(v, "{:.2f}")),
    ("ttft_p50_s", "TTFT p50 ms", _ms), ("ttft_p99_s", "TTFT p99 ms", _ms),
    ("ttft_max_s", "TTFT max ms", _ms), ("reuse_hits", "reuse hits", _num),
]
TURN_COLUMNS = [
    ("label", "run", str), ("turn", "turn", _num), ("context_tokens", "context", _num),
    ("ttft_p50_s", "TTFT p50 ms", _ms), ("ttft_p99_s", "TTFT p99 ms", _ms),
    ("errors", "errors", _num),
]


def comparison_text(docs: Mapping[str, Mapping[str, Any]]) -> str:
    """Tables of several runs of the same load (label -> document)."""
    runs = [{"label": label, **doc["summary"]} for label, doc in docs.items()]
    turns = [{"label": label, **row} for label, doc in docs.items()
             for row in doc["summary"]["per_turn"]]
    return table(runs, RUN_COLUMNS) + "\n\n" + table(turns, TURN_COLUMNS)


def ttft_over_time_plot(docs: Mapping[str, Mapping[str, Any]], path: pathlib.Path,
                        title: str) -> pathlib.Path:
    """Each request's TTFT at the time it was sent, one series per run; failures as x."""
    from bidirkv.bench.plots import _pyplot, save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (label, doc), marker in zip(docs.items(), ("o", "s", "^", "D"), strict=False):
        recs = doc["records"]
        ok = [r for r in recs if r.get("error") is None]
        ax.scatter([r["start_s"] for r in ok], [r["ttft_s"] * 1000 for r in ok], s=14,
                   marker=marker, alpha=0.75, label=f"{label} ({len(ok)} ok)")
        bad = [r for r in recs if r.get("error") is not None]
        if bad:
            ax.scatter([r["start_s"] for r in bad], [0] * len(bad), marker="x", color="red",
                       label=f"{label} errors ({len(bad)})")
    ax.set_yscale("log")
    ax.set_xlabel("request sent at (s since the run started)")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return save(plt, fig, path)
