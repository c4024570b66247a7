"""A turn's handle ends exactly once, whichever way the turn goes: every reservation
that took an entry from the store is consumed, discarded, forgotten or released, once
(bidirkv/router/datapath/reservation.py), and the store sees that one end."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import aiohttp
import pytest
from fake_engine import Cluster

from bidirkv.router.datapath import reservation
from bidirkv.router.datapath.reservation import Reservation

pytestmark = pytest.mark.timeout(30)

U1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
THRESHOLDS = {"placement": {"policy": "thresholds"}}


class Ends:
    """Every reservation made while it is installed, and each end it was asked for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.made: list[Reservation] = []
        self.asked: Counter[int] = Counter()
        self.how: list[str] = []
        init, end = Reservation.__init__, Reservation._end

        def counting_init(r: Reservation, *a: object, **kw: object) -> None:
            init(r, *a, **kw)
            self.made.append(r)

        def counting_end(r: Reservation, how: str) -> object:
            self.asked[id(r)] += 1
            self.how.append(how)
            return end(r, how)

        monkeypatch.setattr(Reservation, "__init__", counting_init)
        monkeypatch.setattr(Reservation, "_end", counting_end)

    async def settled(self) -> list[str]:
        """Once every reservation holding an entry has ended: how each ended, in order.
        Asserts none was asked to end twice, and none that held nothing ended."""
        for _ in range(200):
            if all(r.entry is None or r.ended is not None for r in self.made):
                break
            await asyncio.sleep(0.01)
        held = [r for r in self.made if r.entry is not None]
        assert [r.ended for r in held if r.ended is None] == []
        assert {id(r): n for r in self.made if (n := self.asked[id(r)]) != (
            1 if r.entry is not None else 0)} == {}
        return [r.ended for r in held]


async def second_turn(c: Cluster, stream: bool = False, **kw: object) -> dict:
    r1 = await c.chat(U1, conversation_id="a")
    return await c.chat(U1 + [r1["message"], {"role": "user", "content": "ok"}], stream,
                        conversation_id="a", **kw)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_served_reuse_turn_consumes_its_handle(monkeypatch, stream):
    ends = Ends(monkeypatch)
    async with Cluster() as c:
        assert (await second_turn(c, stream))["status"] == 200
        assert await ends.settled() == [reservation.CONSUMED]


async def test_a_prefill_failing_with_the_handle_discards_it_and_the_retry_has_none(
        monkeypatch):
    ends = Ends(monkeypatch)
    async with Cluster() as c:
        r1 = await c.chat(U1, conversation_id="a")
        c.p[0].behaviour.fail_with_handle = 500
        r2 = await c.chat(U1 + [r1["message"]], True, conversation_id="a")
        assert r2["status"] == 200
        assert await ends.settled() == [reservation.DISCARDED]
        assert ends.how == [reservation.DISCARDED]


async def test_a_decode_failing_before_a_byte_leaves_the_consumed_handle_alone(monkeypatch):
    ends = Ends(monkeypatch)
    async with Cluster(decode=2) as c:
        r1 = await c.chat(U1, conversation_id="a")
        holder = next(d for d in c.d if d.generations())
        holder.behaviour.fail_next, holder.behaviour.status_next = 1, 503
        r2 = await c.chat(U1 + [r1["message"]], True, conversation_id="a")
        assert r2["status"] == 200
        assert await ends.settled() == [reservation.CONSUMED]


@pytest.mark.parametrize("mode", ["break", "no_done"])
async def test_a_stream_that_breaks_after_the_handle_was_used(monkeypatch, mode):
    ends = Ends(monkeypatch)
    async with Cluster(config={"timeouts": {"decodeSeconds": 0.5}}) as c:
        r1 = await c.chat(U1, conversation_id="a")
        if mode == "break":
            c.d[0].behaviour.break_after = 2
        else:
            c.d[0].behaviour.no_params = True
        r2 = await c.chat(U1 + [r1["message"]], True, conversation_id="a")
        assert r2["status"] == 200
        assert await ends.settled() == [reservation.CONSUMED]


