"""A router with the in-process store survives its restart: it leaves a note beside each
kept handle on decode (bidirkv/router/pool/notes.py) and a new process of the same
resource recalls them (recall.py). The pure parts against tables, then `bidir-kv router`
as separate processes in front of fake engines: a conversation, the router SIGTERMed by
its pid, a new one with the same config, and the next turn reuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import time

import aiohttp
import pytest
from fake_engine import FakeEngine
from router_process import KEY, RouterProcess

from bidirkv.router.pool.notes import decode, encode, merge, note_key, stable_owner
from bidirkv.router.store.base import Entry, Kept
from bidirkv.wire import BLOCKS_KEY, COUNTS_KEY, MAX_NOTE_LEN, NOTE_LEAVES_OUT, VERSION, VERSION_KEY

NK = note_key(KEY.encode())
HANDLE = {"remote_request_id": "d-1", VERSION_KEY: VERSION, COUNTS_KEY: [3],
          BLOCKS_KEY: {"v": 2, "n": 3}}
BULK = {k: HANDLE[k] for k in NOTE_LEAVES_OUT}
PARAMS = json.dumps(HANDLE).encode()
KEPT = Kept(b"k" * 32, PARAMS, "http://d0", "eng-1", 40, tenant=b"t" * 16, prefix_len=0,
            request_id="d-1", blocks=3, chars=120, prompt_key=b"\0\0\0\2" + b"p" * 16,
            kept_at=1000.0, gap=12.5)


def note_of(kept: Kept, at: float, key: bytes = NK) -> str | None:
    return encode(key, kept, at, json.loads(kept.params))


# -- pure: the owner, the note and the merge --------------------------------------------------
def test_the_owner_is_the_same_for_every_process_of_a_resource_and_only_it():
    assert stable_owner(KEY.encode()) == stable_owner(KEY.encode())
    assert stable_owner(KEY.encode()) != stable_owner(b"x" * 64)
    assert KEY not in stable_owner(KEY.encode()) and note_key(KEY.encode()) != KEY.encode()


def test_a_note_gives_back_the_kept_record_on_the_replica_it_is_recalled_from():
    note = note_of(KEPT, 5.0)
    back = decode(NK, "d-1", note, "http://d0-again", BULK)
    assert back == dataclasses.replace(KEPT, decode_url="http://d0-again",
                                       params=back.params)
    assert json.loads(back.params) == json.loads(PARAMS)
    # An unknown kept_at is the time the note was made.
    assert decode(NK, "d-1", note_of(dataclasses.replace(KEPT, kept_at=None), 5.0),
                  "u", BULK).kept_at == 5.0


def test_a_note_leaves_out_what_grows_with_the_history_and_decode_gives_it_back():
    # 200k tokens in blocks of 16: 12,500 blocks (decode keeps their ids) and the
    # digest record.
    long = {**HANDLE, COUNTS_KEY: [12_500], BLOCKS_KEY: {"v": 2, "cp": "Q" * 3000}}
    kept = dataclasses.replace(KEPT, params=json.dumps(long).encode(), blocks=12_500)
    note = note_of(kept, 5.0)
    assert note is not None and len(note) <= 1024 and "QQQQ" not in note
    back = decode(NK, "d-1", note, "u", {k: long[k] for k in NOTE_LEAVES_OUT})
    assert json.loads(back.params) == long
    # Nothing given back (a decode of an older release, or a request it no longer
    # holds): nothing to put back, the conversation's next turn recomputes.
    for bulk in (None, [1], "x"):
        assert decode(NK, "d-1", note, "u", bulk) is None
    # Given back without its digest record: prefill refuses such a handle (no_digest).
    assert BLOCKS_KEY not in json.loads(decode(NK, "d-1", note, "u", {}).params)


def test_a_note_is_the_same_bytes_older_routers_made():
    # Notes outlive the process that signed them (a rollout recalls an older release's):
    # the form and the MAC are pinned, whatever the encoder keeps cached.
    assert note_of(KEPT, 0.0) == (
        '2.GupW1Njw53vIWlLPLtcvUA.["a2tra2tra2tra2tra2tra2tra2tra2tra2tra2tra2s=",'
        '"{\\"remote_request_id\\":\\"d-1\\",\\"bidirkv_wire\\":3,'
        '\\"bidirkv_block_counts\\":[3]}","eng-1",40,'
        '"dHR0dHR0dHR0dHR0dHR0dA==",0,3,120,"AAAAAnBwcHBwcHBwcHBwcHBwcHA=",1000.0,12.5]')


@pytest.mark.parametrize("name, rid, note", [
    ("another request's", "d-2", lambda n: n),
    ("another key's", "d-1", lambda n: note_of(KEPT, 0.0, note_key(b"x" * 64))),
    ("changed", "d-1", lambda n: n.replace('"eng-1"', '"eng-2"')),
    ("another format", "d-1", lambda n: "1" + n[1:]),
    ("not text", "d-1", lambda n: 7),
    ("cut", "d-1", lambda n: n[:40]),
    ("a MAC not ASCII", "d-1", lambda n: n.replace(".", ".é", 1)),
    ("a lone surrogate", "d-1", lambda n: n[:-1] + "\ud800]"),
    ("a request id with a lone surrogate", "d-1\ud800", lambda n: n),
])
def test_a_note_that_does_not_check_gives_nothing(name, rid, note):
    assert decode(NK, rid, note(note_of(KEPT, 0.0)), "u", BULK) is None, name


def test_a_signed_note_that_is_no_handle_of_this_release_gives_nothing():
    old = dataclasses.replace(KEPT, params=json.dumps({VERSION_KEY: VERSION + 1}).encode())
    assert decode(NK, "d-1", note_of(old, 0.0), "u", BULK) is None
    assert decode(NK, "d-1", note_of(dataclasses.replace(KEPT, num_tokens=-1), 0.0),
                  "u", BULK) is None


def test_a_note_longer_than_decode_keeps_is_not_made():
    big = dataclasses.replace(KEPT, params=json.dumps(
        {VERSION_KEY: VERSION, "x": "y" * MAX_NOTE_LEN}).encode())
    assert note_of(big, 0.0) is None
    assert note_of(dataclasses.replace(KEPT, request_id=None), 0.0) is None


def entry(request_id: str, kept_at: float, reserved: bool = False) -> Entry:
    return Entry(b"k" * 32, b"{}", "u", None, 0, 0.0, None, 0, request_id, 0, 0, None,
                 kept_at, None, reserved)


def note(key: bytes, rid: str, kept_at: float) -> Kept:
    return dataclasses.replace(KEPT, key=key, request_id=rid, kept_at=kept_at)


K, L = b"k" * 32, b"l" * 32


@pytest.mark.parametrize("recalled, held, put, released", [
    ([note(K, "a", 900)], None, ["a"], []),
    ([note(K, "a", 900), note(K, "b", 950)], None, ["b"], []),  # the newest of a conversation
    ([note(K, "b", 950), note(K, "a", 900)], None, ["b"], []),
    ([note(K, "a", 100)], None, [], ["a"]),  # past the store's TTL (300 s at 1000): released
    ([note(K, "a", 700)], None, [], ["a"]),  # ... to the second
    ([note(K, "a", 100)], entry("a", 100), [], []),  # ... unless the store holds it
    ([note(K, "a", 100), note(K, "b", 950)], None, ["b"], ["a"]),
    ([note(K, "a", 900)], entry("a", 900), [], []),  # the store has it already
    ([note(K, "a", 900)], entry("z", 950), [], []),  # the store has a later one
    ([note(K, "a", 900)], entry("z", 800), ["a"], []),  # ... or an earlier one: replaced
    ([note(K, "a", 900)], entry("z", 800, reserved=True), [], []),  # a turn is using it
    ([note(K, "a", 900), note(L, "c", 900)], None, ["a", "c"], []),
    ([note(b"", "a", 900)], None, [], []),
    # A note's time ahead of this router's clock counts as now: it does not beat a
    # handle the store kept since, nor live past the TTL from now.
    ([note(K, "a", 5000)], entry("z", 999), ["a"], []),
    ([note(K, "a", 5000)], entry("z", 1000), [], []),
])
def test_merge(recalled, held, put, released):
    got, expired = merge(recalled, lambda key: held if key == K else None, 1000.0, 300.0)
    assert [k.request_id for k in got] == put and expired == released
    assert all(k.kept_at <= 1000.0 for k in got)


async def test_a_recalled_handle_lives_what_its_note_has_left_of_the_ttl():
    """A note kept 470 s before the recall, under a TTL of 480 s, comes back with 10 s to
    live, not 480: a handle outliving decode's blocks would pin them in the watermark's
    count. One past the TTL is released on decode, never stored; one from a clock ahead
    of this one's lives the TTL from now."""
    from bidirkv.router.pool.recall import Recall
    from bidirkv.router.store.memory import InProcessStore

    client, d = await client_and_decode()
    try:
        store = InProcessStore(480, 100, client.release)
        recall = Recall(client, store, store.peek, lambda: 480.0, lambda coro: None)
        now = time.time()
        notes = {rid: note_of(note(k, rid, at), at) for k, rid, at in (
            (K, "d-470", now - 470), (L, "d-490", now - 490), (b"m" * 32, "d-ahead", now + 900))}
        assert await recall.restore(d.url, notes, {rid: BULK for rid in notes}) == 2
        left = store.peek(K).expires_at - time.monotonic()
        assert 0 < left <= 10.5, f"recalled with {left:.0f} s to live"
        assert store.peek(L) is None and client.replica(d.url).pending == ["d-490"]
        ahead = store.peek(b"m" * 32)
        assert ahead.kept_at <= time.time() and ahead.expires_at - time.monotonic() <= 480
        assert await store.pinned(d.url) == 2 * KEPT.blocks
    finally:
        await d.stop()


