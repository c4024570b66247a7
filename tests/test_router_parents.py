"""Sub-agents and forks: a child's first turn runs where its parent's prefix lives, and
the parent keeps its handle (bidirkv/router/datapath/parents.py)."""

from __future__ import annotations

import asyncio

import pytest

from bidirkv.knobs import PARENT_HEADERS
from bidirkv.router.datapath.parents import (
    Noted,
    Parent,
    Prefixes,
    fork_key,
    head,
    reuse_kind,
)
from bidirkv.router.metrics import ReuseOutcome
from bidirkv.router.pool.placement import (
    EXTEND,
    READ_BACK,
    Decision,
)
from bidirkv.router.request.identity import LookupKeys
from bidirkv.router.request.validation import ClientError, parent_id

KEYS = LookupKeys(b"k" * 32)


# -- pure ---------------------------------------------------------------------------------
def test_the_first_configured_parent_header_sent_wins():
    headers = {"x-codex-parent-thread-id": "c", "X-Dynamo-Parent-Session-ID": "d"}
    assert parent_id(headers, PARENT_HEADERS) == "d"
    assert parent_id(headers, PARENT_HEADERS[1:]) == "c"
    assert parent_id(headers, ()) is None
    assert parent_id(None, PARENT_HEADERS) is None


@pytest.mark.parametrize("value, says", [("", "a non-empty string"),
                                         ("p" * 513, "513 characters is too long")])
def test_a_parent_header_out_of_bounds_is_refused_by_name(value, says):
    # Also one that would not win: every header sent is held to the bounds.
    with pytest.raises(ClientError) as e:
        parent_id({"X-Dynamo-Parent-Session-ID": "ok",
                   "x-codex-parent-thread-id": value}, PARENT_HEADERS)
    assert e.value.status == 400 and e.value.param == "x-codex-parent-thread-id"
    assert says in e.value.message


def test_the_head_is_the_tools_and_a_system_message():
    tools = [{"type": "function", "function": {"name": "grep"}}]
    system = {"role": "system", "content": "you are an agent"}
    parts, chars = head({"messages": [system, {"role": "user", "content": "task"}],
                         "tools": tools})
    assert parts == [tools, system] and chars > len("you are an agent")
    assert head({"messages": [{"role": "user", "content": "no system"}]}) is None
    assert head({"messages": [{"role": "user", "content": "x"}], "tools": tools})[0] \
        == [tools, None]


def test_a_forks_key_is_its_parents_prompt_key():
    """A fork is the parent's prompt, its answer and one message of its own: its first
    messages hash as the parent's stored prompt key (keeping.py's, 4-byte count first)."""
    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    fork = prompt + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "f"}]
    parents_key = len(prompt).to_bytes(4, "big") + KEYS.messages_key(b"t", prompt, 2)
    assert fork_key(KEYS, b"t", fork) == parents_key
    assert fork_key(KEYS, b"other tenant", fork) != parents_key
    assert fork_key(KEYS, b"t", fork[:2]) is None


def test_prefixes_keep_the_most_recently_used():
    p = Prefixes(max_entries=2)
    for k in (b"a", b"b"):
        p.note(k, Noted(k, "http://d", 1, "l"))
    assert p.get(b"a") is not None  # used: b is now the oldest
    p.note(b"c", Noted(b"c", "http://d", 1, "l"))
    assert len(p) == 2 and p.get(b"b") is None and p.get(b"a") is not None


def test_reuse_is_counted_by_whose_kv_it_was():
    parent = Parent("fork", "http://d", 100, "l")
    extend, prefill = Decision(EXTEND, "x"), Decision(READ_BACK, "x")
    assert reuse_kind(ReuseOutcome.EXTENDED, False, extend, None) == "returning"
    assert reuse_kind(ReuseOutcome.HIT, True, prefill, None) == "returning"
    assert reuse_kind(ReuseOutcome.HIT, False, prefill, None) is None  # P never used it
    assert reuse_kind(ReuseOutcome.MISS, False, extend, parent) == "fork"
    assert reuse_kind(ReuseOutcome.MISS, False, prefill, parent) is None
    assert reuse_kind(ReuseOutcome.MISS, False, prefill, parent, read_parent=True) == "fork"


