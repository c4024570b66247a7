"""Tenants against decode's retention: one run of the figures (not a test).

Each row is a `Row` in ROWS: a measurement, the figures it returns, and the aims they are
held to. A row added later (an extend at the retention watermark, `cache_salt` TTFT
across tenants, both on real vLLM) needs only its `measure`, its aims and a line of the
table.

- decode reclaim, many tenants: N tenant labels each hold `--entries` retained requests
  of one block (gaps spread, some without one); the scheduler step's own call,
  `Residency.reclaim(releases, "watermark")` (bidirkv/connector/core/residency.py, the
  call bidirkv/connector/patches/residency.py makes under the residency's lock), then
  releases `--releases` of them. Timed around that call, at N = 50, 500 and 5,000, over
  `--repeats` fresh residencies each. Aim: the median at the most tenants at most 10x
  the median at the fewest (a scan over every tenant per release grows with them, 100x
  here). `--residency-at REV` times the residency.py of an earlier commit instead, for a
  before-and-after in one sitting.

Prints a table, writes out/bench/tenancy.json and, with matplotlib, docs/img/tenancy.png.

    .venv/bin/python benchmarks/tenancy_bench.py
    # before and after aa8570b (indexed release orders), in one sitting:
    .venv/bin/python benchmarks/tenancy_bench.py --residency-at aa8570b^ \
        --out out/bench/before --img out/bench/before/tenancy.png
    .venv/bin/python benchmarks/tenancy_bench.py --before out/bench/before/tenancy.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bidirkv.connector.core.residency import Residency  # noqa: E402
from bidirkv.local.cpu import read_cpu  # noqa: E402

RETENTION_S = 900.0  # the entries' deadline: far beyond the run, so none nears expiry


@dataclass
class Row:
    name: str
    measure: Callable[[argparse.Namespace], dict[str, Any]]
    # (aim's name, test of the figures, the figure shown for it)
    aims: list[tuple[str, Callable[[dict[str, Any]], bool], Callable[[dict[str, Any]], str]]]
    # the lines of the printed table for this row's figures
    table: Callable[[dict[str, Any]], list[str]]


# -- decode reclaim, many tenants -------------------------------------------------------------
def residency_at(rev: str) -> type[Residency]:
    """`Residency` as residency.py was at commit `rev` (its imports resolve in this tree)."""
    path = "bidirkv/connector/core/residency.py"
    got = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"],
                         capture_output=True, text=True)
    if got.returncode != 0:
        raise SystemExit(f"--residency-at {rev!r}: git has no {path} there "
                         f"({got.stderr.strip()})")
    module = types.ModuleType(f"residency_at_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(got.stdout, f"{rev}:{path}", "exec"), module.__dict__)
    return module.Residency


def filled(tenants: int, entries: int, cls: type[Residency] = Residency) -> Residency:
    """A residency whose `tenants` labels each hold `entries` one-block requests, as the
    router leaves them: most with a gap (spread, so each tenant's order has work to do),
    every fourth without (ranked by the typical gap)."""
    res = cls()
    deadline = res.clock() + RETENTION_S
    for i in range(tenants):
        tenant = f"tenant-{i:05d}"
        for j in range(entries):
            gap = None if j % 4 == 3 else float(1 + (i * 7 + j * 13) % 60)
            res.retain(f"req-{i}-{j}", 1, None, deadline, tenant=tenant, gap=gap)
    return res


def reclaim_ms(res: Residency, releases: int) -> float:
    """The scheduler step's reclaim at the watermark, timed (it takes and drops the
    residency's lock itself, so this is the time under it plus the call)."""
    gc.collect()
    t0 = time.perf_counter()
    got = res.reclaim(releases, "watermark")
    ms = (time.perf_counter() - t0) * 1000
    if got != releases:
        raise RuntimeError(f"reclaim released {got} blocks, wanted {releases}: the "
                           "residency holds too few entries for --releases")
    return ms


def measure_reclaim(args: argparse.Namespace) -> dict[str, Any]:
    if args.entries * min(args.tenants) < args.releases:
        raise SystemExit(f"--entries {args.entries} x {min(args.tenants)} tenants holds "
                         f"fewer than --releases {args.releases} entries")
    cls = residency_at(args.residency_at) if args.residency_at else Residency
    points = []
    for n in args.tenants:
        runs = [reclaim_ms(filled(n, args.entries, cls), args.releases)
                for _ in range(args.repeats)]
        points.append({"tenants": n, "entries": n * args.entries, "runs_ms": runs,
                       "median_ms": statistics.median(runs), "max_ms": max(runs)})
        print(f"  {n} tenants: median {points[-1]['median_ms']:.2f} ms", flush=True)
    return {"residency": args.residency_at or "working tree", "releases": args.releases,
            "entries_per_tenant": args.entries, "repeats": args.repeats, "points": points,
            "growth": points[-1]["median_ms"] / points[0]["median_ms"]}


def reclaim_table(f: dict[str, Any]) -> list[str]:
    lines = [f"  {'tenants':>8}{'entries':>9}{'median ms':>11}{'max ms':>9}"
             f"  ({f['releases']} releases, {f['repeats']} repeats, residency.py "
             f"of {f['residency']})"]
    lines += [f"  {p['tenants']:>8}{p['entries']:>9}{p['median_ms']:>11.2f}{p['max_ms']:>9.2f}"
              for p in f["points"]]
    return lines


ROWS = [
    Row("decode reclaim, many tenants", measure_reclaim,
        [("median grows <=10x over the tenants", lambda f: f["growth"] <= 10.0,
          lambda f: f"{f['growth']:.2f}x ({f['points'][0]['tenants']} -> "
                    f"{f['points'][-1]['tenants']} tenants)")],
        reclaim_table),
]


def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"machine": {**read_cpu().to_json(),
                                          "python": platform.python_version()},
                              "rows": {}, "aims": {}}
    for row in ROWS:
        print(f"{row.name} ...", flush=True)
        figures = row.measure(args)
        result["rows"][row.name] = figures
        for aim, holds, _ in row.aims:
            result["aims"][f"{row.name}: {aim}"] = holds(figures)
    return result


