"""The P/D path under concurrency, measured with vLLM's own load generator against the
decode server alone (the reference: one vLLM server, no P/D) and through the router, in
the same run, on prompts no prefix cache has seen (a fresh seed per run).

Aims (this 2-core machine), by the router's placement policy. Under `cost` (the
default), where a turn with nothing on decode runs whole on an idle decode server: the
router adds at most 5 ms of TTFT p50 at concurrency 1, and reaches >= 1.3x the single
server's req/s at concurrency 4 (the two servers share the prompts). With every turn on
two legs (`alwaysDisaggregate`, `thresholds`): P/D overhead at concurrency 1 <= 20 ms and
req/s at concurrency 4 >= the single server's. Both: TTFT p99 at concurrency 4 <= 2x, and
ITL p50 through the router at most 1 ms above the single server's at every concurrency
(lower is no problem: P/D takes prefill off the decode server).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

from bidirkv.bench.vllmbench import ServeRun, run

SINGLE, ROUTER = "decode server alone", "router (P/D)"
AIMS = {"overhead_ms": 20.0, "throughput_ratio": 1.0, "p99_ratio": 2.0, "itl_delta_ms": 1.0}
COST_AIMS = {**AIMS, "overhead_ms": 5.0, "throughput_ratio": 1.3}


def aims_for(policy: str) -> dict[str, float]:
    return COST_AIMS if policy == "cost" else AIMS


def run_matrix(targets: Sequence[tuple[str, str]], model: str, tokenizer: str,
               concurrencies: Sequence[int] = (1, 4), num_prompts: int = 48,
               input_len: int = 512, output_len: int = 16, seed: int = 1000,
               on_result: Callable[[dict[str, Any]], None] | None = None,
               rounds: int = 1, cpu: Callable[[str], float] | None = None
               ) -> list[dict[str, Any]]:
    """Every (concurrency, target) pair `rounds` times, targets alternating so that
    drift in the machine's load hits both alike; each run gets prompts of its own.
    `cpu(label)`: the CPU seconds used so far by the processes serving that target; each
    run then records their CPU time per request."""
    results = []
    for c in concurrencies:
        for n in range(rounds):
            for label, url in targets:
                seed += 1
                before = cpu(label) if cpu is not None else None
                r = run(ServeRun(url=url, model=model, tokenizer=tokenizer, concurrency=c,
                                 num_prompts=num_prompts if c > 1
                                 else max(16, num_prompts // 2),
                                 input_len=input_len, output_len=output_len, seed=seed,
                                 label=label))
                r["round"] = n
                r["cpu_ms_per_request"] = cpu_per_request(
                    before, cpu(label) if cpu is not None else None, r["completed"])
                results.append(r)
                if on_result is not None:
                    on_result(r)
    return results


def cpu_per_request(before: float | None, after: float | None, completed: int | None
                    ) -> float | None:
    """Milliseconds of the serving processes' CPU per completed request (the run's whole
    span, the client's start-up included, in which the servers sit idle)."""
    if before is None or after is None or not completed:
        return None
    return (after - before) * 1000 / completed


def _by(results: list[dict[str, Any]], label: str, c: int, n: int = 0
        ) -> dict[str, Any] | None:
    return next((r for r in results if r["label"] == label and r["concurrency"] == c
                 and r.get("round", 0) == n), None)


def _median(values: list[float]) -> float:
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def verdicts(results: list[dict[str, Any]], aims: dict[str, float] = AIMS
             ) -> list[dict[str, Any]]:
    """Per concurrency: the router against the single server of the same round, and each
    aim met or not; with several rounds, the median of the rounds' comparisons."""
    out = []
    for c in sorted({r["concurrency"] for r in results}):
        pairs = [(s, p) for n in sorted({r.get("round", 0) for r in results})
                 if (s := _by(results, SINGLE, c, n)) is not None
                 and (p := _by(results, ROUTER, c, n)) is not None]
        if not pairs:
            continue
        row: dict[str, Any] = {
            "concurrency": c,
            "rounds": len(pairs),
            "overhead_ms": _median([p["median_ttft_ms"] - s["median_ttft_ms"]
                                    for s, p in pairs]),
            "throughput_ratio": _median([p["request_throughput"] / s["request_throughput"]
                                         for s, p in pairs]),
            "p99_ratio": _median([p["p99_ttft_ms"] / s["p99_ttft_ms"] for s, p in pairs]),
            "itl_delta_ms": _median([p["median_itl_ms"] - s["median_itl_ms"]
                                     for s, p in pairs]),
        }
        cpu = [p["cpu_ms_per_request"] / s["cpu_ms_per_request"] for s, p in pairs
               if p.get("cpu_ms_per_request") and s.get("cpu_ms_per_request")]
        if cpu:
            row["cpu_ratio"] = _median(cpu)
        row["itl_ok"] = row["itl_delta_ms"] <= aims["itl_delta_ms"]
        if c == 1:
            row["overhead_ok"] = row["overhead_ms"] <= aims["overhead_ms"]
        else:
            row["throughput_ok"] = row["throughput_ratio"] >= aims["throughput_ratio"]
            row["p99_ok"] = row["p99_ratio"] <= aims["p99_ratio"]
        out.append(row)
    return out


