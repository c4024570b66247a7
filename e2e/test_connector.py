"""The vLLM plugin in real servers: vLLM's CPU build, NIXL over UCX, one P and one D
(e2e/vllm_stack.py), driven leg by leg and once through the real router."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import pathlib
import re
import threading
import time
import urllib.error
import urllib.request

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    pytest.skip("the vLLM CPU engine stack is not installed (make engine)",
                allow_module_level=True)

from bidirkv.connector.core.handles import sign
from bidirkv.local.model import random_text  # noqa: E402
from bidirkv.wire import COUNTS_KEY, EXPIRES_KEY, MAC_KEY

from .vllm_stack import (  # noqa: E402
    BLOCK,
    GEN,
    KEY,
    MISS,
    MODEL,
    REQUEST_TIMEOUT,
    Stack,
    chat,
    decode_leg,
    metric,
    metric_reaches,
    post,
    prefill_leg,
    running_router,
    stream,
    stream_text,
    turn,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def stack(traced):
    return traced[0]  # shared with e2e/test_observability.py (e2e/conftest.py)


def report(p_out: dict) -> dict:
    return p_out["kv_transfer_params"]["bidirkv"]


# -- tests --------------------------------------------------------------------------------

def test_plugin_is_active_in_every_process(stack):
    for proc in (stack.p, stack.d):
        log = proc.log_path.read_text(errors="replace")
        # bidir-kv's connector, loaded by vLLM on both sides, and only it (the guard).
        assert re.search(r"EngineCore.*bidir-kv: connector NixlConnector \(scheduler side",
                         log), proc.name
        assert re.search(r"Worker.*bidir-kv: connector NixlConnector \(worker side", log)
        assert re.search(r"EngineCore.*bidir-kv: patched bidir-kv-connector-only", log)
        assert re.search(r"APIServer.*bidir-kv: patched stream-params:OpenAIServingChat", log)
        assert re.search(r"Worker.*bidir-kv: patched nixl-progress-thread=sleeping", log)
        assert re.search(r"EngineCore.*bidir-kv: patched idle-poll=20ms, notify-hwm=", log)
        assert "worker-sleeps-after-empty-step" in log
    # vLLM moved P's model thread (bound to core 0) to the last core; it was put back.
    assert "kept the model thread on cores [0]" in stack.p.log_path.read_text()


def test_streamed_chat_turns_reuse_verified_decode_kv(stack):
    user1 = {"role": "user", "content": random_text(300, seed=11)}
    body1 = chat([user1])
    text1, handle1, p1 = turn(stack, body1)
    assert "bidirkv" not in p1["kv_transfer_params"]  # a miss: nothing offered
    # The streamed response ended with D's params, well formed and signed.
    assert handle1 is not None and handle1["do_remote_decode"] is True
    prompt1 = p1["usage"]["prompt_tokens"]
    assert handle1["remote_num_tokens"] == prompt1 + GEN["max_tokens"] - 1
    # D names its blocks by count; P gets their ids from D with the read grant.
    assert "remote_block_ids" not in handle1
    assert handle1[COUNTS_KEY] == [-(-handle1["remote_num_tokens"] // BLOCK)]
    held = handle1["bidirkv_blocks"]
    assert held["bs"] == BLOCK and held["n"] == handle1["remote_num_tokens"] // BLOCK
    assert handle1[MAC_KEY] == sign(handle1, KEY.encode())

    body2 = chat([user1, {"role": "assistant", "content": text1},
                  {"role": "user", "content": random_text(150, seed=12)}])
    before = metric(stack.p_url, "vllm:nixl_bytes_transferred_sum")
    counted = metric(stack.p_url, "vllm:bidirkv_reused_tokens_total")
    text2, handle2, p2 = turn(stack, body2, handle1)
    rep = report(p2)
    assert rep["verified"] and rep["reason"] == "match", rep
    # The connector's own counter, in vLLM's /metrics beside NIXL's.
    want = counted + rep["reused_tokens"]
    assert metric_reaches(stack.p_url, "vllm:bidirkv_reused_tokens_total", want) == want
    assert rep["reused_tokens"] == rep["offered_tokens"] == held["n"] * BLOCK
    assert rep["recomputed_tokens"] == p2["usage"]["prompt_tokens"] - rep["reused_tokens"]
    pulled = metric(stack.p_url, "vllm:nixl_bytes_transferred_sum") - before
    assert pulled > 0  # D -> P over NIXL
    assert handle2 is not None and handle2["remote_num_tokens"] > handle1["remote_num_tokens"]
    # The same turn with reuse off gives the same tokens.
    reference, _, _ = turn(stack, body2, None, streamed=False)
    assert text2 == reference
    print(f"\nturn 2: P pulled {pulled / 1e6:.2f} MB from D for {rep['reused_tokens']} "
          f"reused tokens, recomputed {rep['recomputed_tokens']}")


def test_streamed_completions_carry_params_and_are_reused(stack):
    prompt1 = random_text(280, seed=21)
    body1 = {"model": MODEL, "prompt": prompt1, **GEN}
    text1, handle1, _ = turn(stack, body1)
    assert handle1 and handle1["do_remote_decode"] and handle1["bidirkv_blocks"]["n"]
    body2 = dict(body1, prompt=f"{prompt1} {text1.strip()} {random_text(40, seed=22)}")
    _, _, p2 = turn(stack, body2, handle1)
    assert report(p2)["reused_tokens"] == 2 * BLOCK, report(p2)


@pytest.mark.parametrize("edit_at, reused", [("assistant", 2 * BLOCK), ("first_word", 0)])
def test_edited_history_gives_exactly_the_reuse_off_output(stack, edit_at, reused):
    # 363 prompt tokens + 24 generated: D holds 386, 3 full blocks, the last of which
    # (tokens 256-383) ends with the first 21 tokens of the reply.
    user1 = {"role": "user", "content": random_text(360, seed=31)}
    text1, handle1, _ = turn(stack, chat([user1]))
    assert handle1["bidirkv_blocks"]["n"] == 3
    words = text1.split()
    if edit_at == "assistant":
        # Token 367 of the history, inside block 2.
        words[4] = "zz" if words[4] != "zz" else "yy"
        history = [user1, {"role": "assistant", "content": " ".join(words)}]
    else:
        first, *rest = user1["content"].split()
        history = [{"role": "user", "content": " ".join(["zz" if first != "zz" else "yy",
                                                         *rest])},
                   {"role": "assistant", "content": text1}]
    body2 = chat([*history, {"role": "user", "content": random_text(100, seed=32)}])
    text2, _, p2 = turn(stack, body2, handle1)
    rep = report(p2)
    assert rep["verified"] and rep["reason"] == "mismatch", rep
    assert rep["reused_tokens"] == rep["verified_tokens"] == reused
    assert rep["offered_tokens"] > reused  # the router counts it as verified-partial
    reference, _, _ = turn(stack, body2, None, streamed=False)
    assert text2 == reference


def _reference(s: Stack, url: str, body: dict) -> str:
    status, out = post(url + "/v1/chat/completions", dict(body, max_tokens=6))
    assert status == 200, out
    return out["choices"][0]["message"]["content"]


def _bad_cases(s: Stack, fresh_handle: dict, p_handle: dict) -> list[tuple[str, str, dict]]:
    """(name, server, kv_transfer_params) a client could send straight to a server."""
    unknown = {"remote_engine_id": "no-such-engine", "remote_request_id": "r",
               "remote_host": "10.255.255.1", "remote_port": 5600,
               "remote_block_ids": [[0, 1, 2]], "remote_num_tokens": 384, "tp_size": 1}
    forged = dict(fresh_handle, **{COUNTS_KEY: [4]})
    return [
        ("missing keys", "p", {"do_remote_decode": True, "remote_block_ids": [[1, 2]]}),
        ("wrong types", "p", {**MISS, "remote_block_ids": "0,1", "remote_engine_id": 5,
                              "remote_port": "x", "remote_num_tokens": "all"}),
        ("flag of a wrong type", "d", {"do_remote_prefill": "yes", **unknown}),
        ("huge block list", "p", {**MISS, **unknown,
                                  "remote_block_ids": [list(range(300_000))]}),
        ("unknown engine and host", "p", {**MISS, **unknown}),
        ("unknown engine and host", "d", {"do_remote_prefill": True, **unknown}),
        ("forged block list", "p", {**forged, "do_remote_decode": True}),
        ("P's blocks, unsigned", "d", {**{k: v for k, v in p_handle.items() if k != MAC_KEY},
                                       "do_remote_prefill": True, "remote_host": "127.0.0.1",
                                       "remote_block_ids": [[0, 1, 2, 3]]}),
    ]


def test_prefill_gives_a_caller_without_the_routers_proof_no_handle(stack):
    """A handle taken straight from P could be replayed to D once P reused its blocks;
    without the router's proof P answers, keeps nothing and hands out nothing."""
    body = chat([{"role": "user", "content": random_text(300, seed=91)}])
    direct = dict(body, stream=False, max_tokens=1, kv_transfer_params=dict(MISS))
    status, out = post(stack.p_url + "/v1/chat/completions", direct)
    assert status == 200 and out["choices"][0]["message"]["content"]
    kv = out.get("kv_transfer_params") or {}
    assert not kv.get("remote_block_ids") and MAC_KEY not in kv, kv
    # With the proof (what the router sends) the same request gets its handle.
    assert prefill_leg(stack, body)["kv_transfer_params"][MAC_KEY]


