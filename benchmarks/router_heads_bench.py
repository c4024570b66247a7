"""Silent request heads against the router: one run of the figures (not a test).

520 connections from 127.0.0.2 that each send a request head declaring a small body and
nothing more, reconnecting as soon as the router answers (a 408 once the upload grace has
passed, a 429, or a close), while a small chat goes from 127.0.0.1 every 100 ms for 6 s,
each given 2 s. One router process (tests/router_process.py) at its default limits (512
in-flight slots) over fake engine processes (tests/fake_engine.py); on 2+ CPUs the router
has a CPU of its own. Aim: at least 90 % of the small chats answered 200 within 2 s.
With --base DIR the same runs against a router from another checkout as well (a
`git worktree` of the commit before a change), on the same machine in the same run.

Prints a table, writes out/bench/router-heads.json and, with matplotlib, a PNG.

    .venv/bin/python benchmarks/router_heads_bench.py [--connections 520] [--base DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

import rows  # noqa: E402
from router_bench import pct, pin  # noqa: E402
from router_hardening_bench import engine_processes, split_cpus  # noqa: E402
from router_hostile_bench import cpu_seconds  # noqa: E402
from router_process import RouterProcess  # noqa: E402

from bidirkv.bench import plots  # noqa: E402

ATTACKER = "127.0.0.2"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}

# In a process of its own (on the client's CPUs), so that this one only measures.
SILENT_HEADS = """
import asyncio, json, sys

HEAD = (b"POST /v1/chat/completions HTTP/1.1\\r\\nHost: x\\r\\n"
        b"Content-Type: application/json\\r\\nContent-Length: 100\\r\\n\\r\\n")

