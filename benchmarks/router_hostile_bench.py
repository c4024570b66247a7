"""Hostile clients against the router: one run of the figures (not a test).

Each row is a `Row` in ROWS: a router process of its own (its config), fake engine
processes on 127.0.0.1 (tests/fake_engine.py), a measurement and the aims it is held to.
A row added later needs only its `measure` and its aims.

- slow uploads: 50 connections that each declare a 4 MiB body and send it at 4 KiB/s
  (under the router's minimum rate), then at 40 KiB/s (over it; together they reach the
  bytes budget that bodies in progress may use), each reconnecting whenever the router
  answers, while a small chat turn goes every 25 ms. Aims: the small turn's p99 at most
  100 ms above its baseline alone, and no 429 (nor 5xx) for any small turn.
- long model name: 40 requests, each naming a 2,000,000-character model, with tracing
  to a file (every request sampled, the client's traceparent sampled too). Aim: the
  router's RSS grows by under 64 MB (a span kept every name whole would be ~80 MB in the
  export queue alone).

Prints a table, writes out/bench/router-hostile.json and, with matplotlib, a PNG.

    .venv/bin/python benchmarks/router_hostile_bench.py
    .venv/bin/python benchmarks/router_hostile_bench.py --rows "2,000,000-char model, traced"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

import rows  # noqa: E402
from router_bench import pct, pin, rss_mb  # noqa: E402
from router_hardening_bench import engine_processes, small_turns, split_cpus  # noqa: E402
from router_process import RouterProcess  # noqa: E402

from bidirkv.bench import plots  # noqa: E402

MIB = 1 << 20
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@dataclass
class Stand:
    """What a row's measurement gets: the router's URL and pid, the engines' URLs and the
    CPUs left to the client side."""

    url: str
    pid: int
    engines: tuple[str, str]
    cpus: set[int] | None
    tmp: Path


@dataclass
class Row:
    name: str
    config: Callable[[Path], dict[str, Any]]  # the router's config beyond its engines
    measure: Callable[[Stand, argparse.Namespace], Awaitable[dict[str, Any]]]
    aims: list[rows.Aim]


# -- slow uploads ---------------------------------------------------------------------------
# The slow uploads run in a process of their own (on the client's CPUs), so that this one
# only measures: each client reopens at once whatever the router answered.
SLOW_UPLOADS = """
import asyncio, json, sys

async def slow_upload(host, port, declared, rate, stop, tally):
    piece = max(1, int(rate / 4))
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.1)
            continue
        tally["opened"] += 1
        try:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\\r\\nHost: x\\r\\n"
                         b"Content-Type: application/json\\r\\n"
                         b"Content-Length: %d\\r\\n\\r\\n{" % declared)
            await writer.drain()
            answered = asyncio.ensure_future(reader.readline())
            while not stop.is_set() and not answered.done():
                writer.write(b" " * piece)
                await writer.drain()
                await asyncio.wait([answered], timeout=0.25)
            if answered.done() and not answered.cancelled() and answered.exception() is None:
                status = answered.result().split(b" ")[1:2]
                key = "answered_" + status[0].decode() if status else "closed"
                tally[key] = tally.get(key, 0) + 1
            answered.cancel()
        except OSError:
            tally["closed"] = tally.get("closed", 0) + 1
        finally:
            writer.close()

async def main(host, port, n, declared, rate):
    stop, tally = asyncio.Event(), {"opened": 0}
    tasks = [asyncio.ensure_future(slow_upload(host, port, declared, rate, stop, tally))
             for _ in range(n)]
    print("open", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    stop.set()
    await asyncio.gather(*tasks)
    print(json.dumps(tally), flush=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:6])))
