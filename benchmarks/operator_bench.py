"""Operator benchmark against the in-memory API server (real kopf, real HTTP).

Measures
  1. time from creating one DisaggregatedInference to all nine children written
     (sequential creations, p50/p99);
  2. time for N resources created at once to converge (all children + status);
  3. writes made by a reconcile pass with nothing to change (an operator restart).
Prints a table and writes JSON and a PNG (latency distribution) to --out.

    python benchmarks/operator_bench.py [--single 40] [--burst 50] [--out out/bench]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The test API server lives with the tests (tests/kubeapi), outside the product package.
sys.path.insert(0, str(ROOT / "tests"))

from kubeapi.operatorenv import api_server, di_path, running_operator  # noqa: E402

CHILDREN = 9


def spec(name: str) -> dict:
    return {
        "apiVersion": "bidirkv.io/v1alpha1",
        "kind": "DisaggregatedInference",
        "metadata": {"name": name, "namespace": "bench"},
        "spec": {"model": {"name": "Qwen/Qwen3-32B"}, "decode": {"replicas": 2}},
    }


def children_written(server, name: str) -> int:
    n = 0
    for gv, res, comp in [("v1", "services", "prefill"), ("v1", "services", "decode"),
                          ("v1", "services", "router"), ("v1", "configmaps", "router"),
                          ("apps/v1", "statefulsets", "prefill"),
                          ("apps/v1", "statefulsets", "decode"),
                          ("apps/v1", "deployments", "router"),
                          ("policy/v1", "poddisruptionbudgets", "prefill"),
                          ("policy/v1", "poddisruptionbudgets", "decode")]:
        n += server.get(gv, res, "bench", f"{name}-{comp}") is not None
    return n


def has_status(server, name: str) -> bool:
    obj = server.get("bidirkv.io/v1alpha1", "disaggregatedinferences", "bench", name)
    return bool(obj and (obj.get("status") or {}).get("conditions"))


async def wait_for(pred, timeout: float) -> None:
    deadline = time.perf_counter() + timeout
    while not pred():
        if time.perf_counter() > deadline:
            raise TimeoutError("benchmark condition not reached")
        await asyncio.sleep(0.002)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def run(args: argparse.Namespace) -> dict:
    results: dict = {}
    async with api_server() as (server, client):
        async with running_operator(client) as controller:
            latencies = []
            for i in range(args.single):
                name = f"single-{i}"
                t0 = time.perf_counter()
                await client.call("POST", di_path("bench"), spec(name))
                await wait_for(lambda n=name: children_written(server, n) == CHILDREN, 30)
                latencies.append(time.perf_counter() - t0)
                print(f"\r  single {i + 1}/{args.single}", end="", file=sys.stderr)
            print(file=sys.stderr)
            await controller.idle()
            results["single"] = {
                "n": len(latencies),
                "p50_s": statistics.median(latencies),
                "p99_s": pct(latencies, 0.99),
                "samples_s": latencies,
            }

            t0 = time.perf_counter()
            names = [f"burst-{i}" for i in range(args.burst)]
            await asyncio.gather(*(client.call("POST", di_path("bench"), spec(n))
                                   for n in names))
            await wait_for(lambda: all(children_written(server, n) == CHILDREN
                                       and has_status(server, n) for n in names), 120)
            results["burst"] = {"n": args.burst, "converge_s": time.perf_counter() - t0}
            await controller.idle(120)

        server.requests.clear()
        async with running_operator(client) as controller:
            await asyncio.sleep(1.0)
            await controller.idle(120)
            results["restart"] = {
                "resources": args.single + args.burst,
                "reconciles": controller.reconciles,
                "writes": len(server.writes()),
            }
    return results


def report(results: dict, out: pathlib.Path) -> None:
    s, b, r = results["single"], results["burst"], results["restart"]
    rows = [
        ("create -> all children written, p50", f"{s['p50_s'] * 1000:.0f} ms", "<= 500 ms"),
        ("create -> all children written, p99", f"{s['p99_s'] * 1000:.0f} ms", ""),
        (f"{b['n']} resources at once -> converged", f"{b['converge_s']:.1f} s", "<= 30 s"),
        (f"restart, {r['resources']} unchanged resources: writes",
         str(r["writes"]), "0"),
    ]
    width = max(len(a) for a, _, _ in rows)
    print(f"{'measure':<{width}}  {'result':>10}  aim")
    for a, v, aim in rows:
        print(f"{a:<{width}}  {v:>10}  {aim}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "operator_bench.json").write_text(json.dumps(results, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG written", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist([x * 1000 for x in s["samples_s"]], bins=20, color="#4c72b0")
    ax.axvline(s["p50_s"] * 1000, color="k", linestyle="--", label="p50")
    ax.set_xlabel("create -> 9 children written (ms)")
    ax.set_ylabel("resources")
    ax.set_title("bidir-kv operator against the in-memory API server")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "operator_bench.png", dpi=120)
    print(f"wrote {out / 'operator_bench.json'} and {out / 'operator_bench.png'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--single", type=int, default=40, help="sequential creations")
    parser.add_argument("--burst", type=int, default=50, help="resources created at once")
    parser.add_argument("--out", default="out/bench", help="folder for JSON and PNG")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    report(results, pathlib.Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