async def silent(port, source, stop, tally):
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=(source, 0))
        except OSError:
            tally["connect_failed"] = tally.get("connect_failed", 0) + 1
            await asyncio.sleep(0.1)
            continue
        tally["opened"] += 1
        try:
            writer.write(HEAD)
            answered = asyncio.ensure_future(reader.readline())
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait([answered, stopping], return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if answered.done() and not answered.cancelled() and answered.exception() is None:
                status = answered.result().split(b" ")[1:2]
                key = "answered_" + status[0].decode() if status else "closed"
                tally[key] = tally.get(key, 0) + 1
            answered.cancel()
        except OSError:
            tally["closed"] = tally.get("closed", 0) + 1
        finally:
            writer.close()

async def main(port, source, n):
    stop, tally = asyncio.Event(), {"opened": 0}
    tasks = [asyncio.ensure_future(silent(port, source, stop, tally)) for _ in range(n)]
    print("open", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    stop.set()
    await asyncio.gather(*tasks)
    print(json.dumps(tally), flush=True)

asyncio.run(main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3])))
"""


@dataclass
class Row:
    name: str
    base: bool  # the router of --base DIR
    aims: list[rows.Aim]


async def small_chats(url: str, n: int, every: float, within: float
                      ) -> tuple[list[str], list[float]]:
    """`n` small chats, one every `every` seconds whatever the earlier ones are doing:
    each one's outcome (its status, or "slow" past `within` seconds or failed) and the
    latencies of those answered 200."""
    timeout = aiohttp.ClientTimeout(total=within)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one() -> tuple[str, float]:
            t = time.perf_counter()
            try:
                async with s.post(url + "/v1/chat/completions", json=CHAT,
                                  timeout=timeout) as r:
                    await r.read()
                    return str(r.status), (time.perf_counter() - t) * 1000
            except (aiohttp.ClientError, TimeoutError):
                return "slow", (time.perf_counter() - t) * 1000

        tasks = []
        for _ in range(n):
            tasks.append(asyncio.ensure_future(one()))
            await asyncio.sleep(every)
        done = await asyncio.gather(*tasks)
    return [o for o, _ in done], [ms for o, ms in done if o == "200"]


async def measure(url: str, pid: int, cpus: set[int] | None,
                  args: argparse.Namespace) -> dict[str, Any]:
    port = url.rsplit(":", 1)[1]
    heads = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SILENT_HEADS, port, ATTACKER, str(args.connections),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, preexec_fn=pin(cpus))
    assert heads.stdin is not None and heads.stdout is not None
    try:
        await asyncio.wait_for(heads.stdout.readline(), 30)  # "open"
        await asyncio.sleep(1.0)  # every connection has sent its head
        cpu0 = cpu_seconds(pid)
        n = round(args.seconds / args.every)
        outcomes, served_ms = await small_chats(url, n, args.every, args.within)
        router_cpu = (cpu_seconds(pid) - cpu0) / (n * args.every + args.within)
        heads.stdin.write(b"stop\n")
        await heads.stdin.drain()
        tally = json.loads(await asyncio.wait_for(heads.stdout.readline(), 30))
        await asyncio.wait_for(heads.wait(), 30)
    finally:
        if heads.returncode is None:
            heads.kill()
            await heads.wait()
    return {"connections": args.connections, "chats": n, "every_s": args.every,
            "within_s": args.within,
            "outcomes": {k: outcomes.count(k) for k in sorted(set(outcomes))},
            "served": outcomes.count("200") / n,
            "served_ms": {"p50": pct(served_ms, 0.5), "p99": pct(served_ms, 0.99)},
            "router_cpu_share": router_cpu, "silent_heads": tally}


async def run_row(row: Row, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    router_cpus, other_cpus = split_cpus()
    async with engine_processes(other_cpus) as engines:
        rowdir = tmp / f"row-{len(list(tmp.iterdir()))}"
        rowdir.mkdir()
        cfg = rowdir / "router.json"
        cfg.write_text(json.dumps({"prefill": [engines[0]], "decode": [engines[1]]}))
        env = {"BIDIRKV_LOG_LEVEL": "WARNING"}
        if row.base:
            env["PYTHONPATH"] = str(args.base)
        r = await RouterProcess(cfg, None, rowdir / "router.log", env=env,
                                preexec=pin(router_cpus)).start()
        try:
            return await measure(r.url, r.proc.pid, other_cpus, args)
        finally:
            r.stop()


SERVED = ("served>=90%", lambda f: f["served"] >= 0.9,
          lambda f: f"{f['outcomes'].get('200', 0)} of {f['chats']} "
                    f"({f['served']:.0%}); p99 {f['served_ms']['p99']:.0f} ms")
ROWS = [Row("silent heads", False, [SERVED]),
        Row("silent heads, --base", True, [SERVED])]


def report(r: dict[str, Any]) -> str:
    lines = [rows.cpu_line(r["machine"]), "",
             f"  {'row':<28}{'aim':<14}{'met':<5}figure"]
    for row in ROWS:
        figures = r["rows"].get(row.name)
        if figures is None:
            continue
        for aim, holds, shown in row.aims:
            lines.append(f"  {row.name:<28}{aim:<14}{'yes' if holds(figures) else 'NO':<5}"
                         f"{shown(figures)}")
    for name, f in r["rows"].items():
        lines.append(f"{name}: small chats " + ", ".join(
            f"{k} {v}" for k, v in f["outcomes"].items())
            + f"; router CPU {f['router_cpu_share']:.0%} of a core; silent heads "
            + ", ".join(f"{k} {v}" for k, v in sorted(f["silent_heads"].items())))
    if r.get("base"):
        lines.append(f"--base: {r['base']}")
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> bool:
    """Draw the figure to `path`; False when there is none to draw."""
    plt = rows.pyplot()
    if plt is None or not r["rows"]:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(r["rows"])
    bottom = [0] * len(names)
    for outcome in ("200", "429", "408", "slow"):
        counts = [r["rows"][n]["outcomes"].get(outcome, 0) for n in names]
        ax.bar(names, counts, bottom=bottom, label=outcome)
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    ax.set_ylabel("small chats")
    ax.legend(title="outcome within 2 s")
    fig.suptitle(f"router, silent request heads - {r['machine']['model']} "
                 f"({r['machine']['isa']})")
    plots.save(plt, fig, path)
    return True


def main() -> int:
    ap = rows.parser(__doc__, ROWS)
    ap.add_argument("--connections", type=int, default=520)
    ap.add_argument("--seconds", type=float, default=6.0, help="how long the chats go")
    ap.add_argument("--every", type=float, default=0.1, help="seconds between chats")
    ap.add_argument("--within", type=float, default=2.0, help="a chat's time to be served")
    ap.add_argument("--base", type=Path, metavar="DIR",
                    help="another checkout of the project: its router runs the row too")
    args = rows.parse(ap, ROWS)
    only = args.rows or [row.name for row in ROWS if args.base or not row.base]
    with tempfile.TemporaryDirectory(prefix="bidirkv-heads-") as tmpdir:
        result = rows.run_rows(
            ROWS, lambda row: asyncio.run(run_row(row, args, Path(tmpdir))), only)
    if args.base:
        result["base"] = str(args.base)
    return rows.finish(result, report(result), args.out, "router-heads",
                       lambda path: plot(result, path))


if __name__ == "__main__":
    sys.exit(main())