# -- separate router processes in front of fake engines ---------------------------------------
U1 = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def setup(tmp_path):
    p, d = FakeEngine("prefill", nixl_host="10.0.1.1"), FakeEngine("decode", nixl_host="10.0.2.2")
    await p.start()
    await d.start()
    cfg = tmp_path / "router.json"
    cfg.write_text(json.dumps({"prefill": [p.url], "decode": [d.url],
                               "placement": {"policy": "alwaysDisaggregate"},
                               "healthCheckIntervalSeconds": 0.5}))
    routers: list[RouterProcess] = []

    def router(name: str, key: str = KEY) -> RouterProcess:
        # No --handle-store: the in-process store, which dies with the process.
        r = RouterProcess(cfg, None, tmp_path / f"{name}.log", key)
        routers.append(r)
        return r

    try:
        yield p, d, router
    finally:
        for r in routers:
            r.stop(signal.SIGKILL)
        await p.stop()
        await d.stop()


def handles_sent(p: FakeEngine) -> list[str]:
    return [g.kv["remote_request_id"] for g in p.generations() if g.has_handle]


async def stored(r: RouterProcess, n: int, timeout: float = 15.0) -> bool:
    """True once the router's store holds `n` handles (its /metrics count)."""
    want = f"bidirkv_router_handles {float(n)}"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with aiohttp.ClientSession() as s:
        while loop.time() < deadline:
            async with s.get(r.url + "/metrics") as resp:
                if want in (await resp.text()).splitlines():
                    return True
            await asyncio.sleep(0.1)
    return False