def test_bad_params_straight_to_a_server_are_served_without_reuse(stack):
    user1 = {"role": "user", "content": random_text(300, seed=41)}
    text1, fresh, p1 = turn(stack, chat([user1]))
    body = chat([user1, {"role": "assistant", "content": text1},
                 {"role": "user", "content": random_text(30, seed=42)}])
    want = {"p": _reference(stack, stack.p_url, body), "d": _reference(stack, stack.d_url, body)}
    for name, server, params in _bad_cases(stack, fresh, p1["kv_transfer_params"]):
        url = stack.p_url if server == "p" else stack.d_url
        t = time.monotonic()
        status, out = post(url + "/v1/chat/completions",
                           dict(body, max_tokens=6, kv_transfer_params=copy.deepcopy(params)),
                           timeout=60)
        took = time.monotonic() - t
        assert status == 200 or 400 <= status < 500, (name, status, out)
        if status == 200:
            # Never another request's KV: the output is the one computed from scratch.
            assert out["choices"][0]["message"]["content"] == want[server], name
            rep = (out.get("kv_transfer_params") or {}).get("bidirkv")
            assert rep is None or rep["reused_tokens"] == 0, (name, rep)
        assert took < 30, (name, took)
        for u in (stack.p_url, stack.d_url):
            with urllib.request.urlopen(u + "/health", timeout=10) as r:
                assert r.status == 200
    # The legitimate handle still works once (the forged copy was refused before use)...
    _, _, p2 = turn(stack, body, fresh)
    assert report(p2)["reused_tokens"] > 0
    # ...and only once: a replay is refused.
    _, _, p3 = turn(stack, body, fresh)
    assert report(p3)["reason"] == "replayed" and report(p3)["reused_tokens"] == 0


