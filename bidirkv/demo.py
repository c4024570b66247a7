"""`make demo`: the control plane in a few seconds, then a real 1P1D vLLM stack on this
machine and the multi-turn TTFT benchmark with bidirectional KV transfer ON and OFF, their
headline table first; the longer phases behind flags (`--all`: `make demo-all`).

1. Control plane: the in-memory Kubernetes API server, the CRD, the real operator;
   examples/local.yaml applied and its children listed (skip: --skip-control-plane).
2. The tiny model is built locally (no download).
3. examples/local.yaml runs as local processes (P, D, router: exactly what the operator
   renders, pod IPs mapped to 127.0.0.1) and the benchmark runs against the router.
4. The same spec with kvTransfer.bidirectional false (on the servers too, not only the
   router: pinned blocks on D would steal CPU), the benchmark again, plus the lower bound;
   the OFF/ON table.
5. --with-placement: the same benchmark under the spec's placement `cost`.
   --with-concurrency: vllm bench serve against the decode server alone and the router (on
   the placement run's stack, or a stack of its own).
6. --with-pressure: decode limited to 128 KV blocks and vLLM's default 480 s retention,
   more conversations than it can keep, 4 requests in flight (the concurrent benchmark), ON
   then OFF: retained KV must never make new work wait (--only-pressure: only this).
7. Tables, JSON and PNGs in out/demo/; bench.json also records the run (its commit, date
   and wall times: bidirkv/bench/stamp.py), which `make headline` writes README's
   headline from; --with-span-tree: one returning turn's trace from the router's span file
   (ON stack), as a tree of its spans.

Every process started is stopped at the end, on failure, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

from bidirkv.bench import stamp
from bidirkv.bench.conversation import Appends
from bidirkv.wire import RESIDENCY_PATH

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "local.yaml"
OUT = ROOT / "out" / "demo"

# Sized for a 2-core machine and a 15-minute budget on AVX2-only CPUs in float32 (measured
# on an AMD EPYC Zen 3: 3 conversations x 10 turns made the whole demo 16 min; OFF's last
# turns alone take 12-19 s each there): 9 turns of +1000 tokens reach ~9.4k tokens of
# context, 2 conversations. Between turns a conversation thinks 1-5 s (seeded), and
# before turn 5 it pauses 35 s more, an agent's tool call: longer than decode's former
# 30 s retention, so the run shows a conversation that comes back late still reusing.
DEFAULTS = {"conversations": 2, "turns": 9, "new_tokens": 1000, "output_tokens": 48,
            "think": (1.0, 5.0), "pause_s": 35.0, "pause_turn": 5}


# `--trace agent`: what an agent's turns add (words are tokens with the tiny model).
AGENT_APPENDS = Appends(min_words=50, max_words=2000, tool_every=3, tool_words=4000)


def step(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def _use_test_api_server() -> None:
    """The control-plane phase runs the operator against the repository's test API server
    (tests/kubeapi), which the installed package does not carry."""
    tests = pathlib.Path(__file__).resolve().parents[1] / "tests"
    if not (tests / "kubeapi").is_dir():
        raise SystemExit("the demo runs from a clone of the repository: its control-plane "
                         f"phase needs the test API server in {tests / 'kubeapi'}")
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))


# -- 1. control plane --------------------------------------------------------------------
async def control_plane(spec_path: pathlib.Path) -> None:
    import yaml

    from bidirkv.local import printer
    _use_test_api_server()
    from kubeapi.operatorenv import (
        api_server,
        di_path,
        eventually,
        resource,
        running_operator,
    )

    doc = yaml.safe_load(spec_path.read_text())
    name, ns = doc["metadata"]["name"], doc["metadata"].get("namespace", "default")
    async with api_server() as (server, client), running_operator(client) as controller:
        print(f"    API server {server.url}; CRD installed; operator running")
        await client.call("POST", di_path(ns), resource(doc))

        async def status():
            di = await client.get("DisaggregatedInference", ns, name)
            return di if (di.get("status") or {}).get("conditions") else None

        di = await eventually(status, what="status")
        await controller.idle()
        for method, _, body in controller.client.sent:
            if method == "POST":
                print(f"    created {body['kind']} {body['metadata']['name']}")
        print(printer.table([di]))
    print("    the next steps run these same rendered containers as local processes")


ALWAYS_DISAGGREGATE = {"router": {"placement": {"policy": "alwaysDisaggregate"}}}

# Decode KV limited so that retained conversations fill it; vLLM's default retention (the
# local spec shortens it), so a stall would show as minutes, not seconds.
PRESSURE = {"blocks": 128, "conversations": 12, "turns": 4, "concurrency": 4, "think_s": 1.0,
            "first_tokens": 1000, "new_tokens": 250, "output_tokens": 32}


def pressure_patch(spec: dict[str, Any], bidirectional: bool) -> dict[str, Any]:
    args = [a for a in spec.get("engine", {}).get("extraArgs", [])
            if not a.startswith("--num-gpu-blocks-override")]
    return {"engine": {"extraArgs": [*args, f"--num-gpu-blocks-override={PRESSURE['blocks']}"]},
            "kvTransfer": {"bidirectional": bidirectional, "decoderKvBlocksTtlSeconds": 480},
            # Every returning turn reads back what decode kept: the retention is measured
            # against the trace's yardsticks (the default placement has its own figures).
            "router": {"conversationTtlSeconds": 420,
                       "placement": {"policy": "alwaysDisaggregate"}}}


def run_pressure(label: str, patch: dict[str, Any], args: argparse.Namespace
                 ) -> dict[str, Any]:
    from bidirkv.bench import concurrent, loadreport
    from bidirkv.local.cli import prepare_stack

    progress = not args.no_progress
    stack = prepare_stack(args.spec, args.out / f"stack-pressure-{label}", patch=patch,
                          cwd=ROOT, progress=progress)
    with stack:
        stack.start(progress=progress)
        knobs = {k: v for k, v in PRESSURE.items() if k != "blocks"}
        cfg = concurrent.ConcurrentConfig(url=stack.router_url, label=label, **knobs)
        doc = loadreport.document(concurrent.run(cfg, progress=progress))
    print(f"    stopped P, D and router of the pressure {label.upper()} stack", flush=True)
    return doc


def pressure(args: argparse.Namespace, timed: Callable[[str, Callable[[], Any]], Any]) -> None:
    from bidirkv.bench import loadreport
    from bidirkv.local.cli import tiny_model_for
    from bidirkv.local.plan import read_spec_file

    spec = read_spec_file(args.spec)
    tiny_model_for(args.spec, ROOT, not args.no_progress)
    p = PRESSURE
    print(f"    decode (and prefill) KV: {p['blocks']} blocks; {p['conversations']} "
          f"conversations x {p['turns']} turns ({p['first_tokens']} words, then "
          f"+{p['new_tokens']} a turn), {p['concurrency']} in flight, {p['think_s']:g} s "
          "think time; vLLM's default 480 s retention")
    docs = {
        "on": timed("pressure, bidirectional ON: start, concurrent benchmark, stop",
                    lambda: run_pressure("on", pressure_patch(spec, True), args)),
        "off": timed("pressure, bidirectional OFF: start, concurrent benchmark, stop",
                     lambda: run_pressure("off", pressure_patch(spec, False), args)),
    }
    step("pressure results (per request, 4 in flight)")
    print(loadreport.comparison_text(docs))
    docs["on"]["retention"], text = retention(docs["on"], spec)
    print(text)
    for label, doc in docs.items():
        loadreport.write_json(args.out / f"pressure-{label}.json", doc)
    path = loadreport.ttft_over_time_plot(
        docs, args.out / "pressure_ttft_over_time.png",
        f"TTFT under decode KV pressure ({p['blocks']} blocks, {p['concurrency']} in flight)")
    print(f"plot: {path}")


def block_tokens(spec: dict[str, Any]) -> int:
    """The spec's --block-size (engine-wide: both roles share it), vLLM's 16 without one."""
    args = spec.get("engine", {}).get("extraArgs", [])
    for i, arg in enumerate(args):
        if arg.startswith("--block-size="):
            return int(arg.split("=", 1)[1])
        if arg == "--block-size" and i + 1 < len(args):
            return int(args[i + 1])
    return 16


def retention(doc: dict[str, Any], spec: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The ON run's reuse hits against an LRU decode, decode's own rule (returns.py) and an
    all-knowing decode of the same capacity on the same trace (bidirkv/bench/retention.py):
    the figures and their text."""
    from bidirkv.bench.retention import yardsticks

    sticks = yardsticks(doc["records"], PRESSURE["blocks"], block_tokens(spec),
                        PRESSURE["output_tokens"])
    # Found their KV: read back by prefill (whole or verified in part), or extended on
    # the decode replica holding it (placement `cost` or `thresholds`).
    measured = sum(doc["router"].get(k) or 0
                   for k in ("reuse_hit", "reuse_verified-partial", "reuse_extended"))
    lru, oracle = sticks["lru"], sticks["oracle"]
    figures = {"measured_hits": measured, "returning": oracle.returning,
               **{f"{p}_hits": o.hits for p, o in sticks.items()}}
    ratio = measured / oracle.hits if oracle.hits else None
    text = (f"    reuse hits, ON, of {oracle.returning} returning turns: measured "
            f"{measured:.0f}; on the same trace and {PRESSURE['blocks']} blocks an LRU decode "
            f"{lru.hits}, decode's own rule replayed {sticks['value'].hits}, an all-knowing "
            f"one {oracle.hits}\n"
            f"    aim: >= 0.9x the all-knowing one ("
            f"{'-' if ratio is None else f'{ratio:.2f}x'}) and >= LRU "
            f"({'met' if measured >= lru.hits else 'not met'})")
    return figures, text