# -- over HTTP, against fake engines ------------------------------------------------------

from fake_engine import Cluster  # noqa: E402

SYSTEM = {"role": "system", "content": "you are a coding agent " * 20}
U1 = [SYSTEM, {"role": "user", "content": "fix the bug"}]
PARENT = {"X-Session-ID": "parent-1", "Authorization": "Bearer a"}
CONFIG = {"placement": {"policy": "thresholds", "localPrefillTokens": 512},
          "placementHeader": True}


def child_of(sid: str, *, header: bool, tenant: str = "Bearer a") -> dict[str, str]:
    h = {"X-Session-ID": sid, "Authorization": tenant}
    if header:
        h["x-claude-code-parent-agent-id"] = "parent-1"
    return h


def placed(r) -> str:
    return r["headers"]["X-Bidirkv-Placement"]


async def parent_two_turns(c: Cluster):
    r1 = await c.chat(U1, headers=PARENT)
    turn2 = U1 + [r1["message"], {"role": "user", "content": "and the test"}]
    r2 = await c.chat(turn2, headers=PARENT)
    assert placed(r2).startswith("extend;")
    holder = next(d for d in c.d if len(d.generations()) == 2)
    return turn2, r2, holder


@pytest.mark.timeout(30)
async def test_forks_and_a_sub_agent_run_on_the_parents_holder_and_the_parent_keeps_its_handle():
    async with Cluster(decode=2, config=CONFIG) as c:
        turn2, r2, holder = await parent_two_turns(c)
        p_seen = len(c.p[0].generations())
        history = turn2 + [r2["message"]]
        for i in range(2):  # two forks, found by their history alone
            r = await c.chat(history + [{"role": "user", "content": f"branch {i}"}],
                             headers=child_of(f"fork-{i}", header=False))
            assert r["status"] == 200
            assert placed(r).startswith("extend; reason=short_append; parent=")
            assert placed(r).endswith("; kind=fork")
        sub = await c.chat([SYSTEM, {"role": "user", "content": "read the logs"}],
                           headers=child_of("sub-0", header=True))
        assert placed(sub).endswith("; kind=child")
        # None of them went to P, all were decoded by the holder, and no child's leg
        # carried a handle to read.
        assert len(c.p[0].generations()) == p_seen
        children = holder.generations()[2:]
        assert len(children) == 3 and all("remote_block_ids" not in g.kv for g in children)
        # The parent's next turn still extends its own handle.
        turn3 = history + [{"role": "user", "content": "ship it"}]
        r3 = await c.chat(turn3, headers=PARENT)
        assert placed(r3) == "extend; reason=short_append"
        assert len(holder.generations()) == 6
        text = await c.metrics()
        for kind, n in (("returning", 2), ("child", 1), ("fork", 2), ("prefix", 0)):
            assert f'bidirkv_router_reuse_kind_total{{kind="{kind}"}} {n}.0' in text, kind


@pytest.mark.timeout(30)
async def test_a_long_child_reads_the_parents_blocks_shared_and_the_parent_keeps_them():
    """Where a returning turn would be read back (an append over the cap), a child's P
    reads the parent's handle marked shared: decode keeps the blocks for the parent,
    whose next turn still has its handle. A prefill failure drops only the child's read."""
    config = {**CONFIG, "placement": {**CONFIG["placement"], "maxLocalPrefillTokens": 600}}
    async with Cluster(decode=2, config=config) as c:
        turn2, r2, holder = await parent_two_turns(c)
        history = turn2 + [r2["message"]]
        long_ask = {"role": "user", "content": "look at this log " * 400}
        r = await c.chat(history + [long_ask], headers=child_of("fork-long", header=False))
        assert placed(r).startswith("read_back; reason=append_over_cap; parent=")
        leg = c.p[0].generations()[-1]
        assert leg.has_handle and leg.kv["bidirkv_shared"] is True
        parents_handle = {k: v for k, v in leg.kv.items()
                          if k not in ("bidirkv_shared", "bidirkv_proof")}
        # P failing with it: retried without, and the parent's handle is untouched.
        c.p[0].behaviour.fail_with_handle = 500
        r = await c.chat(history + [long_ask], headers=child_of("fork-2", header=False))
        assert r["status"] == 200 and not c.p[0].generations()[-1].has_handle
        c.p[0].behaviour.fail_with_handle = None
        r3 = await c.chat(history + [{"role": "user", "content": "ok"}], headers=PARENT)
        assert placed(r3) == "extend; reason=short_append"
        text = await c.metrics()
        assert 'bidirkv_router_reuse_kind_total{kind="fork"} 1.0' in text
        assert 'bidirkv_router_reuse_kind_total{kind="returning"} 2.0' in text
        parents_request = holder.generations()[1].headers["X-Request-Id"]
        assert parents_handle["remote_request_id"] == parents_request


