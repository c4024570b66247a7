"""`make bench-agents`: an agent's trace end to end on this machine, 1P2D.

The trace (bidirkv/bench/agenttrace.py, seeded, written to out/agents/trace.json; `--trace
FILE` replays a given one): a parent conversation of 8 turns grows to about 8k tokens
from a 2k-token system message (its prompt and the tools' schemas); after its turns 3 and
6 it spawns 3 sub-agents (the same system message, then their own task; their own
X-Session-ID and x-claude-code-parent-agent-id naming the parent) and 2 forks (the
parent's whole history, then a different next message; their own X-Session-ID only);
each child has 1-2 later turns, then the parent goes on. Chat completions, streamed,
temperature 0, a few output tokens, one request at a time in the trace's order (a
concurrent client would measure queueing on 2 cores).

examples/local-agents.yaml (1P2D, float32, the placement header on) runs as the
processes `bidir-kv local up` starts, three ways:
1. ON: bidirectional transfer, the default `cost` placement.
2. OFF: kvTransfer.bidirectional false on the servers and the router; before each
   request the lower bound: the same prompt straight to the decode server whose prefix
   cache already holds what the request shares. That is the replica that decoded the
   request the prompt extends: the session's previous turn, or for a child's first turn
   the parent's turn that spawned it (its system message and, for a fork, its whole
   history); decode-0 for the parent's first turn. It computes only the rest: no second
   leg, no KV transfer. Which replica decoded a request is read from the replicas' own
   request counters around it.
3. The table per kind (the parent's turns after a spawn, the sub-agents' and the forks'
   first turns, the children's later turns): median TTFT ON, OFF and the bound, OFF/ON,
   ON/bound and the shared tokens; the share of the parent's next turns that reused
   (the router's reuse outcome and kind, P's reads, or decode's prefix-cache hits on a
   turn placed whole there); outputs equal to OFF's, turn by turn; failed requests. Then
   out/agents/agents.json and out/agents/ttft_agents.png.

A progress line per request. A failed request is counted and sent again (at most
ATTEMPTS times). Every process started is stopped at the end, on failure, on Ctrl-C and
on SIGTERM. Not part of `make demo` or `make test`. `--quick`: a smoke run (the parent's
3 turns, 1 sub-agent and 1 fork after its turn 2, short texts).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from bidirkv.bench.agenttrace import FULL, PARENT_HEADERS, QUICK, Replay, Step, Trace, tokens
from bidirkv.demolong import banner, finished, run_meta, say, started

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "local-agents.yaml"
OUT = ROOT / "out" / "agents"
OFF = {"kvTransfer": {"bidirectional": False}}
TIMEOUT_S = 600.0  # one request
ATTEMPTS = 3  # a failed request is counted, then sent again
WARMUP_WORDS = 256
# Decode counts a request as it ends, just after the client's last byte.
COUNTED_WAIT_S = 3.0
SUCCESS = "vllm:request_success_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
# Paths of the placement header where the turn ran whole on decode (its prefix cache
# holds what it reuses; P read nothing).
ON_DECODE = ("extend", "decode")


class AgentRun:
    """The trace against one started stack, one request at a time."""

    def __init__(self, stack: Any, label: str, trace: Trace, args: argparse.Namespace,
                 bound: bool) -> None:
        from bidirkv.bench.runner import BenchConfig, Runner

        self.label, self.trace, self.bound = label, trace, bound
        self.decodes = {p.name: p.url for p in stack.state.procs if p.role == "decode"}
        self.runner = Runner(BenchConfig(
            url=stack.router_url, label=label, conversations=1, turns=1,
            output_tokens=trace.shape.output_tokens, warmup_turns=2, settle_s=args.settle,
            id_mode="none", prefill_metrics=stack.urls("prefill")[0] + "/metrics",
            handle_key=stack.handle_key(), timeout_s=TIMEOUT_S), progress=False)
        self.replay = Replay(trace, f"agents-{label}-{int(time.time())}")
        self.holder: dict[tuple[str, int], str | None] = {}
        self.bound_failures = 0

    def warm_up(self) -> None:
        """Two short conversations of two turns each, so that both decode replicas (the
        router spreads first turns) have served and handshaken before the trace."""
        for i in range(2):
            self.runner.warm_up(f"{self.replay.run_id}-w{i}", words=WARMUP_WORDS)

    def _counters(self) -> dict[str, Any]:
        from bidirkv.bench import promtext

        return {name: promtext.scrape(url + "/metrics") for name, url in self.decodes.items()}

    def _grew(self, before: dict[str, Any], after: dict[str, Any]) -> list[str]:
        from bidirkv.bench import promtext

        return [n for n in self.decodes if (promtext.delta(before[n], after[n], SUCCESS) or 0) > 0]

    def _counted(self, before: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
        """The replica whose request count grew since `before` (None: none within the
        wait), and the scrape that showed it."""
        deadline = time.monotonic() + COUNTED_WAIT_S
        while True:
            after = self._counters()
            grew = self._grew(before, after)
            if grew or time.monotonic() > deadline:
                return (grew[0] if grew else None), after
            time.sleep(0.05)

    def _bound(self, step: Step) -> tuple[float, str, float | None]:
        """The lower bound's TTFT, the replica it ran on, and the tokens that replica's
        prefix cache gave it (what shows the bound had the shared prefix at hand)."""
        from bidirkv.bench import promtext
        from bidirkv.bench.client import RequestFailed, chat
        from bidirkv.bench.conversation import chat_body

        src = self.replay.source(step)
        name = (self.holder.get(src) if src else None) or next(iter(self.decodes))
        body = chat_body(self.runner.model or "", self.replay.prompt(step), 1, True)
        for attempt in range(1, ATTEMPTS + 1):
            before = self._counters()
            try:
                ttft = chat(self.decodes[name], body, timeout=TIMEOUT_S).ttft_s
            except RequestFailed as exc:
                self.bound_failures += 1
                say(f"{self.label}: the lower bound failed ({exc}); attempt {attempt}")
                if attempt == ATTEMPTS:
                    raise
                continue
            # Counted before the turn's own counters are read.
            _, after = self._counted(before)
            return ttft, name, promtext.delta(before[name], after[name], PREFIX_HITS)
        raise AssertionError("unreachable")

    def _turn(self, step: Step) -> tuple[Any, int]:
        from bidirkv.bench.client import RequestFailed

        conv = self.replay.conversation(step)
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return self.runner.turn(conv, step.turn, True, text=step.user,
                                        headers=self.replay.headers(step)), attempt - 1
            except RequestFailed as exc:
                if conv.messages and conv.messages[-1]["role"] == "user":
                    conv.messages.pop()  # the unanswered message goes again
                say(f"{self.label} {step.session} turn {step.turn}: failed ({exc}); "
                    f"attempt {attempt} of {ATTEMPTS}")
                if attempt == ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    def step(self, i: int, step: Step, t0: float) -> dict[str, Any]:
        from bidirkv.bench import promtext
        from bidirkv.bench.runner import reuse_kind

        shared = self.replay.shared_tokens(step)
        planned = len(tokens(self.replay.prompt(step)))
        say(f"{self.label} {i + 1}/{len(self.trace.steps)} {step.session} turn {step.turn} "
            f"({step.kind}): {planned} tokens, {shared} shared, sending "
            f"[{(time.monotonic() - t0) / 60:.1f} min]")
        lb, bound_on, bound_hits = self._bound(step) if self.bound else (None, None, None)
        before = self._counters()
        rec, failures = self._turn(step)
        decoded_by, after = self._counted(before)
        self.replay.answered(step)
        self.holder[(step.session, step.turn)] = decoded_by
        d_hits = sum(promtext.delta(before[n], after[n], PREFIX_HITS) or 0
                     for n in self.decodes)
        path = (rec.placement or "").split(";")[0].strip()
        p_read = rec.metrics.get("p_external_hit_tokens") or 0
        out = {**rec.to_json(), "step": i, "session": step.session, "kind": step.kind,
               "shared_tokens": shared, "planned_tokens": planned, "lower_bound_s": lb,
               "bound_on": bound_on, "bound_cached_tokens": bound_hits,
               "decoded_by": decoded_by,
               "reuse_kind": reuse_kind(rec.metrics), "d_cached_tokens": d_hits,
               "reused_tokens": d_hits if path in ON_DECODE else p_read,
               "failures": failures}
        bound = "" if lb is None else (f", bound {lb * 1000:.0f} ms on {bound_on} "
                                       f"({bound_hits or 0:.0f} tokens cached)")
        say(f"{self.label} {i + 1}: context {rec.context_tokens}, TTFT "
            f"{rec.ttft_s * 1000:.0f} ms{bound}; {rec.reason}"
            f"{'/' + out['reuse_kind'] if out['reuse_kind'] else ''}, "
            f"{out['reused_tokens']:.0f} tokens reused, decoded on {decoded_by}"
            + (f", placed {rec.placement}" if rec.placement else ""))
        return out


def phase(label: str, patch: dict[str, Any], trace: Trace, args: argparse.Namespace,
          t0: float, bound: bool) -> dict[str, Any]:
    stack = started(label, patch, args)
    with stack:
        run = AgentRun(stack, label, trace, args, bound)
        say(f"{label.upper()}: decode replicas "
            + ", ".join(f"{n} {u}" for n, u in run.decodes.items()))
        t = time.monotonic()
        run.warm_up()
        records = [run.step(i, s, t0) for i, s in enumerate(trace.steps)]
        out = {"records": records, "bound_failures": run.bound_failures,
               "wall_s": time.monotonic() - t, "decodes": run.decodes}
    say(f"stopped P, both D and the router of the {label.upper()} stack")
    return out


def trace_for(args: argparse.Namespace) -> Trace:
    """The trace to run, written to out/agents/trace.json (a given one is copied there)."""
    from bidirkv.bench.agenttrace import build_trace, read_trace, write_trace

    if args.trace is not None:
        trace = read_trace(args.trace)
    else:
        shape = QUICK if args.quick else FULL
        if args.parent_header != shape.parent_header:
            shape = replace(shape, parent_header=args.parent_header)
        trace = build_trace(args.seed, shape)
    path = write_trace(args.out / "trace.json", trace)
    say(f"trace: {path} ({len(trace.sessions)} sessions, {len(trace.steps)} requests)")
    return trace


def report(on: dict[str, Any], off: dict[str, Any], meta: dict[str, Any],
           args: argparse.Namespace, machine: str) -> dict[str, Any]:
    """Print the tables and write out/agents/agents.json and out/agents/ttft_agents.png."""
    from bidirkv.bench import agentreport as ar
    from bidirkv.bench import plots, stats
    from bidirkv.bench.report import write_json

    rows = ar.kind_rows(on["records"], off["records"])
    steps = ar.step_rows(on["records"], off["records"])
    aims = ar.aims(on["records"], off["records"], ar.failed(on, off))
    print(f"\n==> agents: 1P2D, per kind of request ({meta['cpu']['model']}, "
          f"{meta['dtype']['dtype']})")
    print(ar.kind_table(rows))
    print("\nper request:")
    print(ar.step_table(steps))
    unplanned = [r for r in on["records"] + off["records"]
                 if r.get("context_tokens") not in (None, r["planned_tokens"])]
    if unplanned:
        print(f"    ({len(unplanned)} prompts of another length than the trace's count: "
              "the shared tokens assume the tiny model's word-level tokenizer)")
    print("\nAims:")
    print(stats.format_aims(aims))
    doc = {"kind": "bidirkv-bench-agents", "rows": rows, "steps": steps,
           "aims": [asdict(a) for a in aims], "trace": str(args.out / "trace.json"),
           **meta, "runs": {"on": on, "off": off}}
    paths = {"json": write_json(args.out / "agents.json", doc),
             "png": plots.agents_plot(rows, args.out / "ttft_agents.png",
                                      f"Agent trace: 1P2D vLLM CPU, tiny model, "
                                      f"{meta['dtype']['dtype']}\n{machine}")}
    for name, path in paths.items():
        print(f"{name}: {path}")
    return doc


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bidirkv.demoagents",
                                description=__doc__.split("\n")[0])
    p.add_argument("--spec", type=pathlib.Path, default=SPEC)
    p.add_argument("--out", type=pathlib.Path, default=OUT)
    p.add_argument("--trace", type=pathlib.Path, metavar="FILE",
                   help="replay this trace file (as written to OUT/trace.json) instead of "
                   "building one from --seed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: the parent's 3 turns, 1 sub-agent and 1 fork")
    p.add_argument("--parent-header", choices=PARENT_HEADERS, default=FULL.parent_header,
                   help="the header a sub-agent names its parent's session in")
    p.add_argument("--settle", type=float, default=0.5, metavar="S",
                   help="seconds between requests (the engines' counters settle)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.trace is not None and (args.quick or args.seed or
                                   args.parent_header != FULL.parent_header):
        p.error("--trace replays a file: --quick, --seed and --parent-header build one")
    if args.settle < 0:
        p.error(f"--settle {args.settle}: must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    from bidirkv.bench.stamp import Clock, git_commit, run_stamp
    from bidirkv.local.cli import tiny_model_for
    from bidirkv.local.cpu import read_cpu

    args = parse_args(argv)
    args.out = args.out.resolve()
    clock, load = Clock(), os.getloadavg()

    def timed(title: str, fn: Callable[[], Any]) -> Any:
        return clock.timed(title, fn, banner)

    def run() -> None:
        cpu = read_cpu()
        trace = trace_for(args)
        model, choice = timed("tiny model", lambda: tiny_model_for(
            args.spec, ROOT, not args.no_progress))
        say(f"{model}; CPU {cpu.describe()}; {choice.line()}")
        say(f"load average at the start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on "
            f"{os.cpu_count()} cpus")
        t0 = clock.started_mono
        on = timed(f"bidirectional ON, placement cost: start {args.spec.name}, the "
                   "trace, stop", lambda: phase("on", {}, trace, args, t0, bound=False))
        off = timed("bidirectional OFF (servers and router): start, the trace with the "
                    "lower bound, stop", lambda: phase("off", OFF, trace, args, t0,
                                                       bound=True))
        meta = {**run_meta(args.spec, cpu, choice, load),
                "trace_sha": hashlib.sha256(
                    (args.out / "trace.json").read_bytes()).hexdigest()[:16],
                "run": run_stamp(clock, *git_commit(ROOT))}
        report(on, off, meta, args, f"{cpu.model} ({cpu.isa()})")

    return finished("bench-agents", run, clock)


if __name__ == "__main__":
    sys.exit(main())