def test_only_handles_sealed_with_the_resources_key_are_read(stack):
    """Forged, tampered or replayed handles: P reads nothing from D (its NIXL byte
    counter does not move) and the output is the reuse-off output."""
    user1 = {"role": "user", "content": random_text(300, seed=91)}
    text1, handle, _ = turn(stack, chat([user1]))
    body = chat([user1, {"role": "assistant", "content": text1},
                 {"role": "user", "content": random_text(40, seed=92)}])
    want = turn(stack, body, None, streamed=False)[0]

    def resigned(h, key=b"attacker-key"):
        return dict(h, **{MAC_KEY: sign(h, key)})

    cases = {
        "another key": resigned(handle),
        "another key, new request id": resigned(dict(handle, remote_request_id="x-1")),
        "tampered host": dict(handle, remote_host="127.0.0.2"),
        "tampered port": dict(handle, remote_port=handle["remote_port"] + 1),
        "tampered blocks": dict(handle, **{COUNTS_KEY: [2]}),
    }
    dropped = metric(stack.p_url, "vllm:bidirkv_handles_dropped_total")
    for name, forged in cases.items():
        before = metric(stack.p_url, "vllm:nixl_bytes_transferred_sum")
        p_out = prefill_leg(stack, body, forged)
        assert metric(stack.p_url, "vllm:nixl_bytes_transferred_sum") == before, name
        rep = p_out["kv_transfer_params"]["bidirkv"]
        assert rep["reused_tokens"] == 0 and rep["reason"] == "unauthenticated", (name, rep)
        assert decode_leg(stack, body, p_out, streamed=False)[0] == want, name
    dropped += len(cases)
    assert metric_reaches(stack.p_url, "vllm:bidirkv_handles_dropped_total",
                          dropped) == dropped
    # Sealed with the key, but past its deadline (a leaked handle, replayed late).
    late = dict(handle, **{EXPIRES_KEY: time.time() - 60})
    late[MAC_KEY] = sign(late, KEY.encode())
    before = metric(stack.p_url, "vllm:nixl_bytes_transferred_sum")
    p_out = prefill_leg(stack, body, late)
    assert metric(stack.p_url, "vllm:nixl_bytes_transferred_sum") == before
    assert p_out["kv_transfer_params"]["bidirkv"]["reason"] == "expired"
    assert decode_leg(stack, body, p_out, streamed=False)[0] == want
    # The sealed handle is read once; its replay reads nothing.
    before = metric(stack.p_url, "vllm:nixl_bytes_transferred_sum")
    p_out = prefill_leg(stack, body, handle)
    assert metric(stack.p_url, "vllm:nixl_bytes_transferred_sum") > before
    assert decode_leg(stack, body, p_out, streamed=False)[0] == want
    before = metric(stack.p_url, "vllm:nixl_bytes_transferred_sum")
    p_out = prefill_leg(stack, body, handle)
    assert p_out["kv_transfer_params"]["bidirkv"]["reason"] == "replayed"
    assert metric(stack.p_url, "vllm:nixl_bytes_transferred_sum") == before