"""


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def slow_uploads(rate: int, seconds: float
                 ) -> Callable[[Stand, argparse.Namespace], Awaitable[dict[str, Any]]]:
    """The measurement of small turns for `seconds` beside uploads at `rate` bytes/s."""

    async def measure(stand: Stand, args: argparse.Namespace) -> dict[str, Any]:
        port = stand.url.rsplit(":", 1)[1]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            base, base_status = await small_turns(s, stand.url, time.monotonic() + 4.0)
            uploads = await asyncio.create_subprocess_exec(
                sys.executable, "-c", SLOW_UPLOADS, "127.0.0.1", port,
                str(args.slow_uploads), str(4 * MIB), str(rate),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                preexec_fn=pin(stand.cpus))
            assert uploads.stdin is not None and uploads.stdout is not None
            await uploads.stdout.readline()  # "open"
            await asyncio.sleep(0.5)  # all of them open
            cpu0 = cpu_seconds(stand.pid)
            during, during_status = await small_turns(s, stand.url,
                                                      time.monotonic() + seconds)
            router_cpu = (cpu_seconds(stand.pid) - cpu0) / seconds
            uploads.stdin.write(b"stop\n")
            await uploads.stdin.drain()
            tally = json.loads(await uploads.stdout.readline())
            await uploads.wait()
        statuses = base_status + during_status
        return {"connections": args.slow_uploads, "declared_bytes": 4 * MIB,
                "upload_rate_bytes_s": rate, "seconds": seconds,
                "baseline_ms": {"p50": pct(base, 0.5), "p99": pct(base, 0.99),
                                "n": len(base)},
                "during_ms": {"p50": pct(during, 0.5), "p99": pct(during, 0.99),
                              "n": len(during)},
                "added_p99_ms": pct(during, 0.99) - pct(base, 0.99),
                "small_429": statuses.count(429),
                "small_5xx": sum(1 for x in statuses if x >= 500),
                "router_cpu_share": router_cpu, "slow_uploads": tally}

    return measure


# -- long model name, traced ------------------------------------------------------------------
async def measure_long_model(stand: Stand, args: argparse.Namespace) -> dict[str, Any]:
    model = "m" * 2_000_000
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    statuses: list[int] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        for i in range(3):  # warm: the first requests grow the heap whatever they carry
            async with s.post(stand.url + "/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": f"w{i}"}]}) as r:
                await r.read()
        await asyncio.sleep(0.5)
        before = rss_mb(stand.pid)
        peak = before
        for _ in range(args.long_models):
            async with s.post(stand.url + "/v1/chat/completions", data=body, headers={
                    "Content-Type": "application/json", "traceparent": TRACEPARENT}) as r:
                await r.read()
                statuses.append(r.status)
            peak = max(peak, rss_mb(stand.pid))
        await asyncio.sleep(6.0)  # the batch processor exports every 5 s
        after = rss_mb(stand.pid)
    spans = stand.tmp / "spans.jsonl"
    longest = 0
    if spans.exists():
        for line in spans.read_text().splitlines():
            attrs = json.loads(line).get("attributes", {})
            longest = max([longest] + [len(v) for v in attrs.values() if isinstance(v, str)])
    return {"requests": args.long_models, "model_chars": len(model),
            "rss_before_mb": before, "rss_peak_mb": peak, "rss_after_mb": after,
            "rss_growth_mb": max(peak, after) - before,
            "span_file_bytes": spans.stat().st_size if spans.exists() else 0,
            "longest_attribute_chars": longest,
            "statuses": {str(k): statuses.count(k) for k in sorted(set(statuses))}}


def small_turn_aims() -> list[rows.Aim]:
    return [("small_p99_added<=100ms", lambda f: f["added_p99_ms"] <= 100,
             lambda f: f"{f['added_p99_ms']:.1f} ms (p99 {f['baseline_ms']['p99']:.1f} -> "
                       f"{f['during_ms']['p99']:.1f} ms)"),
            ("small_429==0", lambda f: f["small_429"] == 0,
             lambda f: f"{f['small_429']} of {f['baseline_ms']['n'] + f['during_ms']['n']}"),
            ("small_5xx==0", lambda f: f["small_5xx"] == 0, lambda f: str(f["small_5xx"]))]


ROWS = [
    # Under the router's minimum upload rate: each is cut off after the grace.
    Row("slow uploads, 4 KiB/s", lambda tmp: {}, slow_uploads(4096, 10.0),
        small_turn_aims()),
    # Just over it for 20 s: together they hold more than the bytes budget bodies in
    # progress may use, and the small turns take the reserve.
    Row("slow uploads, 40 KiB/s", lambda tmp: {}, slow_uploads(40 * 1024, 20.0),
        small_turn_aims()),
    Row("2,000,000-char model, traced",
        lambda tmp: {"tracing": {"file": str(tmp / "spans.jsonl"), "sampleRatio": 1.0}},
        measure_long_model,
        [("rss_growth<64MB", lambda f: f["rss_growth_mb"] < 64,
          lambda f: f"{f['rss_growth_mb']:.1f} MB ({f['rss_before_mb']:.0f} -> "
                    f"{max(f['rss_peak_mb'], f['rss_after_mb']):.0f} MB)"),
         ("attributes<=256 chars", lambda f: f["longest_attribute_chars"] <= 256,
          lambda f: f"{f['longest_attribute_chars']} chars, span file "
                    f"{f['span_file_bytes'] / 1024:.0f} KiB")]),
]


async def run_row(row: Row, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    router_cpus, other_cpus = split_cpus()
    async with engine_processes(other_cpus) as engines:
        rowdir = tmp / f"row-{len(list(tmp.iterdir()))}"
        rowdir.mkdir()
        cfg = rowdir / "router.json"
        cfg.write_text(json.dumps({"prefill": [engines[0]], "decode": [engines[1]],
                                   **row.config(rowdir)}))
        r = await RouterProcess(cfg, None, rowdir / "router.log",
                                env={"BIDIRKV_LOG_LEVEL": "WARNING"},
                                preexec=pin(router_cpus)).start()
        try:
            return await row.measure(Stand(r.url, r.proc.pid, engines, other_cpus, rowdir),
                                     args)
        finally:
            r.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    # Each row on an event loop of its own: it starts and stops its own processes anyway.
    with tempfile.TemporaryDirectory(prefix="bidirkv-hostile-") as tmpdir:
        return rows.run_rows(ROWS, lambda row: asyncio.run(run_row(row, args, Path(tmpdir))),
                             args.rows)


def report(r: dict[str, Any]) -> str:
    lines = [rows.cpu_line(r["machine"]), "",
             f"  {'row':<30}{'aim':<26}{'met':<5}figure"]
    for row in ROWS:
        figures = r["rows"].get(row.name)
        if figures is None:
            continue
        for aim, holds, shown in row.aims:
            lines.append(f"  {row.name:<30}{aim:<26}{'yes' if holds(figures) else 'NO':<5}"
                         f"{shown(figures)}")
    for name, figures in r["rows"].items():
        if "slow_uploads" in figures:
            lines.append(f"{name}: router CPU {figures['router_cpu_share']:.0%} of a core; "
                         "connections " + ", ".join(
                             f"{k} {v}" for k, v in sorted(figures["slow_uploads"].items())))
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> bool:
    """Draw the figure to `path`; False when there is none to draw."""
    plt = rows.pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    slow = {n: f for n, f in r["rows"].items() if "slow_uploads" in f}
    if slow:
        axes[0].bar(["alone"] + [n.split(", ")[1] for n in slow],
                    [max(f["baseline_ms"]["p99"] for f in slow.values())]
                    + [f["during_ms"]["p99"] for f in slow.values()])
        axes[0].set_ylabel("small turn p99 (ms)")
        axes[0].set_title("50 slow uploads (429s to small turns: "
                          f"{sum(f['small_429'] for f in slow.values())})")
    long = r["rows"].get("2,000,000-char model, traced")
    if long:
        axes[1].bar(["before", "peak", "after"], [long["rss_before_mb"], long["rss_peak_mb"],
                                                  long["rss_after_mb"]])
        axes[1].set_ylabel("router RSS (MB)")
        axes[1].set_title(f"{long['requests']} x 2,000,000-char model, traced")
    fig.suptitle(f"router, hostile clients - {r['machine']['model']} ({r['machine']['isa']})")
    plots.save(plt, fig, path)
    return True


def main() -> int:
    ap = rows.parser(__doc__, ROWS)
    ap.add_argument("--slow-uploads", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=10.0,
                    help="how long the small turns run beside the slow uploads")
    ap.add_argument("--long-models", type=int, default=40)
    args = rows.parse(ap, ROWS)
    result = run(args)
    return rows.finish(result, report(result), args.out, "router-hostile",
                       lambda path: plot(result, path))


if __name__ == "__main__":
    sys.exit(main())