@pytest.mark.timeout(30)
async def test_a_sub_agent_without_a_header_is_placed_by_the_shared_head():
    async with Cluster(decode=2, config=CONFIG) as c:
        _, _, holder = await parent_two_turns(c)
        r = await c.chat([SYSTEM, {"role": "user", "content": "other task"}],
                         headers=child_of("sub-1", header=False))
        assert placed(r).endswith("; kind=prefix")
        assert len(holder.generations()) == 3


@pytest.mark.timeout(30)
async def test_an_unknown_or_another_tenants_parent_or_a_clients_own_salt_finds_nothing():
    async with Cluster(decode=2, config=CONFIG) as c:
        turn2, r2, _ = await parent_two_turns(c)
        fork = turn2 + [r2["message"], {"role": "user", "content": "mine"}]
        other = await c.chat(fork, headers=child_of("x", header=True, tenant="Bearer b"))
        unknown = await c.chat([{"role": "user", "content": "hello"}], headers={
            "X-Session-ID": "y", "X-Dynamo-Parent-Session-ID": "no-such-parent"})
        # A client's own cache_salt splits decode's prefix cache: nothing known matches.
        salted = await c.chat(fork, headers=child_of("z", header=True), cache_salt="own")
        for r in (other, unknown, salted):
            assert r["status"] == 200 and "parent=" not in placed(r)
        assert 'bidirkv_router_reuse_kind_total{kind="child"} 0.0' in await c.metrics()


@pytest.mark.timeout(30)
async def test_an_oversized_parent_header_is_a_400_naming_it():
    async with Cluster(config=CONFIG) as c:
        r = await c.chat(U1, headers={"x-codex-parent-thread-id": "p" * 513})
        assert r["status"] == 400 and b"x-codex-parent-thread-id" in r["raw"]
        assert not c.p[0].generations() and not c.d[0].generations()


@pytest.mark.timeout(60)
async def test_a_fork_storm_spills_off_a_busy_holder_and_spares_other_tenants():
    """100 forks of one parent at once: past decodeBusyRequests in flight the holder
    extends no more of them (the rest take the two legs), another tenant's turns are
    served meanwhile, and the parent's handle is still its own afterwards."""
    config = {**CONFIG, "placement": {**CONFIG["placement"], "decodeBusyRequests": 2}}
    async with Cluster(decode=2, config=config) as c:
        turn2, r2, holder = await parent_two_turns(c)
        history = turn2 + [r2["message"]]
        for d in c.d:
            d.behaviour.chunk_delay = 0.01
        storm = [c.chat(history + [{"role": "user", "content": f"try {i}"}], True,
                        headers=child_of(f"f{i}", header=True)) for i in range(100)]
        others = [c.chat([{"role": "user", "content": f"tenant b {i}"}], True,
                         headers={"Authorization": "Bearer b"}) for i in range(5)]
        results = await asyncio.gather(*storm, *others)
        assert all(r["status"] == 200 for r in results)
        decisions = [placed(r).split(";")[0] for r in results[:100]]
        assert 0 < decisions.count("extend") < 100
        assert all("reason=decode_busy" in placed(r) for r in results[:100]
                   if not placed(r).startswith("extend"))
        for d in c.d:
            d.behaviour.chunk_delay = 0.0
        r3 = await c.chat(history + [{"role": "user", "content": "go on"}], headers=PARENT)
        assert placed(r3) == "extend; reason=short_append"