@pytest.mark.parametrize("where", ["unreachable host", "wrong engine id"])
def test_signed_handle_to_a_missing_peer_is_recomputed(stack, where):
    """Signed with the pool's key but pointing where no such engine is: only the real
    connector's handshake can find out (5 s timeout); P then recomputes (policy
    `recompute`) instead of hanging or failing."""
    user1 = {"role": "user", "content": random_text(300, seed=81 if where[0] == "u" else 82)}
    text1, handle, _ = turn(stack, chat([user1]))
    # An engine P has not met yet: with a known one, P would reuse its connection.
    handle = dict(handle, remote_engine_id=f"gone-{where[0]}")
    if where == "unreachable host":
        handle["remote_host"] = "10.255.255.1"
    handle[MAC_KEY] = sign(handle, KEY.encode())
    body = chat([user1, {"role": "assistant", "content": text1},
                 {"role": "user", "content": random_text(30, seed=83)}])
    t = time.monotonic()
    p_out = prefill_leg(stack, body, handle)
    took = time.monotonic() - t
    rep = report(p_out)
    assert rep["verified"] and rep["reused_tokens"] == 0 and rep["reason"] == "load_failed"
    assert took < 30, took
    text, _, _ = decode_leg(stack, body, p_out, streamed=False)
    assert text == turn(stack, body, None, streamed=False)[0]


def _cpu_seconds(pgid: int) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid:  # field 5: process group
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def test_servers_holding_blocks_do_not_spin(stack):
    user1 = {"role": "user", "content": random_text(200, seed=51)}
    _, handle, _ = turn(stack, chat([user1]))
    assert handle  # D now pins this conversation's blocks for the TTL (120 s)
    time.sleep(1)
    before = {p.name: _cpu_seconds(p.pid) for p in (stack.p, stack.d)}
    time.sleep(4)
    used = {p.name: (_cpu_seconds(p.pid) - before[p.name]) / 4 for p in (stack.p, stack.d)}
    print(f"\nidle CPU while D holds blocks (cores): {used}")
    # Unpatched, D's engine loop and its worker keep about 1.5 cores busy (measured).
    assert used["decode"] < 0.35 and used["prefill"] < 0.35, used