def table(results: list[dict[str, Any]], aims: dict[str, float] = AIMS) -> str:
    head = (f"{'target':<22} {'conc':>4} {'req/s':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'ITL p50':>8} {'CPU/req':>8} {'failed':>6}")
    lines = [head, "-" * len(head)]
    for r in results:
        cpu = r.get("cpu_ms_per_request")
        lines.append(f"{r['label']:<22} {r['concurrency']:>4} {r['request_throughput']:>6.2f} "
                     f"{r['median_ttft_ms']:>7.0f}ms {r['p99_ttft_ms']:>7.0f}ms "
                     f"{r['median_itl_ms']:>6.1f}ms "
                     + (f"{cpu:>6.0f}ms" if cpu is not None else f"{'-':>8}")
                     + f" {r['failed']:>6}")
    lines.append("")
    for v in verdicts(results, aims):
        parts = [f"c={v['concurrency']}" + (f" (median of {v['rounds']} rounds)"
                                             if v["rounds"] > 1 else "") + ":"]
        if "overhead_ok" in v:
            parts.append(f"P/D overhead {v['overhead_ms']:+.1f} ms (aim <= "
                         f"{aims['overhead_ms']:.0f}) {'met' if v['overhead_ok'] else 'NOT met'};")
        if "throughput_ok" in v:
            parts.append(f"req/s ratio {v['throughput_ratio']:.2f} (aim >= "
                         f"{aims['throughput_ratio']:g}) "
                         f"{'met' if v['throughput_ok'] else 'NOT met'}; TTFT p99 ratio "
                         f"{v['p99_ratio']:.2f} (aim <= 2) {'met' if v['p99_ok'] else 'NOT met'};")
        parts.append(f"ITL p50 {v['itl_delta_ms']:+.1f} ms (aim <= +1) "
                     f"{'met' if v['itl_ok'] else 'NOT met'}")
        if "cpu_ratio" in v:
            parts[-1] += ";"
            parts.append(f"servers' CPU per request {v['cpu_ratio']:.2f}x the single "
                         "server's")
        lines.append(" ".join(parts))
    return "\n".join(lines)


def write(results: list[dict[str, Any]], out: pathlib.Path, title: str,
          aims: dict[str, float] = AIMS, policy: str | None = None) -> dict[str, str]:
    """JSON and a PNG (req/s, TTFT p50/p99, ITL p50 per target and concurrency)."""
    from bidirkv.bench.plots import _pyplot, save

    out.mkdir(parents=True, exist_ok=True)
    path = out / "concurrency.json"
    path.write_text(json.dumps({"runs": results, "verdicts": verdicts(results, aims),
                                "aims": aims, "placement": policy}, indent=2) + "\n")
    plt = _pyplot()
    concs = sorted({r["concurrency"] for r in results})
    labels = [SINGLE, ROUTER]
    panels = [("request_throughput", "requests/s"), ("median_ttft_ms", "TTFT p50 (ms)"),
              ("p99_ttft_ms", "TTFT p99 (ms)"), ("median_itl_ms", "ITL p50 (ms)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 3.6))
    width = 0.38
    for ax, (key, name) in zip(axes, panels, strict=True):
        for i, label in enumerate(labels):
            vals = [_median([r[key] or 0 for r in results
                             if r["label"] == label and r["concurrency"] == c] or [0])
                    for c in concs]
            ax.bar([x + (i - 0.5) * width for x in range(len(concs))], vals, width,
                   label=label)
        ax.set_xticks(range(len(concs)), [f"c={c}" for c in concs])
        ax.set_title(name)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    png = save(plt, fig, out / "concurrency.png")
    return {"json": str(path), "plot": str(png)}