async def noted(d: FakeEngine, n: int, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(d.notes) < n:
        assert loop.time() < deadline, "decode got no note"
        await asyncio.sleep(0.05)


async def test_a_restarted_router_reuses_what_decode_still_holds(setup):
    p, d, router = setup
    a = await router("a").start()
    status, m1 = await a.chat(U1)
    assert status == 200
    await noted(d, 1)
    kept_rid = next(iter(d.notes))
    a.stop(signal.SIGTERM)
    b = await router("b").start()
    assert await stored(b, 1), "the new router recalled nothing"
    status, _ = await b.chat(U1 + [m1, {"role": "user", "content": "x"}])
    assert status == 200 and handles_sent(p) == [kept_rid], "turn 2 after the restart recomputed"
    # One owner for both processes: decode kept the blocks for the new one.
    owners = {c["owner"] for c in d.residency_calls}
    assert owners == {stable_owner(KEY.encode())}


async def test_a_restarted_router_is_ready_once_its_handles_are_back(setup, tmp_path):
    """/ready waits for the first recall from each healthy decode: a turn sent as soon as
    the new router is ready (a rollout moves traffic then) reuses."""
    p, d, router = setup
    cfg = tmp_path / "router.json"  # a probe timeout (5 s) well past the gate's wait
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()),
                               "healthCheckIntervalSeconds": 5}))
    a = await router("a").start()
    status, m1 = await a.chat(U1)
    assert status == 200
    await noted(d, 1)
    (kept_rid,) = d.notes
    a.stop(signal.SIGTERM)
    d.behaviour.recall_gate = asyncio.Event()
    b = router("b")
    starting = asyncio.create_task(b.start())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    async with aiohttp.ClientSession() as s:
        while True:
            assert loop.time() < deadline, "the new router never reported its recall"
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(b.url + "/ready") as r:
                    body = await r.json()
                    if body.get("recalling"):
                        break
            await asyncio.sleep(0.05)
    assert r.status == 503 and body["recalling"] == [d.url] and "recalling" in body["reason"]
    assert body["mode"] == "disaggregated" and not starting.done()
    d.behaviour.recall_gate.set()
    await starting
    status, _ = await b.chat(U1 + [m1, {"role": "user", "content": "x"}])
    assert status == 200 and handles_sent(p) == [kept_rid], "a turn right after ready recomputed"
    async with aiohttp.ClientSession() as s, s.get(b.url + "/metrics") as r:
        assert f'bidirkv_router_recalled_handles_total{{url="{d.url}"}} 1.0' in await r.text()