def test_router_counts_verified_reuse(stack):
    with running_router(stack) as (url, _):
        user1 = {"role": "user", "content": random_text(300, seed=61)}
        conv = {"conversation_id": "conv-61"}
        events = stream(url + "/v1/chat/completions", {**chat([user1]), **conv, "stream": True})
        text1 = stream_text(events)
        # The client never sees the handle: internal hosts and block ids.
        assert not any(isinstance(e, dict) and "kv_transfer_params" in e for e in events)
        msgs = [user1, {"role": "assistant", "content": text1},
                {"role": "user", "content": random_text(60, seed=62)}]
        stream(url + "/v1/chat/completions", {**chat(msgs), **conv, "stream": True})
        reused = metric(url, 'bidirkv_router_reuse_tokens_total{source="bidirkv"}')
        hits = metric(url, 'bidirkv_router_reuse_total{outcome="hit"}')
        assert reused >= 2 * BLOCK and hits == 1, (reused, hits)
        # An edited history turn: P reads only the verified prefix, the router sees it.
        msgs[1] = {"role": "assistant", "content": "zz " + text1}
        stream(url + "/v1/chat/completions",
               {**chat([*msgs, {"role": "user", "content": "ab"}]), **conv, "stream": True})
        assert metric(url, 'bidirkv_router_reuse_total{outcome="verified-partial"}') == 1


def test_router_places_each_turn_where_its_kv_is(stack):
    """`thresholds`: a short append runs whole on the decode replica that holds the
    conversation (no prefill leg, no KV moved, D's own prefix cache) and gives the
    reuse-off output; a long one takes the prefill leg and reads D's blocks back; and so
    does a short one while the holder is busy."""
    policy = {"policy": "thresholds", "localPrefillTokens": 64, "maxLocalPrefillTokens": 2048,
              "decodeBusyRequests": 1}
    with running_router(stack, "router-placement", placement=policy) as (url, _):
        conv = {"conversation_id": "conv-71", "stream": True}
        user1 = {"role": "user", "content": random_text(300, seed=71)}
        text1 = stream_text(stream(url + "/v1/chat/completions", {**chat([user1]), **conv}))
        msgs = [user1, {"role": "assistant", "content": text1},
                {"role": "user", "content": random_text(8, seed=72)}]
        p_done = metric(stack.p_url, "vllm:request_success_total")
        moved = [metric(u, "vllm:nixl_bytes_transferred_sum") for u in (stack.p_url, stack.d_url)]
        d_hits = metric(stack.d_url, "vllm:prefix_cache_hits_total")
        text2 = stream_text(stream(url + "/v1/chat/completions", {**chat(msgs), **conv}))
        extended = 'bidirkv_router_placements_total{decision="extend",reason="short_append"}'
        assert metric(url, extended) == 1
        assert metric(stack.p_url, "vllm:request_success_total") == p_done  # P never asked
        assert [metric(u, "vllm:nixl_bytes_transferred_sum")
                for u in (stack.p_url, stack.d_url)] == moved  # 0 KV bytes moved
        assert metric(stack.d_url, "vllm:prefix_cache_hits_total") > d_hits
        assert text2 == turn(stack, chat(msgs), None, streamed=False)[0]  # reuse-off output
        # A long append: the prefill leg, reading back what D kept for turn 2.
        reused = metric(url, 'bidirkv_router_reuse_tokens_total{source="bidirkv"}')
        msgs += [{"role": "assistant", "content": text2},
                 {"role": "user", "content": random_text(200, seed=73)}]
        text3 = stream_text(stream(url + "/v1/chat/completions", {**chat(msgs), **conv}))
        assert metric(url, 'bidirkv_router_placements_total{decision="read_back",'
                      'reason="long_append"}') == 1
        assert metric(url, 'bidirkv_router_reuse_tokens_total{source="bidirkv"}') > reused
        assert text3 == turn(stack, chat(msgs), None, streamed=False)[0]
        # A short append while another conversation's leg streams on the holder: a busy
        # decode is not given a prefill, the turn takes the prefill leg.
        streaming, busy = threading.Event(), {}

        def another_conversation():
            body = {**chat([{"role": "user", "content": random_text(40, seed=75)}],
                           max_tokens=400), "stream": True, "ignore_eos": True}
            req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
                for line in r:
                    if line.startswith(b"data:"):
                        streaming.set()
                busy["done"] = time.monotonic()

        other = threading.Thread(target=another_conversation, daemon=True)
        other.start()
        assert streaming.wait(REQUEST_TIMEOUT), "the other conversation never streamed"
        msgs += [{"role": "assistant", "content": text3},
                 {"role": "user", "content": random_text(8, seed=74)}]
        placed = time.monotonic()
        text4 = stream_text(stream(url + "/v1/chat/completions", {**chat(msgs), **conv}))
        other.join(REQUEST_TIMEOUT)
        assert busy["done"] > placed  # the other leg was still streaming
        assert metric(url, 'bidirkv_router_placements_total{decision="read_back",'
                      'reason="decode_busy"}') == 1
        assert text4 == turn(stack, chat(msgs), None, streamed=False)[0]


