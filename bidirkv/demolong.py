"""`make bench-long`: long contexts end to end on this machine.

examples/local-long.yaml (32-token blocks, chunked prefill, maxModelLen 131072) runs as
the processes `bidir-kv local up` starts, and one conversation grows in large appends
(16384 words a turn by default: tokens, with the tiny model) to 64k tokens and more:

1. ON, placement alwaysDisaggregate (as the headline of `make demo`): every returning turn
   reads its history back from decode. Then a short turn, the router stopped by pid with
   SIGTERM and started again with the same command (bidirkv/local/restart.py), and the
   same short turn again: the new router recalls the conversation's handle from decode's
   note, and the turn reads the history back instead of recomputing it.
2. OFF (kvTransfer.bidirectional false on the servers and the router) with the lower
   bound before each turn: the decode server, prefix caching on, computes only the new
   tokens (bidirkv/bench/runner.py).
3. The table (TTFT per turn and context, OFF/ON, ON/bound), the restart row, and
   out/long/long.json and out/long/ttft_long.png.

A progress line per turn. Every process started is stopped at the end, on failure, on
Ctrl-C and on SIGTERM. Not part of `make demo` or `make test`: 20 minutes on a shared
2-core Zen 4 in bf16, about an hour (estimated) on an AVX2-only CPU (docs/local-stack.md).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from bidirkv.bench.longrun import AFTER, BEFORE, STEP, LongTurn, plan_turns
from bidirkv.wire import RESIDENCY_PATH

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "local-long.yaml"
OUT = ROOT / "out" / "long"
# 16k, 32k, 64k, each followed by an agent's turn (+1024): OFF recomputes the whole
# history each turn (~4 min at 64k on one Zen 4 core in bf16, quadratic in the
# context), so more or larger steps soon take the phase past half an hour.
STEPS = (16384, 1024, 15360, 1024, 32768, 1024)
RESTART_WORDS = 1024
WARMUP_WORDS = 512
ALWAYS_DISAGGREGATE = {"router": {"placement": {"policy": "alwaysDisaggregate"}}}
TIMEOUT_S = 3600.0  # one request: OFF's 64k recompute, on a slow CPU


def say(line: str) -> None:
    print(f"    {line}", flush=True)


def banner(title: str) -> None:
    print(f"\n==> {title}", flush=True)


def finished(name: str, run: Callable[[], None], clock: Any) -> int:
    """`run()` with the local stack's signal handling, as a command's exit status: 0 with
    the run's times, 130 interrupted, 1 when a stack or a request failed; either of
    those says that every process it started is stopped (the stacks stop them)."""
    from bidirkv.bench.client import RequestFailed
    from bidirkv.local.ports import PortInUse
    from bidirkv.local.stack import StackRunning, StartError, interrupt_on_signals

    try:
        with interrupt_on_signals():
            run()
    except KeyboardInterrupt:
        print(f"\n{name}: interrupted; every process it started is stopped", file=sys.stderr)
        return 130
    except (StartError, PortInUse, StackRunning, RequestFailed, ValueError) as exc:
        print(f"\n{name}: {exc}\n{name}: every process it started is stopped",
              file=sys.stderr)
        return 1
    banner(clock.done())
    return 0


def run_meta(spec: pathlib.Path, cpu: Any, choice: Any, load: tuple[float, ...]
             ) -> dict[str, Any]:
    """What a run's JSON says of where it ran: the spec, the CPU, the dtype and why, the
    load average at its start and now."""
    return {"spec": str(spec), "cpu": cpu.to_json(),
            "dtype": {"dtype": choice.dtype, "picked": choice.picked,
                      "reason": choice.reason},
            "loadavg": {"start": list(load), "end": list(os.getloadavg())}}


def started(label: str, patch: dict[str, Any], args: argparse.Namespace):
    """A started stack of the long spec under `patch`, in its own state directory."""
    from bidirkv.local.cli import prepare_stack

    stack = prepare_stack(args.spec, args.out / f"stack-{label}", patch=patch, cwd=ROOT,
                          progress=not args.no_progress)
    t = time.monotonic()
    try:
        stack.start(progress=not args.no_progress)
    except BaseException:
        stack.stop()
        raise
    say(f"{label.upper()}: P {stack.urls('prefill')[0]}  D {stack.urls('decode')[0]}  "
        f"router {stack.router_url} (healthy after {time.monotonic() - t:.0f} s; logs in "
        f"{stack.state_dir / 'logs'}); {stack.cpu_line()}")
    return stack


def runner_for(stack, label: str, args: argparse.Namespace, lower_bound: bool):
    """A runner against the stack's router, warmed up with two short turns."""
    from bidirkv.bench.runner import BenchConfig, Runner

    d_url = stack.urls("decode")[0]
    cfg = BenchConfig(
        url=stack.router_url, label=label, conversations=1, turns=len(args.plan),
        output_tokens=args.output_tokens, warmup_turns=2,
        prefill_metrics=stack.urls("prefill")[0] + "/metrics",
        decode_metrics=d_url + "/metrics", decode_residency=d_url + RESIDENCY_PATH,
        handle_key=stack.handle_key(), lower_bound_url=d_url if lower_bound else None,
        timeout_s=TIMEOUT_S)
    runner = Runner(cfg, progress=False)
    runner.warm_up(f"long-{label}-{int(time.time())}", words=args.warmup_words)
    return runner