def test_a_start_waits_for_no_replica_past_its_bound_or_one_that_gives_nothing_back():
    from bidirkv.router.pool.recall import Recall
    from bidirkv.router.pool.residency import ResidencyClient
    from bidirkv.router.store.memory import InProcessStore

    client = ResidencyClient(15, aiohttp.ClientTimeout(total=1))
    store = InProcessStore(300, 100)
    recall = Recall(client, store, store.peek, lambda: 300.0, lambda coro: None)
    client.replica("http://no-route").supported = False
    recall.asked.add("http://asked")  # recalled, refused or failed: asked again later
    urls = ["http://new", "http://no-route", "http://asked"]
    assert recall.waiting(urls) == ["http://new"]
    recall.ready_wait_s = 0.0
    assert recall.waiting(urls) == []


async def test_several_conversations_come_back_and_a_released_one_does_not(setup):
    p, d, router = setup
    a = await router("a").start()
    replies = {}
    for c in ("c1", "c2", "c3"):
        status, replies[c] = await a.chat(U1, conversation_id=c)
        assert status == 200
    await noted(d, 3)
    assert await a.delete("c2") == 204
    while len(d.notes) != 2:  # the release drops its note on decode
        await asyncio.sleep(0.05)
    a.stop(signal.SIGTERM)
    b = await router("b").start()
    assert await stored(b, 2)
    for c in ("c1", "c2", "c3"):
        status, _ = await b.chat(U1 + [replies[c], {"role": "user", "content": "x"}],
                                 conversation_id=c)
        assert status == 200
    assert len(handles_sent(p)) == 2


async def test_what_decode_no_longer_holds_is_a_miss_and_forged_notes_nothing(setup):
    p, d, router = setup
    a = await router("a").start()
    status, m1 = await a.chat(U1)
    assert status == 200
    await noted(d, 1)
    a.stop(signal.SIGTERM)
    (rid, (seq, owner, _)), = d.notes.items()
    d.notes[rid] = (seq, owner, "1.forged." + json.dumps(["x"]))
    b = await router("b").start()
    status, _ = await b.chat(U1 + [m1, {"role": "user", "content": "x"}])
    assert status == 200 and handles_sent(p) == []
    assert await stored(b, 1)  # the turn's own handle, nothing else


async def test_another_handle_key_recalls_nothing(setup):
    p, d, router = setup
    a = await router("a").start()
    status, m1 = await a.chat(U1)
    assert status == 200
    await noted(d, 1)
    a.stop(signal.SIGTERM)
    other = await router("other", key="f" * 64).start()
    status, _ = await other.chat(U1 + [m1, {"role": "user", "content": "x"}])
    assert status == 200 and handles_sent(p) == []