def report(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [f"CPU: {m['model']} ({m['arch']}, {m['isa']}), {m['cores']} cores"]
    for row in ROWS:
        figures = r["rows"].get(row.name)
        if figures is None:
            continue
        lines += ["", row.name, *row.table(figures)]
        for aim, holds, shown in row.aims:
            lines.append(f"  aim {aim}: {'met' if holds(figures) else 'NOT met'}, "
                         f"{shown(figures)}")
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path, before: dict[str, Any] | None = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    f = r["rows"].get("decode reclaim, many tenants")
    if not f:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [p["tenants"] for p in f["points"]]
    ax.plot(xs, [p["median_ms"] for p in f["points"]], "o-", label=f"median, {f['residency']}")
    ax.plot(xs, [p["max_ms"] for p in f["points"]], "v--", label=f"max, {f['residency']}")
    old = (before or {}).get("rows", {}).get("decode reclaim, many tenants")
    if old:
        ax.plot([p["tenants"] for p in old["points"]], [p["median_ms"] for p in old["points"]],
                "s:", color="grey", label=f"median, {old['residency']}")
        ax.set_yscale("log")
    ax.set_xscale("log")
    if not old:
        ax.set_ylim(bottom=0)
    ax.set_xlabel("tenants holding retained entries")
    ax.set_ylabel(f"ms under the lock, {f['releases']} releases")
    ax.legend()
    ax.set_title(f"decode reclaim - {r['machine']['model']} ({r['machine']['isa']})",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", type=int, nargs="+", default=[50, 500, 5000])
    ap.add_argument("--entries", type=int, default=8, help="retained requests per tenant")
    ap.add_argument("--releases", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--residency-at", metavar="REV",
                    help="time residency.py as it was at this commit (default: this tree)")
    ap.add_argument("--before", type=Path, metavar="JSON",
                    help="a tenancy.json of an earlier run (--residency-at) to plot beside")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench")
    ap.add_argument("--img", type=Path, default=ROOT / "docs" / "img" / "tenancy.png")
    args = ap.parse_args()
    for name in ("entries", "releases", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} {getattr(args, name)}: must be at least 1")
    if min(args.tenants) < 1:
        ap.error(f"--tenants {args.tenants}: each must be at least 1")
    args.tenants = sorted(args.tenants)
    before = json.loads(args.before.read_text()) if args.before else None
    result = run(args)
    print()
    print(report(result))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tenancy.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.img, before)
    print(f"\nwrote {args.out / 'tenancy.json'} and {args.img}")
    return 0 if all(result["aims"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
