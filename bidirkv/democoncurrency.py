"""The concurrency phase of `make demo` (also `python -m bidirkv.democoncurrency`):
start the local stack, load the decode server alone and the router with vLLM's own load
generator (`vllm bench serve`) at concurrency 1 and 4, print the table (with the CPU time
the servers of each target used per request) and the aims, write JSON and a plot
(bidirkv/bench/pdload.py)."""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "local.yaml"
OUT = ROOT / "out" / "demo"


def run(spec_path: pathlib.Path, out: pathlib.Path, *, concurrencies: tuple[int, ...] = (1, 4),
        num_prompts: int = 48, progress: bool = True, patch: dict[str, Any] | None = None,
        rounds: int = 1, pin_client: bool = True) -> list[dict[str, Any]]:
    """Start a stack from the spec, measure it (`measure`), stop it."""
    from bidirkv.local.cli import prepare_stack, tiny_model_for

    tiny_model_for(spec_path, ROOT, progress)
    stack = prepare_stack(spec_path, out / "stack-concurrency", patch=patch, cwd=ROOT,
                          progress=progress)
    with stack:
        stack.start(progress=progress)
        return measure(stack, out, concurrencies=concurrencies, num_prompts=num_prompts,
                       rounds=rounds, pin_client=pin_client)


def measure(stack: Any, out: pathlib.Path, *, concurrencies: tuple[int, ...] = (1, 4),
            num_prompts: int = 48, rounds: int = 1, pin_client: bool = True
            ) -> list[dict[str, Any]]:
    """vllm bench serve against a running stack's decode server alone, then its router;
    the table, the aims, JSON and a plot. Prompts are fresh per run (a new seed), so
    whatever the stack served before is in no cache they hit. With `pin_client` the load
    generator runs on the router's cores (bidirkv/local/cpuset.py), off decode's, where
    it would wait behind decode's spinning threads for both targets alike."""
    from bidirkv.bench import pdload
    from bidirkv.local.cpu import read_cpu
    from bidirkv.local.cpuset import pinned_thread

    spec = stack.spec.model
    served, model = spec.served_name or spec.name, spec.name
    targets = [(pdload.SINGLE, stack.urls("decode")[0]), (pdload.ROUTER, stack.router_url)]
    print(f"    {num_prompts} prompts of 512 random tokens, 16 output tokens, per "
          f"run; targets: {targets[0][1]} (decode alone), {targets[1][1]} (router)",
          flush=True)

    def shown(r: dict[str, Any]) -> None:
        cpu = r.get("cpu_ms_per_request")
        print(f"    {r['label']:<20} c={r['concurrency']}: {r['request_throughput']:.2f} "
              f"req/s, TTFT p50 {r['median_ttft_ms']:.0f} ms, ITL p50 "
              f"{r['median_itl_ms']:.1f} ms"
              + (f", servers' CPU {cpu:.0f} ms/request" if cpu is not None else ""),
              flush=True)

    policy = str(stack.spec.router.placement.policy)
    aims = pdload.aims_for(policy)
    print(f"    router placement: {policy}", flush=True)
    # The single server is the decode server; through the router all three serve.
    serving = {pdload.SINGLE: ("decode",), pdload.ROUTER: ("prefill", "decode", "router")}
    choice = stack.plan.cpu_choice
    client = choice.cores if pin_client and choice is not None else None
    print(f"    {stack.cpu_line()}; the load generator "
          + ("too" if client is not None else "on any core"), flush=True)
    with pinned_thread(client):
        results = pdload.run_matrix(targets, served, model, concurrencies, num_prompts,
                                    on_result=shown, rounds=rounds,
                                    cpu=lambda label: stack.cpu_seconds(serving[label]))
    print(pdload.table(results, aims))
    decided = placements(stack.router_url)
    print("    the router's placements: " + (", ".join(f"{k} {v:g}" for k, v in decided.items())
                                             or "none (alwaysDisaggregate)"))
    cpu = read_cpu()
    paths = pdload.write(results, out, "1P1D vLLM CPU, tiny model: decode server alone vs "
                         f"router (P/D, placement {policy}), vllm bench serve\n"
                         f"{cpu.model} ({cpu.isa()})", aims, policy)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return results


def placements(router_url: str) -> dict[str, float]:
    """The router's placement decisions so far, `decision/reason` -> turns."""
    from bidirkv.bench.promtext import scrape

    samples = scrape(router_url + "/metrics") or {}
    out = {}
    for (name, labels), value in sorted(samples.items()):
        if name == "bidirkv_router_placements_total" and value:
            lab = dict(labels)
            out[f"{lab.get('decision')}/{lab.get('reason')}"] = value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bidirkv.democoncurrency",
                                description=__doc__.split("\n")[0])
    p.add_argument("--spec", type=pathlib.Path, default=SPEC)
    p.add_argument("--out", type=pathlib.Path, default=OUT)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--concurrency", type=int, action="append",
                   help="repeatable; default 1 and 4")
    p.add_argument("--placement", choices=("cost", "alwaysDisaggregate", "thresholds"),
                   help="the router's placement policy (default: the spec's)")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs per target and concurrency, alternating (the aims compare "
                   "each round's pair, then take the median)")
    p.add_argument("--free-client", action="store_true",
                   help="leave the load generator on any core (default: the router's "
                   "cores, off decode's)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: must be at least 1")
    t = time.monotonic()
    patch = {"router": {"placement": {"policy": args.placement}}} if args.placement else None
    run(args.spec, args.out.resolve(), concurrencies=tuple(args.concurrency or (1, 4)),
        num_prompts=args.num_prompts, progress=not args.no_progress, patch=patch,
        rounds=args.rounds, pin_client=not args.free_client)
    print(f"done in {time.monotonic() - t:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