# -- 2-5. data plane -----------------------------------------------------------------------
def traces_file(args: argparse.Namespace, label: str) -> pathlib.Path:
    """The router's span file of the `label` stack (tracing.file, in its state dir)."""
    from bidirkv.local.engines import ROUTER_TRACES

    return args.out / f"stack-{label}" / ROUTER_TRACES


def show_trace(path: pathlib.Path) -> None:
    from bidirkv.bench.traces import returning_turn_text

    text = returning_turn_text(path)
    step("one returning turn through the router (its spans, from the ON stack)")
    print(text if text is not None else "    no request span recorded")
    print(f"traces: {path} (one span a line; every turn of the run)")


def run_phase(label: str, patch: dict[str, Any] | None, bench_kw: dict[str, Any],
              args: argparse.Namespace, lower_bound: bool,
              then: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Start a stack, run the multi-turn benchmark, then `then(stack)` on the same
    running stack (a stack start saved), stop."""
    from bidirkv.bench.client import RequestFailed
    from bidirkv.bench.report import run_document, write_json
    from bidirkv.bench.runner import BenchConfig, Runner
    from bidirkv.local.cli import prepare_stack
    from bidirkv.local.stack import StartError

    progress = not args.no_progress
    # The router appends to its span file: this run's turns only.
    traces_file(args, label).unlink(missing_ok=True)
    stack = prepare_stack(args.spec, args.out / f"stack-{label}", patch=patch, cwd=ROOT,
                          progress=progress)
    with stack:
        t = time.monotonic()
        stack.start(progress=progress)
        print(f"    P {stack.urls('prefill')[0]}  D {stack.urls('decode')[0]}  router "
              f"{stack.router_url}  (healthy after {time.monotonic() - t:.0f} s; logs in "
              f"{stack.state_dir / 'logs'})", flush=True)
        d_url = stack.urls("decode")[0]
        cfg = BenchConfig(
            url=stack.router_url, label=label, prefill_metrics=stack.urls("prefill")[0] +
            "/metrics", decode_metrics=d_url + "/metrics",
            decode_residency=d_url + RESIDENCY_PATH, handle_key=stack.handle_key(),
            lower_bound_url=d_url if lower_bound else None, **bench_kw)
        t = time.monotonic()
        runner = Runner(cfg, progress=progress)
        try:
            records = runner.run()
        except RequestFailed as exc:
            # A dead server explains a failed request better than the request does.
            raise StartError("\n".join([str(exc), *stack.exited()])) from None
        doc = run_document(cfg, records, time.monotonic() - t, runner.loadavg,
                           retention_cap_s=stack.retention_s)
        from bidirkv.democoncurrency import placements

        doc["placements"] = placements(stack.router_url)
        doc.update(run_settings(stack.spec))
        write_json(args.out / f"{label}.json", doc)
        load = runner.loadavg
        print(f"    {len(records)} turns in {time.monotonic() - t:.0f} s (1-min load average "
              f"{load.get('start', 0):.1f} -> {load.get('end', 0):.1f} on "
              f"{os.cpu_count()} cpus)", flush=True)
        if then is not None:
            then(stack)
    print(f"    stopped P, D and router of the {label.upper()} stack", flush=True)
    return doc


def run_settings(spec: Any) -> dict[str, Any]:
    """What a run's JSON records of the spec its stack ran: the README's headline names
    the placement policy its table shows (bidirkv/bench/headline.py)."""
    return {"placement_policy": spec.router.placement.policy,
            "bidirectional": spec.kv_transfer.bidirectional}


def data_plane(args: argparse.Namespace, timed: Callable[[str, Callable[[], Any]], Any],
               clock: stamp.Clock) -> int:
    from bidirkv.bench import report
    from bidirkv.bench.turns import Think, summary_text
    from bidirkv.local.cli import tiny_model_for
    from bidirkv.local.cpu import read_cpu

    cpu = read_cpu()
    model, choice = timed("tiny model", lambda: tiny_model_for(args.spec, ROOT,
                                                               not args.no_progress))
    shown = model.relative_to(ROOT) if model.is_relative_to(ROOT) else model
    print(f"    {shown}; CPU {cpu.describe()}\n    {choice.line()}")
    think = Think(min_s=args.think[0], max_s=args.think[1], pause_s=args.pause,
                  pause_turns=(args.pause_turn,) if args.pause and args.pause_turn else ())
    appends = AGENT_APPENDS if args.trace == "agent" else None
    bench_kw = {"conversations": args.conversations, "turns": args.turns,
                "new_tokens": args.new_tokens, "output_tokens": args.output_tokens,
                "warmup_turns": args.warmup_turns, "settle_s": args.settle, "think": think,
                "appends": appends}
    added = appends.describe() if appends else f"+{args.new_tokens} user tokens"
    print(f"    benchmark: {args.conversations} conversations x {args.turns} turns, "
          f"{added} and {args.output_tokens} output tokens a turn, "
          f"{think.describe()} (seeded), streamed, P prefix caching off (emulated eviction)")
    chosen = phases(args)
    # The headline first: ON and OFF, then their table, before any longer phase.
    on = timed("bidirectional ON, placement alwaysDisaggregate: start the stack from "
               "examples/local.yaml, benchmark, stop",
               lambda: run_phase("on", ALWAYS_DISAGGREGATE, bench_kw, args, lower_bound=False))
    off = timed("bidirectional OFF (servers and router): restart, benchmark + lower bound, "
                "stop", lambda: run_phase("off", {"kvTransfer": {"bidirectional": False},
                                                  **ALWAYS_DISAGGREGATE},
                                          bench_kw, args, lower_bound=True))
    meta = {"spec": str(args.spec), "cpu": cpu.to_json(),
            "dtype": {"dtype": choice.dtype, "picked": choice.picked, "reason": choice.reason}}
    step(f"headline: OFF/ON (median over conversations per turn; {cpu.model}, {choice.dtype})")
    print(report.comparison_text(report.compare_document(on, off, meta)))
    cost = extra_runs(chosen, bench_kw, args, timed)
    meta["run"] = stamp.run_stamp(clock, *stamp.git_commit(ROOT))
    doc = report.compare_document(on, off, meta, cost=cost)
    paths = report.write_comparison(
        args.out, doc, f"1P1D vLLM CPU, tiny model, {choice.dtype}\n{cpu.model} ({cpu.isa()})")
    if cost is not None:
        step("placement `cost` beside ON, OFF and the bound")
        print(report.comparison_text(doc))
    print("\nReuse by reason (turns):")
    for label, run in (("ON", on), ("cost", cost), ("OFF", off)):
        if run is not None:
            print("  " + summary_text(label, run["reuse_reasons"]))
    print("\nHow each column is measured:")
    print(report.method_text())
    print()
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def extra_runs(chosen: frozenset[str], bench_kw: dict[str, Any], args: argparse.Namespace,
               timed: Callable[[str, Callable[[], Any]], Any]) -> dict[str, Any] | None:
    """The placement run and the concurrency phase, after the headline; the placement run's
    document, or None without it."""
    from bidirkv import democoncurrency

    def concurrency(stack: Any) -> None:
        step("concurrency, same stack: decode server alone vs router (P/D), vllm bench "
             "serve at concurrency 1 and 4")
        democoncurrency.measure(stack, args.out)

    if "placement" in chosen:
        with_concurrency = "concurrency" in chosen
        return timed("bidirectional ON, default placement cost (a turn may run whole on a "
                     "decode server): restart, benchmark"
                     + (", concurrency" if with_concurrency else "") + ", stop",
                     lambda: run_phase("cost", None, bench_kw, args, lower_bound=False,
                                       then=concurrency if with_concurrency else None))
    if "concurrency" in chosen:
        timed("concurrency: a stack of its own (alwaysDisaggregate), decode server alone vs "
              "router, vllm bench serve at concurrency 1 and 4",
              lambda: democoncurrency.run(args.spec, args.out, patch=ALWAYS_DISAGGREGATE,
                                          progress=not args.no_progress))
    return None


# Every phase but the headline's (control plane, ON, OFF, the bound), each behind a flag:
# together they would take `make demo` past 15 minutes on a 2-core AVX2-only machine.
OPTIONAL_PHASES = ("placement", "concurrency", "pressure", "span-tree")


def phases(args: argparse.Namespace) -> frozenset[str]:
    """The phases a run takes, from its flags: `multi-turn` (ON, OFF and the bound: the
    headline) unless --only-pressure, `control-plane` unless skipped, and each optional phase
    with --all or its --with-* flag; a --skip-* flag wins over both."""
    if args.only_pressure:
        chosen = {"pressure"}
    else:
        chosen = {"multi-turn"} | {
            name for name in OPTIONAL_PHASES
            if args.all or getattr(args, "with_" + name.replace("-", "_"))}
    if not args.skip_control_plane:
        chosen.add("control-plane")
    skipped = {"placement": args.skip_placement, "concurrency": args.skip_concurrency,
               "pressure": args.skip_pressure}
    return frozenset(name for name in chosen if not skipped.get(name, False))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bidirkv.demo", description=__doc__.split("\n")[0])
    p.add_argument("--spec", type=pathlib.Path, default=SPEC)
    p.add_argument("--out", type=pathlib.Path, default=OUT)
    p.add_argument("--conversations", type=int, default=DEFAULTS["conversations"])
    p.add_argument("--turns", type=int, default=DEFAULTS["turns"])
    p.add_argument("--new-tokens", type=int, default=DEFAULTS["new_tokens"])
    p.add_argument("--output-tokens", type=int, default=DEFAULTS["output_tokens"])
    p.add_argument("--think", type=float, nargs=2, default=DEFAULTS["think"],
                   metavar=("MIN", "MAX"), help="seconds a conversation thinks between turns "
                   "(seeded, uniform)")
    p.add_argument("--pause", type=float, default=DEFAULTS["pause_s"], metavar="SECONDS",
                   help="a longer pause (a tool call) before --pause-turn; 0: none")
    p.add_argument("--pause-turn", type=int, default=DEFAULTS["pause_turn"], metavar="N")
    p.add_argument("--warmup-turns", type=int, default=2)
    p.add_argument("--settle", type=float, default=1.0, metavar="SECONDS")
    p.add_argument("--all", action="store_true",
                   help="every phase: --with-placement, --with-concurrency, --with-pressure "
                   "and --with-span-tree (`make demo-all`)")
    p.add_argument("--with-placement", action="store_true",
                   help="the multi-turn run under the spec's placement `cost` too")
    p.add_argument("--with-concurrency", action="store_true",
                   help="vllm bench serve, decode server alone vs router, concurrency 1 and 4")
    p.add_argument("--with-pressure", action="store_true",
                   help="the concurrent run under decode KV pressure, ON then OFF")
    p.add_argument("--with-span-tree", action="store_true",
                   help="one returning turn's spans from the ON stack's router, as a tree")
    p.add_argument("--skip-control-plane", action="store_true")
    p.add_argument("--skip-pressure", action="store_true",
                   help="leave out the concurrent run under decode KV pressure")
    p.add_argument("--skip-concurrency", action="store_true",
                   help="leave out the concurrency run (vllm bench serve)")
    p.add_argument("--trace", choices=("turns", "agent"), default="turns",
                   help="turns: --new-tokens every turn; agent: appends of 50-2000 tokens "
                   "and a 4000-token tool output every third turn (seeded)")
    p.add_argument("--skip-placement", action="store_true",
                   help="leave out the multi-turn run under placement `cost`")
    p.add_argument("--only-pressure", action="store_true",
                   help="only the concurrent run under decode KV pressure")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from bidirkv.bench.client import RequestFailed
    from bidirkv.bench.vllmbench import BenchFailed
    from bidirkv.local.ports import PortInUse
    from bidirkv.local.stack import StackRunning, StartError, interrupt_on_signals

    args = parse_args(argv)
    args.out = args.out.resolve()
    # kopf reports its own reconnects and retries at INFO/WARNING; the demo shows results.
    logging.basicConfig(level=logging.WARNING, format="    [%(name)s] %(message)s")
    logging.getLogger("kopf").setLevel(logging.CRITICAL)
    logging.getLogger("bidirkv.operator").setLevel(logging.ERROR)
    try:
        clock = stamp.Clock(make_started=stamp.make_started(os.environ))
    except ValueError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2

    def timed(title: str, fn: Callable[[], Any]) -> Any:
        return clock.timed(title, fn, step)

    try:
        with interrupt_on_signals():
            chosen = phases(args)
            if "control-plane" in chosen:
                timed(f"control plane: operator on an in-memory API server, "
                      f"kubectl apply -f {args.spec.name}",
                      lambda: asyncio.run(control_plane(args.spec)))
            rc = data_plane(args, timed, clock) if "multi-turn" in chosen else 0
            if rc == 0 and "pressure" in chosen:
                pressure(args, timed)
            if rc == 0 and "span-tree" in chosen:
                show_trace(traces_file(args, "on"))
    except KeyboardInterrupt:
        print("\ndemo: interrupted; every process it started is stopped", file=sys.stderr)
        return 130
    except (StartError, PortInUse, StackRunning, RequestFailed, BenchFailed,
            ValueError) as exc:
        print(f"\ndemo: {exc}\ndemo: every process it started is stopped", file=sys.stderr)
        return 1
    if rc == 0 and "multi-turn" in chosen:
        # The headline's JSON was written before the later phases: its record gets the
        # demo's whole time.
        stamp.restamp(args.out / "bench.json", stamp.run_stamp(clock, *stamp.git_commit(ROOT)))
    step(clock.done())
    return rc


if __name__ == "__main__":
    sys.exit(main())