async def test_a_client_leaving_while_prefill_has_the_handle_forgets_it(monkeypatch):
    ends = Ends(monkeypatch)
    async with Cluster() as c:
        r1 = await c.chat(U1, conversation_id="a")
        c.p[0].behaviour.hang = True
        body = {"model": "m", "messages": U1 + [r1["message"]], "conversation_id": "a"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as s:
            with pytest.raises(asyncio.TimeoutError):
                await s.post(c.url + "/v1/chat/completions", json=body)
        await asyncio.wait_for(c.p[0].cancelled_event.wait(), 5)
        assert await ends.settled() == [reservation.FORGOTTEN]


async def test_a_client_leaving_mid_stream(monkeypatch):
    ends = Ends(monkeypatch)
    async with Cluster() as c:
        r1 = await c.chat(U1, conversation_id="a")
        c.d[0].behaviour.chunk_delay = 0.1
        c.d[0].behaviour.reply = ["x"] * 100
        body = json.dumps({"model": "m", "messages": U1 + [r1["message"]], "stream": True,
                           "conversation_id": "a"}).encode()
        async with aiohttp.ClientSession() as s:
            resp = await s.post(c.url + "/v1/chat/completions", data=body,
                                headers={"Content-Type": "application/json"})
            await resp.content.readline()
            resp.close()
        await asyncio.wait_for(c.d[0].cancelled_event.wait(), 5)
        assert await ends.settled() == [reservation.CONSUMED]


async def test_a_turn_that_never_reached_an_engine_releases_its_handle(monkeypatch):
    ends = Ends(monkeypatch)
    async with Cluster(prefill=1) as c:
        r1 = await c.chat(U1, conversation_id="a")
        c.p[0].behaviour.health_status = 500
        await c.router.health.check_health()
        r2 = await c.chat(U1 + [r1["message"]], conversation_id="a")
        assert r2["status"] == 503
        assert await ends.settled() == [reservation.RELEASED]
        # Back in the store: the next turn is offered it.
        c.p[0].behaviour.health_status = 200
        await c.router.health.check_health()
        await c.chat(U1 + [r1["message"]], conversation_id="a")
        assert await ends.settled() == [reservation.RELEASED, reservation.CONSUMED]


async def test_an_engine_refusing_the_reuse_turn(monkeypatch):
    """A 4xx from P with the handle: the handle is the likely cause, dropped; the retry
    without it is refused again and the client gets the engine's answer."""
    ends = Ends(monkeypatch)
    async with Cluster() as c:
        r1 = await c.chat(U1, conversation_id="a")
        c.p[0].behaviour.status = 400
        r2 = await c.chat(U1 + [r1["message"]], conversation_id="a")
        assert r2["status"] == 400
        assert await ends.settled() == [reservation.DISCARDED]


@pytest.mark.parametrize("stream", [False, True])
async def test_an_extended_turn_discards_the_handle_it_supersedes(monkeypatch, stream):
    ends = Ends(monkeypatch)
    async with Cluster(config=THRESHOLDS) as c:
        r2 = await second_turn(c, stream)
        assert r2["headers"]["X-Bidirkv-Placement"] == "extend; reason=short_append"
        assert await ends.settled() == [reservation.DISCARDED]
        assert 'bidirkv_router_reuse_total{outcome="extended"} 1.0' in await c.metrics()


async def test_an_extend_failing_falls_back_to_the_two_legs_without_the_handle(monkeypatch):
    ends = Ends(monkeypatch)
    async with Cluster(decode=2, config=THRESHOLDS) as c:
        r1 = await c.chat(U1, conversation_id="a")
        holder = next(d for d in c.d if d.generations())
        holder.behaviour.fail_next = 1
        r2 = await c.chat(U1 + [r1["message"], {"role": "user", "content": "ok"}],
                          conversation_id="a")
        assert r2["headers"]["X-Bidirkv-Placement"] == "prefill; reason=extend_failed"
        assert await ends.settled() == [reservation.DISCARDED]
        assert not c.p[0].generations()[-1].has_handle


async def test_prefill_only_fallback_never_hands_p_the_handle(monkeypatch):
    """With every decode out, P serves the turn whole: no handle is P's to read."""
    ends = Ends(monkeypatch)
    async with Cluster() as c:
        r1 = await c.chat(U1, conversation_id="a")
        c.d[0].behaviour.health_status = 500
        await c.router.health.check_health()
        r2 = await c.chat(U1 + [r1["message"]], conversation_id="a")
        assert r2["status"] == 200
        assert not c.p[0].generations()[-1].has_handle
        assert await ends.settled() in ([], [reservation.RELEASED])


async def test_an_entry_cannot_end_twice():
    class Store:
        async def consume(self, entry: object) -> None:
            pass

        async def discard(self, entry: object, reason: str) -> None:
            pass

    r = Reservation(Store(), lambda *_: None)  # type: ignore[arg-type]
    r.took(object(), "hit")  # type: ignore[arg-type]
    await r.consume(partial=False)
    with pytest.raises(RuntimeError, match="ended as 'discarded' after 'consumed'"):
        await r.discard("reuse_failed")
    await r.release()  # nothing held: a no-op
    assert r.ended == reservation.CONSUMED and r.reuse == "hit"


async def test_an_extend_at_the_watermark_keeps_the_handle_it_stored(monkeypatch):
    """The extended handle holds the old one's history on decode: counted once, a replica
    exactly at its watermark keeps it (auto-named conversations: a new key each turn)."""
    ends = Ends(monkeypatch)
    async with Cluster(config={**THRESHOLDS, "retentionWatermark": 1.0,
                               "healthCheckIntervalSeconds": 0.05}) as c:
        store, d = c.router.ctx.store, c.d[0]

        async def two_turns(system: str, rid: str) -> int:
            u1 = [{"role": "system", "content": system}, U1[1]]
            r1 = await c.chat(u1, headers={"X-Request-Id": rid + "-1"})
            r2 = await c.chat(u1 + [r1["message"], {"role": "user", "content": "ok"}],
                              headers={"X-Request-Id": rid + "-2"})
            assert r2["headers"]["X-Bidirkv-Placement"] == "extend; reason=short_append"
            return await store.pinned(d.url)

        extended = await two_turns("be brief", "x")  # the blocks of one extended handle
        y1 = [{"role": "system", "content": "be terse"}, U1[1]]
        r1 = await c.chat(y1, headers={"X-Request-Id": "y-1"})
        d.behaviour.num_blocks = 2 * extended  # room for two extended handles, no more
        for _ in range(100):
            if c.router.ctx.residency.capacity(d.url) == 2 * extended:
                break
            await asyncio.sleep(0.02)
        r2 = await c.chat(y1 + [r1["message"], {"role": "user", "content": "ok"}],
                          headers={"X-Request-Id": "y-2"})
        assert r2["headers"]["X-Bidirkv-Placement"] == "extend; reason=short_append"
        assert await ends.settled() == [reservation.DISCARDED] * 2
        assert await d.wait_released("y-1")  # what only the old request held
        assert await store.pinned(d.url) == 2 * extended
        assert "y-2" not in d.released and "x-2" not in d.released
        assert 'reason="watermark"' not in await c.metrics()
