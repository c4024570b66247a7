"""Benchmark results as JSON + PNG + a printed table."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from bidirkv.bench import stats, turns
from bidirkv.bench.runner import BenchConfig, TurnRecord
from bidirkv.local.cpu import read_cpu

RUN_KIND = "bidirkv-bench-run"
COMPARE_KIND = "bidirkv-bench-compare"

METHOD = {
    "ttft": "client side: request sent -> first streamed content token (one request at a time)",
    "context_tokens": "prompt tokens of the turn, as the server reports (usage.prompt_tokens)",
    "prefill": "the router's prefill leg: request to P -> P's reply "
               "(bidirkv_router_leg_duration_seconds{leg=prefill})",
    "compute": "P's own prefill time (vllm:request_prefill_time_seconds): computing what was "
               "not read from D",
    "kv_read": "P's NIXL reads from D (vllm:nixl_xfer_time_seconds, bytes from "
               "vllm:nixl_bytes_transferred); the rest of the leg is HTTP, queueing, scheduling",
    "reused_tokens": "tokens P loaded from D instead of computing "
                     "(vllm:external_prefix_cache_hits on P; else the router's count from P's "
                     "bidirkv report)",
    "lower_bound": "the same prompt sent straight to a server whose local prefix cache holds "
                   "the conversation's history (the OFF run's decode server, prefix caching on, "
                   "which decoded the previous turns), just before the turn is sent through the "
                   "router: it computes only the new tokens, with no KV transfer and no second "
                   "leg. Prefix-cache hits are whole 128-token blocks, so up to 127 history "
                   "tokens are recomputed, as with a read from D",
    "statistic": "per turn, the median over conversations",
    "reason": "why a turn reused or not, from the router's outcome, P's reads and D's "
              "refusals during the request (bidirkv/bench/turns.py)",
    "gap": "seconds from a conversation's previous answer to this turn's request: its think "
           "time plus the other conversations' turns served meanwhile",
}


def config_json(cfg: BenchConfig) -> dict[str, Any]:
    """The run's settings as JSON; the handle key is a secret (and bytes): never written."""
    doc = asdict(cfg)
    doc.pop("handle_key", None)
    return doc


def run_document(cfg: BenchConfig, records: Sequence[TurnRecord], wall_s: float,
                 loadavg: Mapping[str, float] | None = None,
                 retention_cap_s: float | None = None) -> dict[str, Any]:
    """One run; `retention_cap_s` (decode's decoderKvBlocksTtlSeconds, where known) splits
    the turns that came back within it from those beyond it."""
    recs = [r.to_json() for r in records]
    return {
        "kind": RUN_KIND,
        "config": config_json(cfg),
        "wall_s": wall_s,
        "reuse_reasons": turns.summary(recs, retention_cap_s),
        "host": {"cpus": os.cpu_count(), "cpu": read_cpu().to_json(),
                 "loadavg_1min": dict(loadavg or {})},
        "per_turn": stats.per_turn(recs),
        "records": recs,
        "method": METHOD,
    }


def load_run(path: str | pathlib.Path) -> dict[str, Any]:
    path = pathlib.Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read benchmark run {path}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("kind") != RUN_KIND:
        raise ValueError(f"{path} is not a benchmark run ({RUN_KIND}) written by bidir-kv bench")
    return doc


def write_json(path: pathlib.Path, doc: Mapping[str, Any]) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return path


def compare_document(on: Mapping[str, Any], off: Mapping[str, Any],
                     extra: Mapping[str, Any] | None = None,
                     cost: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """ON (alwaysDisaggregate) against OFF, per turn; with `cost`, the run under placement
    `cost` beside them and the placement's TTFT percentiles against the bound."""
    rows = stats.compare(on["per_turn"], off["per_turn"])
    placement = None
    if cost is not None:
        rows = stats.with_run(rows, cost["per_turn"], "cost")
        placement = stats.placement_summary(
            {"cost": cost["records"], "on": on["records"], "off": off["records"]},
            off["records"])
        placement["decisions"] = cost.get("placements", {})
    compared, differ = stats.outputs_identical(on["records"], off["records"])
    aims = stats.check_aims(rows)
    return {
        "kind": COMPARE_KIND,
        "rows": rows,
        "aims": [asdict(a) for a in aims],
        "outputs": {"compared": compared, "differ": differ,
                    "note": "in float32 ON and OFF outputs must be identical (also checked by "
                            "e2e/test_local_stack.py); bf16 greedy output of a random-weight "
                            "model is not reproducible across runs (near-tied logits)"},
        "method": METHOD,
        "runs": {"on": dict(on), "off": dict(off), **({"cost": dict(cost)} if cost else {})},
        **({"placement": placement} if placement is not None else {}),
        **(dict(extra) if extra else {}),
    }


def write_comparison(out_dir: pathlib.Path, doc: Mapping[str, Any], title: str
                     ) -> dict[str, pathlib.Path]:
    from bidirkv.bench.plots import prefill_plot, ttft_plot

    rows = doc["rows"]
    return {
        "json": write_json(out_dir / "bench.json", doc),
        "ttft_png": ttft_plot(rows, out_dir / "ttft_vs_context.png", f"TTFT vs context: {title}"),
        "prefill_png": prefill_plot(rows, out_dir / "prefill_split.png",
                                    f"Prefill duration split: {title}"),
    }


def comparison_text(doc: Mapping[str, Any]) -> str:
    aims = [stats.Aim(**a) for a in doc["aims"]]
    placement = doc.get("placement")
    columns = stats.COMPARE_COLUMNS
    if placement is not None:
        columns = [*columns, *stats.COST_COLUMNS]
        aims += [stats.Aim(**a) for a in placement["aims"]]
    parts = [stats.table(doc["rows"], columns)]
    if placement is not None:
        decisions = ", ".join(f"{k} {v:g}" for k, v in placement["decisions"].items())
        parts += ["", "Placement (turns that came back; the cost run's decisions: "
                  f"{decisions or 'none recorded'}):", stats.placement_text(placement)]
    return "\n".join([*parts, "", "Aims:", stats.format_aims(aims)])


def method_text() -> str:
    return "\n".join(f"  {k}: {v}" for k, v in METHOD.items())