async def test_a_rollout_brings_back_the_old_routers_last_turns_too(setup):
    p, d, router = setup
    a = await router("old").start()
    status, m1 = await a.chat(U1)
    assert status == 200
    await noted(d, 1)
    rid1 = next(iter(d.notes))
    b = await router("new").start()  # both serve for a while, as in a rolling update
    assert await stored(b, 1)
    history = U1 + [m1, {"role": "user", "content": "x"}]
    status, m2 = await a.chat(history)  # the old router's last turn, after b recalled
    assert status == 200
    # (The fake decode does not see prefill's read of rid1, which drops its note on a
    # real one.)
    while not set(d.notes) - {rid1}:
        await asyncio.sleep(0.05)
    rid2, = set(d.notes) - {rid1}
    seq = d.notes[rid2][0]
    # b follows new notes from its cursor: a recall from past this note's sequence means
    # the page holding it was put back.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while not any(c.get("recall", 0) >= seq for c in d.residency_calls):
        assert loop.time() < deadline, "the new router did not follow the old one's notes"
        await asyncio.sleep(0.1)
    a.stop(signal.SIGTERM)
    status, _ = await b.chat(history + [m2, {"role": "user", "content": "y"}])
    assert status == 200 and handles_sent(p)[-1] == rid2


async def test_a_router_that_stops_sends_what_it_still_queued_for_decode_first(setup, tmp_path):
    """SIGTERM right after a turn: the note beside its handle and the release of an ended
    conversation, still queued (decode refused the calls that carried them, and no
    health round comes before the stop), reach decode before the router exits, so the
    router after it recalls that turn."""
    p, d, router = setup
    cfg = tmp_path / "router.json"  # the fixture's: health rounds far apart
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()),
                               "healthCheckIntervalSeconds": 15}))
    a = await router("a").start()
    d.behaviour.residency_status = 503
    status, m1 = await a.chat(U1, conversation_id="kept")
    assert status == 200 and (await a.chat(U1, conversation_id="ended"))[0] == 200
    issued = set(d.issued)
    assert await a.delete("ended") == 204
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not any(c.get("release") and c.get("keep") for c in d.residency_calls):
        assert loop.time() < deadline, "the router sent no release beside the note"
        await asyncio.sleep(0.05)
    d.behaviour.residency_status = 200
    assert await a.ended(signal.SIGTERM) == 0
    assert len(d.notes) == 1 and len(d.released) == 1, "queued for decode, lost at the stop"
    (kept_rid,) = d.notes
    assert {kept_rid, *d.released} == issued
    b = await router("b").start()
    assert await stored(b, 1)
    status, _ = await b.chat(U1 + [m1, {"role": "user", "content": "x"}],
                             conversation_id="kept")
    assert status == 200 and handles_sent(p) == [kept_rid]


# -- the client's note queue (in-process, one fake decode) ------------------------------------
async def client_and_decode():
    from bidirkv.router.pool.residency import ResidencyClient

    d = FakeEngine("decode")
    await d.start()
    client = ResidencyClient(30, aiohttp.ClientTimeout(total=5), handle_key=KEY.encode())
    client.notes_key = NK
    return client, d


async def test_a_note_goes_with_the_next_call_and_a_release_takes_its_queued_note_back():
    client, d = await client_and_decode()
    try:
        d.issued.update({"d-1": BULK, "d-2": BULK})
        client.keep(dataclasses.replace(KEPT, decode_url=d.url, request_id="d-1"), HANDLE)
        client.keep(dataclasses.replace(KEPT, decode_url=d.url, request_id="d-2"), HANDLE)
        client.release_ids(d.url, ["d-2"])
        async with aiohttp.ClientSession() as s:
            assert await client.call(s, d.url)
        call = d.residency_calls[-1]
        assert set(call["keep"]) == {"d-1"} and call["release"] == ["d-2"]
        assert decode(NK, "d-1", call["keep"]["d-1"], d.url, BULK).key == KEPT.key
        assert client.replica(d.url).keeping == {}
    finally:
        await d.stop()


async def test_notes_of_a_call_decode_did_not_take_wait_for_the_next_and_a_refused_batch_goes():
    client, d = await client_and_decode()
    try:
        d.issued["d-1"] = BULK
        client.keep(dataclasses.replace(KEPT, decode_url=d.url, request_id="d-1"), HANDLE)
        d.behaviour.residency_status = 429
        async with aiohttp.ClientSession() as s:
            assert not await client.call(s, d.url)
            assert set(client.replica(d.url).keeping) == {"d-1"}
            d.behaviour.residency_status = 400  # refused: dropped, the lease renewed alone
            assert not await client.call(s, d.url)
            assert client.replica(d.url).keeping == {}
            assert "keep" not in d.residency_calls[-1]
    finally:
        await d.stop()