def test_cost_runs_a_first_turn_whole_on_an_idle_decode_server(stack):
    """`cost`, the default: with both servers idle a first turn is sooner whole on decode
    (no second hop), so prefill is never asked and no KV moves; the output is the
    reuse-off output, and decode keeps the conversation for the next turn, which it
    extends. (Once the router has seen a prompt's token count: before, it cannot size a
    turn against the cap.)"""
    with running_router(stack, "router-cost", placement={"policy": "cost"}) as (url, _):
        # The first turn after a start takes the legs: prefill's usage sizes the next ones.
        warm = {"role": "user", "content": random_text(40, seed=76)}
        stream(url + "/v1/chat/completions", {**chat([warm]), "stream": True})
        assert metric(url, 'bidirkv_router_placements_total{decision="prefill",'
                      'reason="learning"}') == 1
        conv = {"conversation_id": "conv-77", "stream": True}
        user1 = {"role": "user", "content": random_text(200, seed=77)}
        p_done = metric(stack.p_url, "vllm:request_success_total")
        moved = [metric(u, "vllm:nixl_bytes_transferred_sum") for u in (stack.p_url, stack.d_url)]
        text1 = stream_text(stream(url + "/v1/chat/completions", {**chat([user1]), **conv}))
        assert metric(url, 'bidirkv_router_placements_total{decision="decode",'
                      'reason="cheaper_on_decode"}') == 1
        msgs = [user1, {"role": "assistant", "content": text1},
                {"role": "user", "content": random_text(8, seed=78)}]
        text2 = stream_text(stream(url + "/v1/chat/completions", {**chat(msgs), **conv}))
        assert metric(url, 'bidirkv_router_placements_total{decision="extend",'
                      'reason="cheaper_on_decode"}') == 1
        assert metric(url, 'bidirkv_router_reuse_total{outcome="extended"}') == 1
        assert metric(stack.p_url, "vllm:request_success_total") == p_done  # P never asked
        assert [metric(u, "vllm:nixl_bytes_transferred_sum")
                for u in (stack.p_url, stack.d_url)] == moved  # 0 KV bytes moved
    assert text1 == turn(stack, chat([user1]), None, streamed=False)[0]  # reuse-off output
    assert text2 == turn(stack, chat(msgs), None, streamed=False)[0]


def test_reuse_cuts_prefill_time(stack):
    user1 = {"role": "user", "content": random_text(2500, seed=71)}
    text1, handle, _ = turn(stack, chat([user1], max_tokens=8))
    body2 = chat([user1, {"role": "assistant", "content": text1},
                  {"role": "user", "content": random_text(100, seed=72)}], max_tokens=8)
    t = time.monotonic()
    p_on = prefill_leg(stack, body2, handle)
    on = time.monotonic() - t
    t = time.monotonic()
    prefill_leg(stack, body2, None)
    off = time.monotonic() - t
    print(f"\nprefill of {p_on['usage']['prompt_tokens']} tokens: reuse on {on * 1000:.0f} ms "
          f"({report(p_on)['reused_tokens']} reused), off {off * 1000:.0f} ms")
    # Turn 1 left 2503 prompt + 7 generated tokens on D: 19 full blocks.
    assert report(p_on)["reused_tokens"] == (2503 + 7) // BLOCK * BLOCK
    assert on < off
