"""`bidir-kv bench`: one benchmark run against a router, or a comparison of two runs.

    bidir-kv bench --url http://ROUTER --label on          # any router, e.g. a cluster's
    bidir-kv bench --state-dir out/local --label on        # a `bidir-kv local up` stack
    bidir-kv bench --compare out/bench/on.json out/bench/off.json
    bidir-kv bench --headline out/demo/bench.json   # README's headline from a demo run
    bidir-kv bench --state-dir out/local --concurrency 4 --conversations 12 --turns 4
        # concurrent mode: a pool of conversations, N in flight, think time between turns
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from bidirkv.wire import RESIDENCY_PATH

DEFAULT_OUT = pathlib.Path("out/bench")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bidirkv.bench.runner import BenchConfig

    d = BenchConfig(url="")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="router base URL (any OpenAI-compatible router)")
    where.add_argument("--state-dir", type=pathlib.Path,
                       help="a local stack's state directory: its router, and P's metrics")
    where.add_argument("--compare", nargs=2, metavar=("ON_JSON", "OFF_JSON"),
                       help="no run: table, JSON and plots of two saved runs")
    where.add_argument("--headline", type=pathlib.Path, metavar="BENCH_JSON",
                       help="no run: the headline table of README.md and docs/benchmarks.md "
                       "(between their markers) and docs/headline.json, from a `make demo` "
                       "run's out/demo/bench.json (or docs/headline.json: render again); "
                       "run from the repository root")
    p.add_argument("--commit", help="with --headline, for a bench.json that records no run: "
                   "the commit it ran")
    p.add_argument("--date", metavar="YYYY-MM-DD", help="with --headline, the same: its date")
    p.add_argument("--policy", help="with --headline, for a bench.json whose runs record no "
                   "placement policy: the policy ON and OFF ran")
    p.add_argument("--label", default=d.label, help="name of this run (file name too)")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--conversations", type=int, default=d.conversations)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--new-tokens", type=int, default=d.new_tokens,
                   help="new user words per turn (one token each with the tiny model)")
    p.add_argument("--output-tokens", type=int, default=d.output_tokens,
                   help="output tokens per turn (min_tokens = max_tokens, ignore_eos)")
    p.add_argument("--warmup-turns", type=int, default=d.warmup_turns,
                   help="turns of an unmeasured warm-up conversation (0: none)")
    p.add_argument("--settle", type=float, default=d.settle_s, metavar="SECONDS",
                   help="pause before each measured request")
    p.add_argument("--no-stream", action="store_true",
                   help="non-streamed requests (TTFT then means the whole reply)")
    p.add_argument("--conversation-id", choices=("body", "header", "none"), default=d.id_mode,
                   help="how the conversation id reaches the router")
    p.add_argument("--prefill-metrics", metavar="URL", help="P's /metrics (transfer split)")
    p.add_argument("--decode-metrics", metavar="URL", help="D's /metrics")
    p.add_argument("--lower-bound-url", metavar="URL",
                   help="server whose prefix cache holds the history (see the method notes)")
    p.add_argument("--lower-bound", action="store_true",
                   help="with --state-dir: measure the lower bound on the stack's decode server "
                        "(meaningful with kvTransfer.bidirectional false)")
    p.add_argument("--turn-think", type=float, nargs=2, default=(0.0, 0.0),
                   metavar=("MIN", "MAX"), help="seconds a conversation thinks between its "
                   "turns (seeded, uniform; the next turn goes to whichever is due first)")
    p.add_argument("--pause", type=float, default=0.0, metavar="SECONDS",
                   help="a longer pause (a tool call) before each of --pause-turns")
    p.add_argument("--pause-turns", type=int, nargs="+", default=(), metavar="N")
    p.add_argument("--decode-residency", metavar="URL",
                   help="D's /bidirkv/residency (misses by reason: near expiry, released)")
    p.add_argument("--concurrency", type=int, metavar="N",
                   help="concurrent mode: N requests in flight over the pool of --conversations "
                        "(per-request TTFT p50/p99, throughput, errors)")
    p.add_argument("--think", type=float, default=1.0, metavar="SECONDS",
                   help="concurrent mode: pause between an answer and the conversation's next "
                        "turn")
    p.add_argument("--first-tokens", type=int, default=1000,
                   help="concurrent mode: user words of a conversation's first turn "
                        "(--new-tokens for later turns)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT, help="output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _config(args: argparse.Namespace):
    from bidirkv.bench.runner import BenchConfig
    from bidirkv.bench.turns import Think
    from bidirkv.local.state import read_state

    url, prefill, decode, lower = (args.url, args.prefill_metrics, args.decode_metrics,
                                   args.lower_bound_url)
    residency = args.decode_residency
    if args.state_dir is not None:
        state = read_state(args.state_dir)
        if state is None:
            raise ValueError(f"no local stack recorded in {args.state_dir} (run `bidir-kv local "
                             "up` first)")
        url = state.router_url
        p_urls, d_urls = state.urls("prefill"), state.urls("decode")
        prefill = prefill or (p_urls[0] + "/metrics" if len(p_urls) == 1 else None)
        decode = decode or (d_urls[0] + "/metrics" if len(d_urls) == 1 else None)
        residency = residency or (d_urls[0] + RESIDENCY_PATH if len(d_urls) == 1
                                  else None)
        if args.lower_bound and not lower:
            lower = d_urls[0]
    think = Think(min_s=args.turn_think[0], max_s=args.turn_think[1], pause_s=args.pause,
                  pause_turns=tuple(args.pause_turns))
    return BenchConfig(
        url=url, label=args.label, model=args.model, conversations=args.conversations,
        turns=args.turns, new_tokens=args.new_tokens, output_tokens=args.output_tokens,
        warmup_turns=args.warmup_turns, settle_s=args.settle, stream=not args.no_stream,
        id_mode=args.conversation_id, prefill_metrics=prefill, decode_metrics=decode,
        lower_bound_url=lower, decode_residency=residency, think=think, seed=args.seed,
    )


def _load_config(args: argparse.Namespace):
    from bidirkv.bench.concurrent import ConcurrentConfig

    base = _config(args)
    return ConcurrentConfig(
        url=base.url, label=args.label, model=args.model, conversations=args.conversations,
        turns=args.turns, concurrency=args.concurrency, think_s=args.think,
        first_tokens=args.first_tokens, new_tokens=args.new_tokens,
        output_tokens=args.output_tokens, stream=not args.no_stream, seed=args.seed)


def run_load(args: argparse.Namespace) -> int:
    from bidirkv.bench import concurrent, loadreport
    from bidirkv.bench.client import RequestFailed

    try:
        cfg = _load_config(args)
        doc = loadreport.document(concurrent.run(cfg, progress=not args.no_progress))
    except (ValueError, RequestFailed) as exc:
        print(f"bidir-kv bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bidir-kv bench: interrupted", file=sys.stderr)
        return 130
    path = loadreport.write_json(args.out / f"{cfg.label}-load.json", doc)
    print(loadreport.comparison_text({cfg.label: doc}))
    print(f"json: {path}")
    return 1 if doc["summary"]["errors"] else 0


def run_headline(args: argparse.Namespace) -> int:
    from bidirkv.bench import headline

    given = {"commit": args.commit, "date": args.date, "policy": args.policy}
    try:
        written = headline.write_pages(args.headline, pathlib.Path("."), given)
    except (OSError, ValueError) as exc:
        print(f"bidir-kv bench --headline: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    from bidirkv.bench import report, stats, turns
    from bidirkv.bench.client import RequestFailed
    from bidirkv.bench.runner import Runner

    prog = "bidir-kv bench"
    if args.headline is not None:
        return run_headline(args)
    if args.concurrency is not None and not args.compare:
        return run_load(args)
    try:
        if args.compare:
            on, off = (report.load_run(p) for p in args.compare)
            doc = report.compare_document(on, off)
            paths = report.write_comparison(args.out, doc, f"{on['config']['label']} vs "
                                            f"{off['config']['label']}")
            print(report.comparison_text(doc))
            for name, path in paths.items():
                print(f"{name}: {path}")
            return 0
        cfg = _config(args)
        t0 = time.monotonic()
        runner = Runner(cfg, progress=not args.no_progress)
        records = runner.run()
        doc = report.run_document(cfg, records, time.monotonic() - t0, runner.loadavg)
    except (ValueError, RequestFailed) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    path = report.write_json(args.out / f"{cfg.label}.json", doc)
    print(stats.table(doc["per_turn"], stats.RUN_COLUMNS))
    print(turns.summary_text(cfg.label, doc["reuse_reasons"]))
    print(f"json: {path}")
    return 0
