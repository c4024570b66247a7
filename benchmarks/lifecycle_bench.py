"""Drop vs drain: decode replicas and the router leaving a running 1P2D stack, on real
vLLM CPU servers (float32, the tiny model built locally).

    .venv/bin/python benchmarks/lifecycle_bench.py            # 8 conversations x 8 turns
    .venv/bin/python benchmarks/lifecycle_bench.py --quick    # a smoke run

One seeded multi-turn trace (think time between turns, one long pause) runs four times,
each on a fresh local stack (`bidir-kv local up`'s stack, started here on 127.0.0.1 and
stopped by its recorded pids):
- `off`: reuse off: the outputs every other run must equal;
- `baseline`: reuse on, no event: the TTFT each event's turns are held against;
- `drop`: three events, each server killed (SIGKILL) as a pod without the drain loses
  what it holds;
- `drain`: the same events, each server stopped as a deleted pod is (SIGTERM: decode
  drains first), through the path `bidir-kv local drain` and `bidir-kv local restart`
  take (bidirkv/local/restart.py).
The events and what each is judged on are in bidirkv/bench/lifecycle.py. In `drain`
mode the turns after a decode event wait until the router has seen the drain (its next
health round reads the replica's report, at most `healthCheckIntervalSeconds`): a turn
sent before would be placed on the leaving replica again and held there until its next
turn, behind the next event. In `drop` mode they go on at once: whatever the router sends
to the killed replica before it notices is what a crash costs. Which decode
replica holds a conversation is read from the replicas' own counters around each turn
(one request at a time: the replica whose count grew decoded it, and keeps its KV).

Writes out/lifecycle/<mode>.json, out/lifecycle/lifecycle.json (the table's rows and the
verdict) and docs/img/lifecycle_ttft.png (with --quick: out/lifecycle/lifecycle_ttft.png).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bidirkv.bench import lifecycle as lc
from bidirkv.bench import promtext
from bidirkv.bench.client import RequestFailed, first_model
from bidirkv.bench.conversation import Conversation
from bidirkv.bench.lifecycleplot import ttft_timeline
from bidirkv.bench.runner import BenchConfig, Runner
from bidirkv.bench.turns import Think
from bidirkv.local.cli import prepare_stack
from bidirkv.local.cpu import read_cpu
from bidirkv.local.restart import restart_server, stop_server
from bidirkv.local.stack import stop_recorded

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUNS = ("off", "baseline", "drop", "drain")
DRAIN_S = 120  # decode.drainSeconds (the CRD's default)
ATTEMPTS = 5  # a failed turn is counted, then sent again
HOLDER_WAIT_S = 3.0  # decode counts a request as it ends, just after the client's last byte


@dataclass(frozen=True)
class Size:
    conversations: int
    turns: int
    new_tokens: int
    output_tokens: int
    think: tuple[float, float]
    pause_s: float


FULL = Size(8, 8, 300, 32, (1.0, 4.0), 30.0)
QUICK = Size(3, 4, 150, 16, (0.5, 1.0), 8.0)


def stack_patch(model: pathlib.Path, mode: str) -> dict[str, Any]:
    """examples/local.yaml made 1P2D, float32 (greedy outputs then compare exactly), the
    tiny model at `model`; reuse off for the `off` run."""
    patch: dict[str, Any] = {
        "model": {"name": str(model), "dtype": "float32"},
        "decode": {"replicas": 2, "drainSeconds": DRAIN_S},
    }
    if mode == "off":
        patch["kvTransfer"] = {"bidirectional": False}
    return patch


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout.strip()

    head = git("rev-parse", "--short=12", "HEAD")
    return head + (" (with uncommitted changes)" if git("status", "--porcelain",
                                                          "--untracked-files=no") else "")


def ready(router_url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(router_url + "/ready", timeout=3) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read() or b"{}")
    except (OSError, ValueError):
        return {}


class Trace:
    """One run of the seeded trace against a started stack, events included."""

    def __init__(self, stack: Any, mode: str, size: Size, seed: int, progress: bool,
                 say: Callable[[str], None]) -> None:
        self.stack, self.mode, self.size, self.say = stack, mode, size, say
        self.progress = progress
        self.events = lc.schedule(size.turns)
        think = (Think() if mode == "off" else
                 Think(min_s=size.think[0], max_s=size.think[1], pause_s=size.pause_s,
                       pause_turns=(lc.pause_turn(self.events),)))
        self.cfg = BenchConfig(
            url=stack.router_url, label=mode, conversations=size.conversations,
            turns=size.turns, new_tokens=size.new_tokens, output_tokens=size.output_tokens,
            warmup_turns=0, settle_s=0.2, prefill_metrics=stack.urls("prefill")[0] + "/metrics",
            think=think, seed=seed)
        self.decodes = {p.name: p.url for p in stack.state.procs if p.role == "decode"}
        self.holder: dict[int, str | None] = {}
        self.left: set[str] = set()
        self.failed = 0
        self.event_records: list[lc.EventRecord] = []
        self._worker: threading.Thread | None = None
        self._errors: list[BaseException] = []

    # -- which replica decoded a turn ----------------------------------------------------
    def _served(self) -> dict[str, float | None]:
        return {name: promtext.total(promtext.scrape(url + "/metrics", timeout=2.0),
                                     "vllm:request_success_total")
                for name, url in self.decodes.items()}

    def _decoded_by(self, before: dict[str, float | None]) -> str | None:
        deadline = time.monotonic() + HOLDER_WAIT_S
        while True:
            after = self._served()
            grew = [n for n in self.decodes if before[n] is not None
                    and after[n] is not None and after[n] > before[n]]
            if grew or time.monotonic() > deadline:
                return grew[0] if grew else None
            time.sleep(0.05)

    # -- events ------------------------------------------------------------------------
    def _wait_router(self, decodes: int, timeout: float = 120.0) -> None:
        """Until the router serves and counts `decodes` healthy decode replicas."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = ready(self.stack.router_url)
            if r.get("ready") and (r.get("decode") or {}).get("healthy") == decodes:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the router did not count {decodes} healthy decode replicas "
                           f"within {timeout:.0f} s: {ready(self.stack.router_url)}")

    def _settle_previous(self) -> None:
        if self._worker is not None:
            self._worker.join()
            self._worker = None
        if self._errors:
            raise self._errors[0]
        self._wait_router(len(self.decodes) - len(self.left))

    def _do(self, ev: lc.Event, rec: lc.EventRecord) -> None:
        def say(line: str) -> None:
            rec.lines.append(line)
            self.say(f"{self.mode}: {line}")

        grace = DRAIN_S + self.stack.spec.engine.termination_grace_period_seconds
        try:
            drop = self.mode == "drop"
            if ev.action == lc.RESTART:
                done = restart_server(self.stack.state_dir, ev.target, drop=drop,
                                      wait_s=grace + 60, say=say)
                rec.stop_s, rec.stopped, rec.start_s = (done.stopped.seconds,
                                                        done.stopped.exited, done.start_s)
            else:
                stopped = stop_server(self.stack.state_dir, ev.target, drop=drop,
                                      wait_s=grace + 60, say=say)
                rec.stop_s, rec.stopped = stopped.seconds, stopped.exited
                self.left.add(ev.target)
            ends = [ln.split("drain ended (", 1)[1].split(")", 1)[0] for ln in rec.lines
                    if "drain ended (" in ln]
            rec.drain_end = ends[-1] if ends else None
        except BaseException as exc:  # surfaced by the trace's thread at the next event
            self._errors.append(exc)

    def _fire(self, i: int, t0: float) -> None:
        self._settle_previous()
        ev = self.events[i]
        held = sorted(c for c, h in self.holder.items()
                      if h is not None and (ev.target == "router" or h == ev.target))
        rec = lc.EventRecord(ev, self.mode if self.mode in lc.MODES else "baseline",
                             time.monotonic() - t0, held)
        self.event_records.append(rec)
        if self.mode not in lc.MODES:
            return  # the same barrier, nothing done: the turns it is compared with
        self.say(f"{self.mode}: {ev.name} after turn {ev.after_turn}; held there: "
                 f"conversations {held}")
        if ev.target == "router":
            # No client reaches a router that is down: the trace waits for it.
            self._do(ev, rec)
            self._settle_previous()
        else:
            # The trace goes on meanwhile: the drain ends as its conversations come back.
            log = self.stack.log_path("router")
            seen = log.stat().st_size if log.exists() else 0
            self._worker = threading.Thread(target=self._do, args=(ev, rec), daemon=True)
            self._worker.start()
            if self.mode == "drain":
                self._wait_drain_seen(log, seen, self.decodes[ev.target])

    def _wait_drain_seen(self, log: pathlib.Path, offset: int, url: str,
                         timeout: float = 20.0) -> None:
        """Until the router has seen the drain (its next health round reads the replica's
        report), as a pod's endpoints leave a Service before its traffic stops: a turn
        sent before would be placed on the leaving replica again, and held there."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(log, "rb") as f:
                f.seek(offset)
                if f"decode {url} is draining".encode() in f.read():
                    return
            time.sleep(0.1)
        self.say(f"{self.mode}: the router did not report the drain of {url} within "
                 f"{timeout:.0f} s; the trace goes on")

    # -- the trace -----------------------------------------------------------------------
    def _turn(self, runner: Runner, conv: Conversation, think: float, t0: float
              ) -> dict[str, Any]:
        t = conv.turns_done + 1
        failed = 0
        while True:
            before = self._served()
            at = time.monotonic() - t0
            try:
                rec = runner.turn(conv, t, measure=True, think_s=think)
                break
            except RequestFailed as exc:
                conv.messages.pop()  # the unanswered question; asked again
                failed += 1
                self.say(f"{self.mode}: conversation {conv.index} turn {t} failed "
                         f"({exc}); attempt {failed + 1}")
                if failed >= ATTEMPTS:
                    raise
                time.sleep(1.0)
        holder = self._decoded_by(before)
        self.holder[conv.index] = holder
        out = rec.to_json()
        out.pop("text", None)  # the digest is compared; the texts are in no table
        return {**out, "at_s": at, "holder": holder, "failed_attempts": failed}

    def run(self) -> dict[str, Any]:
        from tqdm import tqdm

        c = self.cfg
        runner = Runner(c, progress=False)
        runner.model = first_model(c.url)
        run_id = f"lifecycle-{c.seed}-{self.mode}-{int(time.time())}"
        convs = {i: Conversation(i, f"{run_id}-c{i}") for i in range(c.conversations)}
        due: dict[int, float] = dict.fromkeys(convs, 0.0)
        thinks: dict[int, float] = dict.fromkeys(convs, 0.0)
        records: list[dict[str, Any]] = []
        fired = 0
        bar = tqdm(total=c.turns * c.conversations, desc=f"lifecycle {self.mode}",
                   unit="turn", disable=not self.progress, file=sys.stderr)
        t0 = time.monotonic()
        try:
            while (step := lc.next_step({i: cv.turns_done for i, cv in convs.items()}, due,
                                        self.events, fired, c.turns)) is not None:
                kind, idx = step
                if kind == "event":
                    bar.set_postfix_str(f"event: {self.events[idx].name}")
                    self._fire(idx, t0)
                    fired += 1
                    # Think time runs from the later of the answer and the barrier's end:
                    # a restart waited for does not eat the pause before the next turn.
                    now = time.monotonic()
                    due = {i: max(at, now + thinks[i]) for i, at in due.items()}
                    continue
                if (wait := due[idx] - time.monotonic()) > 0:
                    bar.set_postfix_str(f"conversation {idx} thinks {wait:.0f} s")
                    time.sleep(wait)
                rec = self._turn(runner, convs[idx], thinks[idx], t0)
                self.failed += rec["failed_attempts"]
                records.append(rec)
                bar.update(1)
                bar.set_postfix_str(f"c{idx} turn {rec['turn']} on {rec['holder']} ttft "
                                    f"{rec['ttft_s'] * 1000:.0f} ms {rec['reason']}")
                nxt = c.think.before(c.seed, idx, rec["turn"] + 1)
                due[idx], thinks[idx] = time.monotonic() + nxt, nxt
            self._settle_previous()
        finally:
            bar.close()
        return {"mode": self.mode, "wall_s": time.monotonic() - t0, "records": records,
                "events": [e.to_json() for e in self.event_records],
                "failed_attempts": self.failed,
                "config": {"conversations": c.conversations, "turns": c.turns,
                           "new_tokens": c.new_tokens, "output_tokens": c.output_tokens,
                           "think": c.think.describe(), "seed": c.seed,
                           "drain_seconds": DRAIN_S}}


def run_mode(mode: str, size: Size, args: argparse.Namespace,
             say: Callable[[str], None]) -> dict[str, Any]:
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    state_dir = args.out / "state" / mode
    stack = prepare_stack(args.spec, state_dir, patch=stack_patch(args.model, mode),
                          tiny_model=True, cwd=work, progress=not args.no_progress)
    try:
        t = time.monotonic()
        stack.start(progress=not args.no_progress)
        say(f"{mode}: stack up in {time.monotonic() - t:.0f} s (router {stack.router_url})")
        doc = Trace(stack, mode, size, args.seed, not args.no_progress, say).run()
        doc["grace_s"] = DRAIN_S + stack.spec.engine.termination_grace_period_seconds
        return doc
    finally:
        # A restarted server is in the state file only; the stack object knows the first.
        stop_recorded(state_dir)
        stack.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: "
                   f"{QUICK.conversations} conversations x {QUICK.turns} turns")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS),
                   help="which runs (the table needs baseline, drop and drain; the output "
                        "check needs off)")
    p.add_argument("--spec", type=pathlib.Path, default=ROOT / "examples" / "local.yaml")
    p.add_argument("--model", type=pathlib.Path, default=None,
                   help="the tiny model's folder (built there, float32, when missing)")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "out" / "lifecycle")
    p.add_argument("--plot", type=pathlib.Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", help="the commit measured, when this tree is an export of "
                   "it (default: this tree's git HEAD)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report-only", action="store_true",
                   help="no run: the table, verdict and plot of the runs saved in --out")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    args.model = (args.model or args.out / "models" / "tiny-llama-f32").resolve()
    size = QUICK if args.quick else FULL
    plot = args.plot or (args.out / "lifecycle_ttft.png" if args.quick
                         else ROOT / "docs" / "img" / "lifecycle_ttft.png")

    def say(line: str) -> None:
        from tqdm import tqdm

        tqdm.write(f"lifecycle: {line}", file=sys.stderr)

    measured = args.commit or commit()
    cpu = read_cpu()
    say(f"{cpu.describe()}; commit {measured}")
    runs: dict[str, dict[str, Any]] = {}
    if args.report_only:
        runs = {m: json.loads((args.out / f"{m}.json").read_text()) for m in args.runs
                if (args.out / f"{m}.json").exists()}
    for mode in () if args.report_only else args.runs:
        runs[mode] = run_mode(mode, size, args, say)
        path = args.out / f"{mode}.json"
        path.write_text(json.dumps(runs[mode], indent=1) + "\n")
        say(f"{mode}: {len(runs[mode]['records'])} turns in {runs[mode]['wall_s']:.0f} s, "
            f"{runs[mode]['failed_attempts']} failed attempts -> {path}")
    grace = next((r["grace_s"] for r in runs.values()), None)
    rows = lc.rows(runs, grace)
    aims = lc.verdict(rows, runs)
    from bidirkv.bench.stats import format_aims

    text = lc.table_text(rows)
    print(text)
    print(format_aims(aims))
    summary = {"kind": "bidirkv-lifecycle-bench", "commit": measured, "cpu": cpu.to_json(),
               "cpus": os.cpu_count(), "size": size.__dict__, "grace_s": grace, "rows": rows,
               "aims": [a.__dict__ for a in aims],
               "wall_s": {m: r["wall_s"] for m, r in runs.items()}}
    (args.out / "lifecycle.json").write_text(json.dumps(summary, indent=1) + "\n")
    if any(m in runs for m in lc.MODES):
        ttft_timeline(runs, [m for m in ("drop", "drain") if m in runs], plot,
                      f"TTFT over the run, 1P2D, {size.conversations} conversations "
                      f"(commit {measured.split()[0]})")
        print(f"plot: {plot}")
    print(f"json: {args.out / 'lifecycle.json'}")
    return 0 if all(a.met is not False for a in aims) else 1


if __name__ == "__main__":
    sys.exit(main())
