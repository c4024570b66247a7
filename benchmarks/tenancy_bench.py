"""Tenants against decode's retention: one run of the figures (not a test).

Each row is a `Row` in ROWS: a measurement, the figures it returns, and the aims they are
held to; a new row needs only its `measure`, its aims and a line of the table. The two
rows on real vLLM share one 1P1D stack of the tiny model (e2e/vllm_stack.py's spec, float32,
decode of DECODE_BLOCKS blocks, `retentionWatermark` WATERMARK), each with its own router.

- decode reclaim, many tenants: N tenant labels each hold `--entries` retained requests
  of one block (gaps spread, some without one); the scheduler step's own call,
  `Residency.reclaim(releases, "watermark")` (bidirkv/connector/core/residency.py, the
  call bidirkv/connector/patches/residency.py makes under the residency's lock), then
  releases `--releases` of them. Timed around that call, at N = 50, 500 and 5,000, over
  `--repeats` fresh residencies each. Aim: the median at the most tenants at most 10x
  the median at the fewest (a scan over every tenant per release grows with them, 100x
  here). `--residency-at REV` times the residency.py of an earlier commit instead, for a
  before-and-after in one sitting.
- an extend at the watermark: under `thresholds` (extends up to 4,000 new tokens), a
  conversation of 1,600 then +1,800 then +200 words (tokens of the tiny model): turn 2 is
  extended on decode, whose history then fills about 26 of the 32 blocks retention may
  pin. Aim: turn 3 still reuses it (placed `extend` or `read_back`); the router's handle
  count before and after each turn and decode's prefix-cache hits are shown beside.
- `cache_salt` across tenants: under `cost` (a first turn runs whole on the idle decode,
  where retention keeps every tenant's prompt), tenant A sends a prompt, then A repeats
  it, tenant B sends it and B sends a fresh one of the same length, `--samples` times with
  a new prompt each, streamed, timed to the first content byte
  (bidirkv/bench/client.py). Aims: B on A's prompt within 0.8-1.25x of fresh (p50), and
  A's repeat faster than fresh.

Prints a table, writes out/bench/tenancy.json and, with matplotlib, docs/img/tenancy.png.

    .venv/bin/python benchmarks/tenancy_bench.py
    # before and after aa8570b (indexed release orders), in one sitting:
    .venv/bin/python benchmarks/tenancy_bench.py --residency-at aa8570b^ \
        --out out/bench/before --img out/bench/before/tenancy.png
    .venv/bin/python benchmarks/tenancy_bench.py --before out/bench/before/tenancy.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
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
sys.path.insert(1, str(ROOT / "tests"))  # e2e/vllm_stack.py's otlp_receiver
sys.path.insert(2, str(ROOT / "benchmarks"))

import rows  # noqa: E402
from router_bench import pct  # noqa: E402

from bidirkv.bench import plots, promtext  # noqa: E402
from bidirkv.connector.core.residency import Residency  # noqa: E402

RETENTION_S = 900.0  # the entries' deadline: far beyond the run, so none nears expiry


@dataclass
class Row:
    name: str
    measure: Callable[[argparse.Namespace], dict[str, Any]]
    aims: list[rows.Aim]
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


# -- real vLLM: one 1P1D stack for the rows below ---------------------------------------------
DECODE_BLOCKS = 64   # small decode KV: one long conversation reaches the watermark
WATERMARK = 0.5      # retention budget: 32 blocks of 128 tokens


def vllm_stack(args: argparse.Namespace) -> Any:
    """The stack both real-vLLM rows share, started on first use (closed by `run`)."""
    if getattr(args, "stack", None) is None:
        from bidirkv.local.model import build_model
        from e2e.vllm_stack import running_stack, spec_for

        root = (args.out / "tenancy-stack").resolve()
        root.mkdir(parents=True, exist_ok=True)
        doc = spec_for(build_model(root / "model", dtype="float32"))
        doc["kvTransfer"]["retentionWatermark"] = WATERMARK
        args.stack = args.closing.enter_context(running_stack(
            root, doc, {"decode": ["--num-gpu-blocks-override", str(DECODE_BLOCKS)]}))
    return args.stack


def router_samples(url: str) -> promtext.Samples:
    """The router's metrics, scraped once (a table's figures from one instant); a router
    that does not answer fails the run rather than reading as zeros."""
    samples = promtext.scrape(url + "/metrics")
    if samples is None:
        raise RuntimeError(f"the router at {url} did not answer /metrics")
    return samples


def count(samples: promtext.Samples, name: str, **labels: str) -> float:
    """The sum of the samples `name` with `labels` (0 when there are none)."""
    return promtext.total(samples, name, **labels) or 0.0


def measure_salt(args: argparse.Namespace) -> dict[str, Any]:
    from bidirkv.bench.client import chat as timed_chat
    from bidirkv.local.model import random_text
    from e2e.vllm_stack import MODEL, metric, metric_reaches, running_router

    s = vllm_stack(args)
    kinds = ("A repeats its prompt", "B sends A's prompt", "B sends a fresh prompt")
    ttft: dict[str, list[float]] = {k: [] for k in kinds}
    hits: dict[str, list[float]] = {k: [] for k in kinds}
    # `cost`: a first turn runs whole on decode when both are idle, where retention keeps
    # every tenant's prompt (the stack's spec names `alwaysDisaggregate`); the cap lets
    # decode take the whole prompt
    cost = {"policy": "cost", "maxLocalPrefillTokens": 4000}
    with running_router(s, "router-salt", placement=cost) as (url, _):

        def ask(text: str, who: str) -> tuple[float, float]:
            q, h = metric(s.d_url, "vllm:prefix_cache_queries_total"), metric(
                s.d_url, "vllm:prefix_cache_hits_total")
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}],
                    "stream": True, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            reply = timed_chat(url, body, {"Authorization": f"Bearer {who}"}, timeout=120)
            metric_reaches(s.d_url, "vllm:prefix_cache_queries_total", q + 1)
            return reply.ttft_s * 1000, metric(s.d_url, "vllm:prefix_cache_hits_total") - h

        ask(random_text(args.salt_words, seed=7000), "a")  # the router learns a prompt
        for i in range(args.samples):
            prompt = random_text(args.salt_words, seed=7100 + i)
            ask(prompt, "a")
            for kind, text, who in ((kinds[0], prompt, "a"), (kinds[1], prompt, "b"),
                                    (kinds[2], random_text(args.salt_words, seed=7500 + i),
                                     "b")):
                ms, hit = ask(text, who)
                ttft[kind].append(ms)
                hits[kind].append(hit)
            print(f"  sample {i + 1}: " + ", ".join(f"{ttft[k][-1]:.0f} ms" for k in kinds),
                  flush=True)
        m = router_samples(url)
        placements = {d: count(m, "bidirkv_router_placements_total", decision=d)
                      for d in ("extend", "decode", "read_back", "prefill", "move")}
    figures = {k: {"p50_ms": statistics.median(v), "p90_ms": pct(v, 0.9), "runs_ms": v,
                   "decode_prefix_hits_median": statistics.median(hits[k])}
               for k, v in ttft.items()}
    fresh = figures[kinds[2]]["p50_ms"]
    return {"samples": args.samples, "prompt_words": args.salt_words, "kinds": figures,
            "b_on_a_over_fresh": figures[kinds[1]]["p50_ms"] / fresh,
            "a_repeat_over_fresh": figures[kinds[0]]["p50_ms"] / fresh,
            "placements": placements}


def salt_table(f: dict[str, Any]) -> list[str]:
    lines = [f"  {'request':<26}{'TTFT p50':>10}{'p90':>9}{'decode hits':>13}"
             f"  ({f['samples']} samples, {f['prompt_words']}-word prompts)"]
    lines += [f"  {k:<26}{v['p50_ms']:>8.0f}ms{v['p90_ms']:>7.0f}ms"
              f"{v['decode_prefix_hits_median']:>13.0f}" for k, v in f["kinds"].items()]
    lines.append(f"  placements: {f['placements']}")
    return lines


def measure_extend(args: argparse.Namespace) -> dict[str, Any]:
    from bidirkv.local.model import random_text
    from e2e.vllm_stack import chat, metric, running_router, stream, stream_text

    s = vllm_stack(args)
    cap = {"policy": "thresholds", "localPrefillTokens": 4000, "maxLocalPrefillTokens": 4000}
    turns = []
    with running_router(s, "router-extend", placement=cap) as (url, _):
        warm = chat([{"role": "user", "content": random_text(50, seed=8999)}], stream=True)
        stream_text(stream(url + "/v1/chat/completions", warm))  # learns a token count
        messages: list[dict] = []
        for n, words in enumerate((1600, 1800, 200), 1):
            messages.append({"role": "user", "content": random_text(words, seed=9000 + n)})
            m = router_samples(url)
            before = {d: count(m, "bidirkv_router_placements_total", decision=d)
                      for d in ("extend", "read_back", "prefill", "decode", "move")}
            reuse = metric(s.d_url, "vllm:prefix_cache_hits_total")
            handles = count(m, "bidirkv_router_handles")
            text = stream_text(stream(url + "/v1/chat/completions",
                                      chat(list(messages), stream=True)))
            messages.append({"role": "assistant", "content": text})
            time.sleep(0.5)  # the router's put and decode's step stats land after the reply
            m = router_samples(url)
            after = {d: count(m, "bidirkv_router_placements_total", decision=d)
                     for d in before}
            turns.append({
                "turn": n, "new_words": words,
                "placement": [d for d in before if after[d] > before[d]],
                "handles_before": handles,
                "handles_after": count(m, "bidirkv_router_handles"),
                "decode_prefix_hits": metric(s.d_url, "vllm:prefix_cache_hits_total")
                - reuse,
                "router_reuse": {o: count(m, "bidirkv_router_reuse_total", outcome=o)
                                 for o in ("hit", "extended", "miss")},
                "evictions": {r: count(m, "bidirkv_router_handle_evictions_total", reason=r)
                              for r in ("extended", "watermark", "pressure")},
            })
            print(f"  turn {n}: {turns[-1]['placement']}, handles "
                  f"{turns[-1]['handles_before']:.0f} -> {turns[-1]['handles_after']:.0f}, "
                  f"decode hits {turns[-1]['decode_prefix_hits']:.0f}", flush=True)
    last = turns[-1]
    return {"decode_blocks": DECODE_BLOCKS, "watermark": WATERMARK, "turns": turns,
            "turn3_reused": bool({"extend", "read_back"} & set(last["placement"]))}


def extend_table(f: dict[str, Any]) -> list[str]:
    lines = [f"  {'turn':>5} {'placement':<12}{'handles':>10}  evictions"
             f"  (decode {f['decode_blocks']} blocks, watermark {f['watermark']})"]
    lines += [f"  {t['turn']:>5} {','.join(t['placement']) or '-':<12}"
              f"{t['handles_before']:>4.0f} ->{t['handles_after']:>2.0f}"
              f"  {t['evictions']}, decode hits "
              f"{t['decode_prefix_hits']:.0f}" for t in f["turns"]]
    return lines

ROWS = [
    Row("decode reclaim, many tenants", measure_reclaim,
        [("median grows <=10x over the tenants", lambda f: f["growth"] <= 10.0,
          lambda f: f"{f['growth']:.2f}x ({f['points'][0]['tenants']} -> "
                    f"{f['points'][-1]['tenants']} tenants)")],
        reclaim_table),
    Row("an extend at the watermark", measure_extend,
        [("turn 3 still reused", lambda f: f["turn3_reused"],
          lambda f: ",".join(f["turns"][-1]["placement"]) or "-")],
        extend_table),
    Row("cache_salt across tenants", measure_salt,
        [("B on A's prompt within 0.8-1.25x fresh",
          lambda f: 0.8 <= f["b_on_a_over_fresh"] <= 1.25,
          lambda f: f"{f['b_on_a_over_fresh']:.2f}x"),
         ("A's repeat faster than fresh", lambda f: f["a_repeat_over_fresh"] < 1.0,
          lambda f: f"{f['a_repeat_over_fresh']:.2f}x")],
        salt_table),
]


def run(args: argparse.Namespace) -> dict[str, Any]:
    with contextlib.ExitStack() as args.closing:
        args.stack = None
        return rows.run_rows(ROWS, lambda row: row.measure(args), args.rows)


def report(r: dict[str, Any]) -> str:
    lines = [rows.cpu_line(r["machine"])]
    for row in ROWS:
        figures = r["rows"].get(row.name)
        if figures is None:
            continue
        lines += ["", row.name, *row.table(figures)]
        for aim, holds, shown in row.aims:
            lines.append(f"  aim {aim}: {'met' if holds(figures) else 'NOT met'}, "
                         f"{shown(figures)}")
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path, before: dict[str, Any] | None = None) -> bool:
    """Draw the figure to `path`; False when there is none to draw."""
    plt = rows.pyplot()
    f = r["rows"].get("decode reclaim, many tenants")
    if plt is None or not f:
        return False
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
    plots.save(plt, fig, path)
    return True


def main() -> int:
    ap = rows.parser(__doc__, ROWS)
    ap.add_argument("--tenants", type=int, nargs="+", default=[50, 500, 5000])
    ap.add_argument("--entries", type=int, default=8, help="retained requests per tenant")
    ap.add_argument("--releases", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--residency-at", metavar="REV",
                    help="time residency.py as it was at this commit (default: this tree)")
    ap.add_argument("--before", type=Path, metavar="JSON",
                    help="a tenancy.json of an earlier run (--residency-at) to plot beside")
    ap.add_argument("--samples", type=int, default=10, help="cache_salt: samples of each")
    ap.add_argument("--salt-words", type=int, default=1200,
                    help="cache_salt: prompt length in words (tokens of the tiny model)")
    ap.add_argument("--img", type=Path, default=ROOT / "docs" / "img" / "tenancy.png")
    args = rows.parse(ap, ROWS)
    for name in ("entries", "releases", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} {getattr(args, name)}: must be at least 1")
    if min(args.tenants) < 1:
        ap.error(f"--tenants {args.tenants}: each must be at least 1")
    args.tenants = sorted(args.tenants)
    before = json.loads(args.before.read_text()) if args.before else None
    result = run(args)
    return rows.finish(result, report(result), args.out, "tenancy",
                       lambda path: plot(result, path, before), args.img)


if __name__ == "__main__":
    sys.exit(main())
