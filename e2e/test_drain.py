"""A leaving decode server drains instead of dropping its conversations: real vLLM CPU
servers, 1P2D, behind the real router.

SIGTERM to a decode server's launcher (what a pod deletion sends) makes it drain: the
router places nothing new there, a conversation it holds reads back through prefill and
decodes on the other replica (the conversation moves), and the server exits once it
holds nothing. A server killed mid-drain (SIGKILL) costs only reuse: every output equals
the reuse-off output (float32, greedy).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import pathlib
import signal
import sys
import time
import urllib.error
import urllib.request

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    pytest.skip("the vLLM CPU engine stack is not installed (make engine)",
                allow_module_level=True)

from bidirkv.local.engines import (  # noqa: E402
    LocalPorts,
    engine_process,
    local_router_config,
    local_secrets,
)
from bidirkv.local.model import build_model, random_text  # noqa: E402
from bidirkv.local.procs import Proc, merged_env, stop_all, wait_all_healthy  # noqa: E402
from bidirkv.operator.api.spec import parse_spec  # noqa: E402
from bidirkv.operator.reconcile.heldcount import fetch_retained, metrics_url  # noqa: E402

from .vllm_stack import (  # noqa: E402
    KEY,
    START_TIMEOUT,
    chat,
    free_ports,
    metric,
    metric_reaches,
    post,
    spec_for,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

HEALTH_S = 0.5  # the router's health round: it learns of a drain within one
DRAIN_S = 90


def served(url: str) -> float:
    return metric(url, "vllm:request_success_total")


def wait_for(cond, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def ready(router_url: str) -> dict:
    try:
        with urllib.request.urlopen(router_url + "/ready", timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def test_a_sigtermed_decode_drains_its_conversations_to_the_other(tmp_path):
    doc = spec_for(build_model(tmp_path / "model", dtype="float32"), max_model_len=2048)
    doc["decode"]["drainSeconds"] = DRAIN_S
    spec = parse_spec(doc)
    ports = free_ports(7)
    p = LocalPorts(ports[0], ports[1])
    ds = [LocalPorts(ports[2], ports[3]), LocalPorts(ports[4], ports[5])]
    procs: list[Proc] = []
    try:
        for name, role, lp in (("prefill", "prefill", p), ("decode-0", "decode", ds[0]),
                               ("decode-1", "decode", ds[1])):
            argv, env = engine_process(spec, role, lp, local_secrets(KEY))
            procs.append(Proc(name, argv, merged_env(env), tmp_path / f"{name}.log",
                              f"http://127.0.0.1:{lp.http}/health").start(cwd=str(tmp_path)))
        wait_all_healthy(procs, START_TIMEOUT)
        cfg = local_router_config(spec, [p], ds)
        cfg["healthCheckIntervalSeconds"] = HEALTH_S
        (tmp_path / "router.json").write_text(json.dumps(cfg))
        router = Proc("router", [str(pathlib.Path(sys.executable).parent / "bidir-kv"),
                                 "router", "--config", str(tmp_path / "router.json"),
                                 "--port", str(ports[6]), "--host", "127.0.0.1"],
                      merged_env({"BIDIRKV_HANDLE_KEY": KEY}), tmp_path / "router.log",
                      f"http://127.0.0.1:{ports[6]}/health").start(cwd=str(tmp_path))
        procs.append(router)
        router.wait_healthy(60)
        run(tmp_path, procs, f"http://127.0.0.1:{ports[6]}", f"http://127.0.0.1:{p.http}",
            [f"http://127.0.0.1:{d.http}" for d in ds])
    finally:
        stop_all(procs)


def run(tmp_path, procs, router_url, p_url, d_urls):
    by_url = dict(zip(d_urls, procs[1:3], strict=True))

    def turn(msgs):
        status, out = post(router_url + "/v1/chat/completions", chat(msgs))
        assert status == 200, out
        return out["choices"][0]["message"]["content"]

    def reference(msgs):  # reuse off: prefill serves the whole request, nothing read
        status, out = post(p_url + "/v1/chat/completions", chat(msgs))
        assert status == 200, out
        return out["choices"][0]["message"]["content"]

    def counts():
        return {u: served(u) for u in d_urls}

    def log(proc):
        return proc.log_path.read_text(errors="replace")

    # First turns until each decode replica holds a conversation (placements alternate);
    # the replica that decoded a turn keeps its KV.
    convs: dict[str, list[list]] = {}
    for seed in range(6):
        before = counts()
        msgs = [{"role": "user", "content": random_text(300, seed=seed)}]
        msgs.append({"role": "assistant", "content": turn(msgs)})
        after = wait_for(lambda b=before: (lambda c: c if c != b else None)(counts()),
                         "decode to count the first turn", 10)
        (holder,) = [u for u in d_urls if after[u] > before[u]]
        convs.setdefault(holder, []).append(msgs)
        if len(convs) == 2:
            break
    assert len(convs) == 2, convs
    leaving, staying = d_urls[1], d_urls[0]
    if leaving not in convs:
        leaving, staying = staying, leaving
    leaver = by_url[leaving]

    # The conversations held on the leaving replica, their next turns, and the reuse-off
    # texts of those.
    nexts = [c + [{"role": "user", "content": random_text(40, seed=100 + i)}]
             for i, c in enumerate(convs[leaving])]
    refs = [reference(m) for m in nexts]
    before = counts()

    leaver.popen.send_signal(signal.SIGTERM)  # as a pod deletion: the launcher only
    wait_for(lambda: "conversations held" in log(leaver),
             "the leaving replica to report what it holds", 10)
    wait_for(lambda: f"decode {leaving} is draining" in (tmp_path / "router.log").read_text(),
             "the router to see the drain", 10)
    assert leaver.alive()  # it holds conversations: it waits
    # Its engine's gauge says how many, read as the operator reads a draining pod's.
    pod = {"status": {"podIP": "127.0.0.1"},
           "spec": {"containers": [{"ports": [{"name": "http",
                                               "containerPort": int(leaving.rsplit(":", 1)[1])}]}]}}
    held = len(convs[leaving])
    assert wait_for(lambda: asyncio.run(fetch_retained(metrics_url(pod))) == held,
                    f"the leaving replica's gauge to show {held} retained", 10)

    reused = metric_reaches(p_url, "vllm:bidirkv_reused_tokens_total", 0)
    for msgs, ref in zip(nexts, refs, strict=True):
        assert turn(msgs) == ref
    assert metric_reaches(p_url, "vllm:bidirkv_reused_tokens_total", reused + 1) > reused
    # The turns decoded on the staying replica, which keeps them from now on (the
    # leaving one may be gone already: it held nothing more).
    assert metric_reaches(staying, "vllm:request_success_total",
                          before[staying] + len(nexts)) == before[staying] + len(nexts)
    # Nothing left to read on the leaving replica: its launcher stops vLLM and exits.
    wait_for(lambda: not leaver.alive(), "the drained replica to exit", DRAIN_S / 2)
    assert "drain ended (drained)" in log(leaver), log(leaver)[-2000:]

    # The staying replica, now the only one, drains too and is killed mid-drain: the
    # conversations it held recompute; nothing wrong is read.
    stayer = by_url[staying]
    b = convs[staying][0] + [{"role": "user", "content": random_text(40, seed=200)}]
    b_ref = reference(b)
    stayer.popen.send_signal(signal.SIGTERM)
    wait_for(lambda: "conversations held" in log(stayer), "the staying replica to drain", 10)
    assert stayer.alive()
    os.killpg(stayer.pid, signal.SIGKILL)  # its session: the launcher, vLLM, its engine
    wait_for(lambda: ready(router_url)["decode"]["healthy"] == 0,
             "the router to see the killed replica gone", 30)
    assert turn(b) == b_ref