# -- choosing a parent from the handles (Parents over a real in-process store) -------------

from bidirkv.router.datapath.parents import Parents  # noqa: E402
from bidirkv.router.store.base import Kept  # noqa: E402
from bidirkv.router.store.memory import InProcessStore  # noqa: E402

TENANT = b"tenant-a"
TOOLS = [{"type": "function", "function": {"name": "grep"}}]


def salted(body: dict) -> dict:
    return {**body, "cache_salt": KEYS.cache_salt(TENANT)}


async def kept_parent(parents: Parents, store: InProcessStore, sid: str, url: str,
                      prompt: list[dict], chars: int) -> bytes:
    """A parent's handle stored as keeping.py stores an explicit id's, and noted."""
    key = KEYS.explicit_key(TENANT, sid)
    prompt_key = len(prompt).to_bytes(4, "big") + KEYS.messages_key(TENANT, prompt,
                                                                     len(prompt))
    await store.put(Kept(key, b"{}", url, num_tokens=chars // 4, tenant=TENANT,
                         chars=chars, prompt_key=prompt_key))
    parents.note(TENANT, salted({"messages": prompt, "tools": TOOLS}), key, url, chars,
                 prompt_key, f"label-{sid}")
    return key


async def test_a_parent_is_chosen_by_header_then_history_then_head_and_only_while_held():
    store = InProcessStore(100.0, 100)
    parents = Parents(KEYS, store, Prefixes())
    prompt = [SYSTEM, {"role": "user", "content": "fix it"}]
    key = await kept_parent(parents, store, "p", "http://d1", prompt, 4000)
    fork = prompt + [{"role": "assistant", "content": "done"},
                     {"role": "user", "content": "now this"}]
    sub = [SYSTEM, {"role": "user", "content": "other"}]

    async def find(messages, parent_id=None, tenant=TENANT, body=None):
        return await parents.find(tenant, body or salted({"messages": messages,
                                                          "tools": TOOLS}), parent_id, False)

    # By header: a fork of it is given its whole held text, a sub-agent the shared head.
    by_header = await find(fork, "p")
    assert (by_header.kind, by_header.decode_url, by_header.chars) == ("child", "http://d1",
                                                                       4000)
    assert (await find(sub, "p")).chars < 4000
    # Without one: the fork by its prompt key, the sub-agent by its head.
    assert (await find(fork)).kind == "fork"
    assert (await find(sub)).kind == "prefix"
    # Another tenant, a client's own salt, an unknown parent: nothing.
    assert await find(fork, "p", tenant=b"tenant-b") is None
    assert await find(fork, body={"messages": fork, "tools": TOOLS,
                                  "cache_salt": "client's own"}) is None
    assert await find([{"role": "user", "content": "unrelated"}], "nobody") is None
    # The parent's handle taken and spent: its prefixes are believed no more.
    status, entry = await store.lookup(key)
    await store.consume(entry)
    assert await find(fork) is None and await find(sub) is None
    # Kept again, but on another replica than noted: the note is stale.
    await store.put(Kept(key, b"{}", "http://d2", tenant=TENANT, chars=4000))
    assert await find(fork) is None
    assert (await find(fork, "p")).decode_url == "http://d2"


async def test_a_fork_of_a_conversation_named_by_its_history_is_found_by_that_key():
    store = InProcessStore(100.0, 100)
    parents = Parents(KEYS, store, Prefixes())
    prompt = [SYSTEM, {"role": "user", "content": "fix it"}]
    answer = {"role": "assistant", "content": "done"}
    key = KEYS.chat_history(TENANT, prompt).store_key(answer)  # as keeping.py stores it
    await store.put(Kept(key, b"{}", "http://d1", tenant=TENANT, chars=900))
    fork = salted({"messages": [*prompt, answer, {"role": "user", "content": "and"}]})
    found = await parents.find(TENANT, fork, None, by_history=True)
    assert (found.kind, found.decode_url, found.chars) == ("fork", "http://d1", 900)
    # A turn named by its history looked that key up as its own: not again.
    assert await parents.find(TENANT, fork, None, by_history=False) is None