def run_turns(runner, conv, turns: Sequence[LongTurn], label: str, t0: float) -> list:
    """Each turn, with a line before (it may take minutes) and one after."""
    records = []
    for t in turns:
        say(f"{label} turn {t.turn} ({t.kind}): +{t.words} words, sending "
            f"[{(time.monotonic() - t0) / 60:.1f} min]")
        rec = runner.turn(conv, t.turn, measure=True, words=t.words)
        bound = "" if rec.lower_bound_s is None else f", lower bound {rec.lower_bound_s:.1f} s"
        reused = (rec.metrics.get("p_external_hit_tokens") or rec.metrics.get("reused_tokens")
                  or 0)
        say(f"{label} turn {t.turn}: context {rec.context_tokens} tokens, TTFT "
            f"{rec.ttft_s:.1f} s{bound}, {reused:.0f} tokens read back ({rec.reason})")
        records.append(rec)
    return records


def restart_router(stack, timeout_s: float = 60.0) -> dict[str, Any]:
    """SIGTERM the router by pid, start it again with the same command, and wait until it
    has recalled the handles it held (from decode's notes)."""
    from bidirkv.bench import promtext
    from bidirkv.local.restart import restart_server
    from bidirkv.local.stack import StartError
    from bidirkv.local.state import read_state

    def handles() -> float:
        return promtext.total(promtext.scrape(stack.router_url + "/metrics"),
                              "bidirkv_router_handles") or 0.0

    held = handles()
    pid_before = next((p.pid for p in (read_state(stack.state_dir) or stack.state).procs
                       if p.name == "router"), None)
    t0 = time.monotonic()
    done = restart_server(stack.state_dir, "router", say=say)
    if done.record is None:
        raise StartError("the router did not stop within its wait; not restarted")
    back = time.monotonic() - t0
    deadline = time.monotonic() + timeout_s
    while (got := handles()) < held and time.monotonic() < deadline:
        time.sleep(0.2)
    recall = time.monotonic() - t0
    say(f"router: {got:.0f} of {held:.0f} handles recalled {recall:.1f} s after the SIGTERM")
    return {"stop_s": done.stopped.seconds, "start_s": done.start_s, "router_back_s": back,
            "recall_s": recall if got >= held else None, "handles_before": held,
            "handles_after": got, "router_pid_before": pid_before,
            "router_pid_after": done.record.pid}


def on_phase(args: argparse.Namespace, t0: float) -> tuple[dict[str, Any], dict[str, Any]]:
    from bidirkv.bench.conversation import Conversation
    from bidirkv.bench.report import run_document
    from bidirkv.local.stack import stop_recorded

    stack = started("on", ALWAYS_DISAGGREGATE, args)
    with stack:
        try:
            runner = runner_for(stack, "on", args, lower_bound=False)
            conv = Conversation(0, f"long-on-{int(time.time())}")
            t = time.monotonic()
            records = run_turns(runner, conv, [x for x in args.plan if x.kind != AFTER],
                                "ON", t0)
            at = records[-1].context_tokens or 0
            say(f"router restart at {at + (records[-1].output_tokens or 0)} tokens of "
                f"conversation ({block_size(args.spec)}-token blocks)")
            restart = restart_router(stack)
            records += run_turns(runner, conv, [x for x in args.plan if x.kind == AFTER],
                                 "ON", t0)
            doc = run_document(runner.cfg, records, time.monotonic() - t,
                               retention_cap_s=stack.retention_s)
        finally:
            # The restarted router is in the state file, not in the stack's own list.
            stop_recorded(stack.state_dir)
    say("stopped P, D and router of the ON stack")
    return doc, restart


def off_phase(args: argparse.Namespace, t0: float) -> dict[str, Any]:
    from bidirkv.bench.conversation import Conversation
    from bidirkv.bench.report import run_document

    stack = started("off", {"kvTransfer": {"bidirectional": False}, **ALWAYS_DISAGGREGATE},
                    args)
    with stack:
        runner = runner_for(stack, "off", args, lower_bound=True)
        conv = Conversation(0, f"long-off-{int(time.time())}")
        t = time.monotonic()
        records = run_turns(runner, conv, [x for x in args.plan if x.kind == STEP], "OFF", t0)
        doc = run_document(runner.cfg, records, time.monotonic() - t)
    say("stopped P, D and router of the OFF stack")
    return doc


