"""A draining prefill replica (its pod is leaving): the router learns it from a report-only
residency call each health round and places no new prefill leg there while another
prefill is healthy. The report's client on its own, then the router against fake
engines."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from fake_engine import Cluster, FakeEngine

from bidirkv.proof import (
    RESIDENCY_AUTH_HEADER,
    RESIDENCY_TARGET_HEADER,
    residency_auth_problem,
    residency_target,
)
from bidirkv.router.pool.drain import PrefillReports, report_only
from bidirkv.wire import RESIDENCY_PATH, RESIDENCY_VERSION_FIELD, VERSION

KEY = b"k" * 32
FAST = {"healthCheckIntervalSeconds": 0.05}
U1 = [{"role": "user", "content": "hi"}]


# -- the report's client ---------------------------------------------------------------
class Answers:
    """A residency route that answers each URL from a script, recording the bodies."""

    def __init__(self, script):
        self.script = script
        self.bodies: list[tuple[str, dict]] = []

    async def __call__(self, session, url, body):
        self.bodies.append((url, body))
        answer = self.script[url]
        if isinstance(answer, Exception):
            raise answer
        status, report = answer
        return status, json.dumps(report).encode() if report is not None else b"not json"


async def test_a_report_only_call_carries_neither_owner_nor_lease():
    assert report_only() == {RESIDENCY_VERSION_FIELD: VERSION}
    answers = Answers({"http://p0": (200, {"draining": True})})
    reports = PrefillReports(answers)
    assert await reports.ask(None, "http://p0") == {"draining": True}
    assert answers.bodies == [("http://p0", report_only())]
    assert reports.last == {"http://p0": {"draining": True}}


@pytest.mark.parametrize("answer", [
    (401, {"error": {}}), (409, {"error": {}}), (500, {}), (200, None), (200, ["draining"]),
    OSError("refused"), TimeoutError(),
])
async def test_no_report_keeps_what_was_said_before(answer):
    answers = Answers({"http://p0": (200, {"draining": True})})
    reports = PrefillReports(answers)
    await reports.ask(None, "http://p0")
    answers.script["http://p0"] = answer
    assert await reports.ask(None, "http://p0") is None
    assert reports.last["http://p0"] == {"draining": True}
    # Asked again next round: only a missing route stops the calls.
    await reports.ask(None, "http://p0")
    assert len(answers.bodies) == 3


async def test_a_replica_without_the_route_is_not_asked_again():
    answers = Answers({"http://p0": (404, {}), "http://p1": (200, {"draining": False})})
    reports = PrefillReports(answers)
    assert await reports.ask(None, "http://p0") is None
    assert await reports.ask(None, "http://p0") is None
    await reports.ask(None, "http://p1")
    assert [u for u, _ in answers.bodies] == ["http://p0", "http://p1"]
    # Removed from the config and added again: asked afresh, nothing said before stands.
    reports.keep_only(["http://p1"])
    assert reports.unsupported == set() and list(reports.last) == ["http://p1"]
    reports.keep_only([])
    assert reports.last == {}


# -- the router against fake engines ---------------------------------------------------
class Prefill(FakeEngine):
    """A prefill engine with the bidir-kv plugin's residency route: it reports whether
    it drains (bidirkv/connector/patches/residency.py answers prefill as decode), and
    records each call's signature."""

    def __init__(self) -> None:
        super().__init__("prefill", nixl_host="10.0.1.1")
        self.auth: list[tuple[str | None, str | None, bytes]] = []

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_post(RESIDENCY_PATH, self._report)
        return app

    async def _report(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.auth.append((request.headers.get(RESIDENCY_AUTH_HEADER),
                          request.headers.get(RESIDENCY_TARGET_HEADER), raw))
        self.residency_calls.append(json.loads(raw))
        return web.json_response({"enabled": False, "numBlocks": 100, "freeBlocks": 100,
                                  "draining": self.behaviour.draining, "activeRequests": 0})


def cluster(n: int = 2, **kwargs) -> Cluster:
    c = Cluster(prefill=n, decode=1, config=FAST, **kwargs)
    c.p = [Prefill() for _ in range(n)]
    return c


async def until_draining(c, engine, draining=True):
    backend = c.router.ctx.prefill.get(engine.url)
    for _ in range(200):
        if backend.draining is draining:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the router never saw {engine.url} draining={draining}")


@pytest.mark.timeout(30)
async def test_a_draining_prefill_gets_no_new_legs_while_another_is_healthy():
    async with cluster(handle_key=KEY) as c:
        leaving, staying = c.p
        leaving.behaviour.draining = True  # as its launcher's `"drain": true` leaves it
        await until_draining(c, leaving)
        before = len(leaving.generations())
        for i in range(6):
            assert (await c.chat([{"role": "user", "content": f"new {i}"}]))["status"] == 200
        assert len(leaving.generations()) == before
        assert len(staying.generations()) >= 6
        # Report-only and signed with the handle key: the engine's route answers no one
        # else, and the call renews, releases and keeps nothing.
        assert leaving.residency_calls and all(
            body == report_only() for body in leaving.residency_calls)
        header, target, raw = leaving.auth[-1]
        # For this replica only.
        assert target == residency_target(leaving.url)
        assert residency_auth_problem(header, target, [KEY], RESIDENCY_PATH, raw) is None
        # The drain called off: it takes legs again.
        leaving.behaviour.draining = False
        await until_draining(c, leaving, draining=False)
        for i in range(6):
            await c.chat([{"role": "user", "content": f"again {i}"}])
        assert len(leaving.generations()) > before


@pytest.mark.timeout(30)
async def test_a_draining_prefill_still_serves_when_no_other_is_healthy():
    async with cluster() as c:
        leaving, other = c.p
        leaving.behaviour.draining = True
        await until_draining(c, leaving)
        other.behaviour.health_status = 503
        backend = c.router.ctx.prefill.get(other.url)
        for _ in range(200):
            if not backend.healthy:
                break
            await asyncio.sleep(0.02)
        assert not backend.healthy
        r = await c.chat(U1)
        assert r["status"] == 200 and leaving.generations()


@pytest.mark.timeout(30)
async def test_a_prefill_without_the_route_serves_as_before():
    async with Cluster(prefill=2, decode=1, config=FAST) as c:
        await asyncio.sleep(0.3)  # a few health rounds: the 404s are taken, not retried
        for i in range(4):
            assert (await c.chat([{"role": "user", "content": f"x {i}"}]))["status"] == 200
        assert all(p.generations() for p in c.p)
        reports = c.router.upkeep.prefill_reports
        assert reports.unsupported == {p.url for p in c.p}