async def test_the_flush_at_the_stop_waits_no_longer_than_its_bound():
    """A decode that takes the call and never answers: the stop's flush gives up at its
    bound, and the release it was sending is still queued, not lost mid-call."""
    from bidirkv.router.pool.residency import ResidencyClient

    done = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        await done.wait()
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = ResidencyClient(30, aiohttp.ClientTimeout(total=30), handle_key=KEY.encode())
    try:
        async with aiohttp.ClientSession() as s:
            client.start(s)
            client.release_ids(url, ["d-1"])
            await asyncio.sleep(0.1)  # the sender has the call out
            # Its own bound ends the flush: the wait here only keeps a hang from stalling
            # the suite.
            await asyncio.wait_for(client.close(flush_s=0.3), 60)
        assert client.replica(url).pending == ["d-1"]
    finally:
        done.set()
        server.close()
        await server.wait_closed()


async def test_without_notes_key_no_note_is_made():
    client, d = await client_and_decode()
    try:
        client.notes_key = None  # a shared store: it keeps the handles itself
        client.keep(dataclasses.replace(KEPT, decode_url=d.url), HANDLE)
        assert client.replica(d.url).keeping == {}
    finally:
        await d.stop()


@pytest.mark.parametrize("store, key, notes", [
    (None, KEY.encode(), True), (None, None, False),
    ("redis://127.0.0.1:1/0", KEY.encode(), False),
])
async def test_only_the_in_process_store_with_a_handle_key_leaves_notes(store, key, notes):
    from bidirkv.router.config import load_config
    from bidirkv.router.datapath.context import Context

    cfg = load_config(None, {"prefill": ["http://p"], "decode": ["http://d"],
                             **({"handleStore": store} if store else {})})
    ctx = Context(cfg, handle_key=key)
    try:
        assert (ctx.residency.notes_key is not None) == notes
        assert (ctx.residency.on_first_answer is not None) == notes
        # One owner for every process of a resource (a shared store names its own later).
        assert (ctx.residency.owner == stable_owner(KEY.encode())) == (key is not None)
    finally:
        await ctx.store.close()


async def test_a_decode_that_takes_no_recall_is_asked_once():
    from bidirkv.router.pool.recall import Recall
    from bidirkv.router.store.memory import InProcessStore

    client, d = await client_and_decode()
    try:
        store = InProcessStore(300, 100)
        recall = Recall(client, store, store.peek, lambda: 300.0, lambda coro: None)
        recall.follow_every_s = 0.01
        d.behaviour.residency_status = 400  # as a release before notes answers "recall"
        async with aiohttp.ClientSession() as s:
            assert await recall.replica(s, d.url) == 0
        assert sum(1 for c in d.residency_calls if "recall" in c) == 1
    finally:
        await d.stop()


async def test_a_recall_puts_back_a_page_and_follows_what_comes_after():
    from bidirkv.router.pool.recall import Recall
    from bidirkv.router.store.memory import InProcessStore

    client, d = await client_and_decode()
    try:
        store = InProcessStore(300, 100, client.release)
        recall = Recall(client, store, store.peek, lambda: 300.0, lambda coro: None)
        recall.follow_s, recall.follow_every_s = 0.3, 0.05
        client.replica(d.url)  # in the pool (a replica removed is not followed)
        now = time.time()
        d.issued.update({"d-1": BULK, "d-2": BULK})
        d.notes["d-1"] = (1, client.owner, note_of(note(K, "d-1", now), now))
        async with aiohttp.ClientSession() as s:
            task = asyncio.ensure_future(recall.replica(s, d.url))
            while store.peek(K) is None:
                await asyncio.sleep(0.01)
            # Kept by another router of the resource after this one recalled: newer.
            d.notes["d-2"] = (2, client.owner, note_of(note(K, "d-2", now + 1), now))
            assert await task == 2
        assert store.peek(K).request_id == "d-2" and store.peek(K).decode_url == d.url
        # The handle it replaced is released on decode (with the next call).
        assert client.replica(d.url).pending == ["d-1"]
    finally:
        await d.stop()