def block_size(spec: pathlib.Path) -> int:
    from bidirkv.demo import block_tokens
    from bidirkv.local.plan import read_spec_file

    return block_tokens(read_spec_file(spec))


def report(on: dict[str, Any], off: dict[str, Any], restart: dict[str, Any],
           meta: dict[str, Any], args: argparse.Namespace, machine: str) -> dict[str, Any]:
    """Print the tables and write out/long/long.json and out/long/ttft_long.png;
    `machine`: the CPU and its ISA, for the plot's title."""
    from bidirkv.bench import longrun, plots, stats
    from bidirkv.bench.report import write_json

    steps = {x.turn for x in args.plan if x.kind == STEP}
    rows = [r for r in stats.compare(on["per_turn"], off["per_turn"]) if r["turn"] in steps]
    row = longrun.restart_row(on["records"], args.plan, restart)
    ratios = longrun.report_ratios(rows, longrun.agent_turns(args.plan))
    print(f"\n==> long contexts: OFF/ON and the bound ({meta['cpu']['model']}, "
          f"{meta['dtype']['dtype']})")
    print(longrun.long_table(rows))
    print(longrun.ratios_text(ratios))
    print(f"\n==> the same conversation across a router restart (SIGTERM by pid, same "
          f"config): ON, +{row_words(args.plan, BEFORE)} words before and after")
    print(longrun.restart_table(row))
    if not row["restart_at_or_past_aim"]:
        print(f"    (restarted at {row['restart_at_tokens']} tokens: below the "
              f"{longrun.RESTART_MIN_CONTEXT} aimed at; larger --steps reach it)")
    doc = {"kind": "bidirkv-bench-long", "rows": rows, "restart": row, "ratios": ratios,
           "plan": [asdict(x) for x in args.plan], **meta, "runs": {"on": on, "off": off}}
    paths = {"json": write_json(args.out / "long.json", doc),
             "png": plots.long_plot(rows, row, args.out / "ttft_long.png",
                                    f"Long contexts: 1P1D vLLM CPU, tiny model, "
                                    f"{meta['dtype']['dtype']}\n{machine}")}
    for name, path in paths.items():
        print(f"{name}: {path}")
    return doc


def row_words(plan: Sequence[LongTurn], kind: str) -> int:
    return next(x.words for x in plan if x.kind == kind)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bidirkv.demolong",
                                description=__doc__.split("\n")[0])
    p.add_argument("--spec", type=pathlib.Path, default=SPEC)
    p.add_argument("--out", type=pathlib.Path, default=OUT)
    p.add_argument("--steps", type=int, nargs="+", default=list(STEPS), metavar="WORDS",
                   help="user words each turn adds (default: 16384, 1024, 15360, 1024, "
                   "32768, 1024: to 64k tokens, an agent's turn after each step)")
    p.add_argument("--restart-words", type=int, default=RESTART_WORDS, metavar="WORDS",
                   help="user words of the turns before and after the router restart")
    p.add_argument("--warmup-words", type=int, default=WARMUP_WORDS, metavar="WORDS")
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        args.plan = plan_turns(args.steps, args.restart_words)
    except ValueError as exc:
        p.error(str(exc))
    if args.warmup_words < 1 or args.output_tokens < 1:
        p.error("--warmup-words and --output-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    from bidirkv.bench.stamp import Clock
    from bidirkv.local.cli import tiny_model_for
    from bidirkv.local.cpu import read_cpu

    args = parse_args(argv)
    args.out = args.out.resolve()
    clock = Clock()
    t0 = clock.started_mono
    load = os.getloadavg()

    def timed(title: str, fn: Callable[[], Any]) -> Any:
        return clock.timed(title, fn, banner)

    def run() -> None:
        cpu = read_cpu()
        model, choice = timed("tiny model", lambda: tiny_model_for(
            args.spec, ROOT, not args.no_progress))
        say(f"{model}; CPU {cpu.describe()}; {choice.line()}")
        say(f"load average at the start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on "
            f"{os.cpu_count()} cpus; one conversation: "
            + " -> ".join(f"+{x.words}" for x in args.plan if x.kind == STEP)
            + f" words, then +{args.restart_words} before and after a router restart")
        on, restart = timed("bidirectional ON, alwaysDisaggregate: start "
                            f"{args.spec.name}, the growing turns, a router restart, stop",
                            lambda: on_phase(args, t0))
        off = timed("bidirectional OFF (servers and router): start, the growing turns "
                    "with the lower bound, stop", lambda: off_phase(args, t0))
        meta = {**run_meta(args.spec, cpu, choice, load), "wall_s": time.monotonic() - t0}
        report(on, off, restart, meta, args, f"{cpu.model} ({cpu.isa()})")

    return finished("bench-long", run, clock)


if __name__ == "__main__":
    sys.exit(main())
