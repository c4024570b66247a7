"""Leaving engine pods in the status (bidirkv/operator/reconcile/drainwatch.py, pure), the
conversations a draining decode pod still holds (heldcount.py: its engine's gauge, parsed
and read), then through the controller: the Draining condition and fields, and one
DrainTimedOut Event."""

from __future__ import annotations

import datetime as dt
import http.server
import socket
import threading

import pytest

from bidirkv.operator.reconcile.drainwatch import (
    RECHECK_S,
    draining_condition,
    draining_pods,
    leaving,
    newly_timed_out,
    next_look,
    role_drains,
    timed_out_message,
)
from bidirkv.operator.reconcile.heldcount import (
    HeldReads,
    fetch_retained,
    metrics_url,
    retained_in,
    to_read,
)

T0 = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def stamp(seconds: float) -> str:
    return at(seconds).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(name="tiny-decode-1", deleted_at: float | None = 0, grace=150, drain="120",
        given: int | None = None):
    """A pod deleted at `deleted_at` (s after T0) with its spec's grace period `grace`,
    or the one the deletion gave (`given`); None: not being deleted."""
    meta = {"name": name}
    if deleted_at is not None:
        meta["deletionTimestamp"] = stamp(deleted_at + (grace if given is None else given))
        if given is not None:
            meta["deletionGracePeriodSeconds"] = given
    env = [] if drain is None else [{"name": "BIDIRKV_DRAIN_SECONDS", "value": drain}]
    return {"metadata": meta, "spec": {"terminationGracePeriodSeconds": grace,
                                       "containers": [{"name": "engine", "env": env}]}}


# (pod, its drain's deadline in seconds after T0; None: not draining)
LEAVING = [
    (pod(), 120),                               # the drain cap
    (pod(deleted_at=30), 150),
    (pod(drain=None), 150),                     # no cap: the grace period
    (pod(given=60), 60),                        # a shorter grace at deletion bounds it
    (pod(given=0), 0),
    (pod(drain="0"), 0),
    (pod(drain="soon"), 150),                   # unreadable cap: the grace period
    (pod(deleted_at=None), None),
    ({"metadata": {"name": "p", "deletionTimestamp": "yesterday"}}, None),
    ({"metadata": {"deletionTimestamp": stamp(10)}}, None),
    # No grace period anywhere: Kubernetes' default 30 s, from a deletion at 10 s.
    ({"metadata": {"name": "p", "deletionTimestamp": stamp(40)}}, 40),
]


@pytest.mark.parametrize(("obj", "deadline"), LEAVING)
def test_a_pods_drain_and_its_deadline(obj, deadline):
    got = leaving(obj)
    if deadline is None:
        assert got is None
    else:
        assert got is not None and got.deadline == at(deadline)


# (seconds after T0 now, the previous status' entry, what the status lists)
LISTED = [
    (10, None, {"deadline": stamp(120), "timedOut": False}),
    (119, None, {"deadline": stamp(120), "timedOut": False}),
    (120, None, {"deadline": stamp(120), "timedOut": True}),      # still there at it
    (200, None, {"deadline": stamp(120), "timedOut": True}),
    # A mark stays while the deadline is the same (a clock a second behind)...
    (119, {"name": "tiny-decode-1", "deadline": stamp(120), "timedOut": True},
     {"deadline": stamp(120), "timedOut": True}),
    # ...but not for another drain of a pod of the same name.
    (119, {"name": "tiny-decode-1", "deadline": stamp(60), "timedOut": True},
     {"deadline": stamp(120), "timedOut": False}),
]


@pytest.mark.parametrize(("now", "before", "want"), LISTED)
def test_the_status_lists_draining_pods(now, before, want):
    previous = {"drainingPods": [before]} if before else None
    listed = draining_pods([pod(), pod("tiny-decode-0", deleted_at=None)], previous, at(now))
    assert listed == [{"name": "tiny-decode-1", **want}]


def test_draining_pods_come_sorted_and_only_those_leaving():
    pods = [pod("tiny-decode-2"), pod("tiny-decode-0", deleted_at=None), pod("tiny-decode-1")]
    assert [p["name"] for p in draining_pods(pods, None, at(0))] == ["tiny-decode-1",
                                                                      "tiny-decode-2"]
    assert draining_pods([], {"drainingPods": [{"name": "gone"}]}, at(0)) == []


def entry(name, deadline=120, timed_out=False, conversations=None):
    out = {"name": name, "deadline": stamp(deadline), "timedOut": timed_out}
    if conversations is not None:
        out["conversations"] = conversations
    return out


# (this pass' reading, the previous entry, the conversations the status lists; None: none)
HELD = [
    (3, None, 3),
    (0, entry("tiny-decode-1", conversations=4), 0),  # a fresh reading replaces the last
    (None, None, None),                                # never read: unknown, not 0
    (None, entry("tiny-decode-1", conversations=4), 4),  # a failed read keeps the last
    (None, entry("tiny-decode-1", 60, conversations=4), None),  # ...of this drain only
]


@pytest.mark.parametrize(("reading", "before", "want"), HELD)
def test_a_draining_pod_lists_the_conversations_it_holds(reading, before, want):
    previous = {"drainingPods": [before]} if before else None
    held = {} if reading is None else {"tiny-decode-1": reading, "tiny-decode-9": 7}
    (listed,) = draining_pods([pod()], previous, at(10), held)
    assert listed.get("conversations") == want


# (each draining pod's conversations, None: unknown; the role's total, its summary)
TOTALS = [
    ([], None, "0"),
    ([None, None], None, "2"),
    ([3, 2], 5, "2 (5 held)"),
    ([3, None], 3, "2 (3+ held)"),
    ([0], 0, "1 (0 held)"),
]


@pytest.mark.parametrize(("counts", "total", "summary"), TOTALS)
def test_the_role_sums_what_its_draining_pods_hold(counts, total, summary):
    listed = [entry(f"d{i}", conversations=n) for i, n in enumerate(counts)]
    got = role_drains(listed)
    assert got["draining"] == len(counts) and got["drainingPods"] == listed
    assert got.get("drainingConversations") == total
    assert got["drainingSummary"] == summary


# (previous status, new status, the pods an Event is posted for)
EVENTS = [
    ({}, {"decode": {"drainingPods": [entry("d1")]}}, []),
    ({}, {"decode": {"drainingPods": [entry("d1", timed_out=True)]}}, ["d1"]),
    ({"decode": {"drainingPods": [entry("d1")]}},
     {"decode": {"drainingPods": [entry("d1", timed_out=True)]}}, ["d1"]),
    # Once: the next pass finds the mark.
    ({"decode": {"drainingPods": [entry("d1", timed_out=True)]}},
     {"decode": {"drainingPods": [entry("d1", timed_out=True)]}}, []),
    # A new drain of the same name is another drain.
    ({"decode": {"drainingPods": [entry("d1", 60, timed_out=True)]}},
     {"decode": {"drainingPods": [entry("d1", timed_out=True)]}}, ["d1"]),
    ({}, {"prefill": {"drainingPods": [entry("p0", timed_out=True)]},
          "decode": {"drainingPods": [entry("d1", timed_out=True), entry("d2")]}},
     ["p0", "d1"]),
]


@pytest.mark.parametrize(("previous", "status", "want"), EVENTS)
def test_one_event_per_drain_that_ran_out(previous, status, want):
    assert [p["name"] for _, p in newly_timed_out(previous, status)] == want


def test_what_the_event_and_the_condition_say():
    msg = timed_out_message("decode", entry("tiny-decode-1"), 120)
    assert "tiny-decode-1" in msg and "spec.decode.drainSeconds 120" in msg
    assert "recompute" in msg
    assert "legs" in timed_out_message("prefill", entry("tiny-prefill-0"), None)
    assert draining_condition({"decode": {"drainingPods": []}}) == (
        False, "NoneDraining", "no engine pod is leaving")
    ok, reason, msg = draining_condition({"decode": {"drainingPods": [
        entry("tiny-decode-1"), entry("tiny-decode-2", timed_out=True)]}})
    assert (ok, reason) == (True, "Draining")
    assert msg.startswith(f"decode: tiny-decode-1 (until {stamp(120)}), tiny-decode-2 "
                          f"(until {stamp(120)}, timed out)")


def test_the_event_and_the_condition_name_the_conversations_held():
    msg = timed_out_message("decode", entry("tiny-decode-1", conversations=3), 120)
    assert "still held 3 conversations at its last reading" in msg and "recompute" in msg
    one = timed_out_message("decode", entry("tiny-decode-1", conversations=1), 120)
    assert "1 conversation at" in one and "it recomputes its history" in one
    _, _, msg = draining_condition({"decode": {"drainingPods": [
        entry("tiny-decode-1", conversations=3),
        entry("tiny-decode-2", timed_out=True, conversations=2),
        entry("tiny-decode-3")]}})
    assert msg.startswith(
        f"decode: tiny-decode-1 holds 3 conversations (until {stamp(120)}), tiny-decode-2 "
        f"(until {stamp(120)}, timed out, still held 2 conversations), tiny-decode-3 "
        f"(until {stamp(120)})")


# -- reading the engine's gauge ----------------------------------------------------------
NAME = "vllm:bidirkv_retained_requests"
EXPOSITION = f"""# HELP {NAME} Requests retained for a later turn.
# TYPE {NAME} gauge
{NAME}{{engine="0",model_name="m"}} 3.0
{NAME}{{engine="1",model_name="a}}b \\"q\\" c"}} 2.0
{NAME}_other{{engine="0"}} 40.0
vllm:kv_cache_usage_perc{{engine="0"}} 0.5
"""

# (exposition, count; None: unknown)
EXPOSITIONS = [
    (EXPOSITION, 5),  # summed over the server's engines; label values may hold } and "
    (f"{NAME} 4\n", 4),  # no labels
    (f"{NAME}{{engine=\"0\"}} 4 1700000000000\n", 4),  # with a timestamp
    ("vllm:kv_cache_usage_perc 0.5\n", None),  # an engine without the gauge
    ("", None),
    (f"{NAME}{{engine=\"0\"}} NaN\n", None),
    (f"{NAME}{{engine=\"0\"}} -1\n", None),
    (f"{NAME}{{engine=\"0\"}} 1.5\n", None),
    (f"{NAME}{{engine=\"0\"}} three\n", None),
    (f"{NAME}{{engine=\"0\" 3\n", None),  # a label set that never closes
    (f"{NAME}{{engine=\"0\"}}\n", None),  # no value
]


@pytest.mark.parametrize(("text", "want"), EXPOSITIONS)
def test_the_gauge_read_from_an_exposition(text, want):
    assert retained_in(text) == want


def _with_port(obj, ip="10.0.0.7", port=8000, name="http"):
    obj["status"] = {"podIP": ip} if ip else {}
    obj["spec"]["containers"][0]["ports"] = [{"name": "nixl", "containerPort": 5600},
                                             {"name": name, "containerPort": port}]
    return obj


@pytest.mark.parametrize(("obj", "want"), [
    (_with_port(pod()), "http://10.0.0.7:8000/metrics"),
    (_with_port(pod(), ip="fd00::7", port=8080), "http://[fd00::7]:8080/metrics"),
    (_with_port(pod(), ip=None), None),            # not scheduled yet: no IP
    (_with_port(pod(), ip="metrics.example"), None),  # not an IP: no name is looked up
    (_with_port(pod(), name="api"), None),         # no port named http
    (_with_port(pod(), port="8000"), None),
])
def test_where_a_pods_engine_serves_its_metrics(obj, want):
    got = metrics_url(obj)
    assert (got if got is None else got.split("?")[0]) == want
    if got is not None:  # only the one gauge is asked for (prometheus_client's filter)
        assert got.endswith("?name%5B%5D=vllm%3Abidirkv_retained_requests")


def test_only_pods_still_draining_are_read():
    pods = [_with_port(pod("d1")), _with_port(pod("d2", deleted_at=None)),
            _with_port(pod("d3"), ip=None), _with_port(pod("d4", deleted_at=-200))]
    assert list(to_read(pods, at(10))) == ["d1"]  # d4's drain ran out: its engine stopped


class _Engine(http.server.BaseHTTPRequestHandler):
    status, body, paths = 200, EXPOSITION, []

    def do_GET(self):  # noqa: N802 - the handler's name
        type(self).paths.append(self.path)
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(self.body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def engine():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Engine.status, _Engine.body, _Engine.paths = 200, EXPOSITION, []
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


async def test_the_operator_reads_what_draining_engines_hold(engine):
    good = _with_port(pod("d1"), ip="127.0.0.1", port=engine)
    assert await HeldReads().read([good], at(10)) == {"d1": 5}
    assert _Engine.paths[-1].startswith("/metrics?name")
    # A closed port, an engine that answers an error or garbage: unknown, no error.
    gone = _with_port(pod("d2"), ip="127.0.0.1", port=closed_port())
    assert await HeldReads().read([good, gone], at(10)) == {"d1": 5}
    _Engine.status = 503
    assert await fetch_retained(metrics_url(good)) is None
    _Engine.status, _Engine.body = 200, "<html>not metrics</html>"
    assert await fetch_retained(metrics_url(good)) is None


def closed_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (seconds after T0 now, the status' pods, seconds until the next look)
LOOKS = [
    (0, [], None),
    (0, [entry("d1", 120)], RECHECK_S),
    (115, [entry("d1", 120)], 5.5),          # just past the deadline
    (120, [entry("d1", 120)], 0.5),
    (130, [entry("d1", 120, timed_out=True)], RECHECK_S),  # gone soon: looked at anyway
]


@pytest.mark.parametrize(("now", "pods", "want"), LOOKS)
def test_the_next_look_at_draining_pods(now, pods, want):
    assert next_look({"decode": {"drainingPods": pods}}, at(now)) == want


# -- the controller: which pod events bring a pass -------------------------------------
def _pod_body(instance="tiny", component="decode", namespace="ns1", deleting=True):
    meta = {"name": f"{instance}-{component}-0", "namespace": namespace,
            "labels": {"app.kubernetes.io/instance": instance,
                       "app.kubernetes.io/component": component}}
    if deleting:
        meta["deletionTimestamp"] = stamp(150)
    return {"metadata": meta}


@pytest.mark.parametrize(("event", "body", "scheduled"), [
    ("MODIFIED", _pod_body(), True),
    ("DELETED", _pod_body(deleting=False), True),
    ("MODIFIED", _pod_body(deleting=False), False),   # a pod that is not leaving
    ("ADDED", _pod_body(deleting=False), False),
    ("MODIFIED", _pod_body(component="prefill"), True),
    ("MODIFIED", _pod_body(component="router"), False),
    ("MODIFIED", _pod_body(instance="other"), False),
    ("MODIFIED", _pod_body(namespace="ns2"), False),
])
async def test_a_leaving_or_gone_engine_pod_brings_a_pass_of_its_resource(event, body,
                                                                         scheduled):
    from bidirkv.operator.reconcile.controller import Controller

    controller = Controller(client=None)
    controller.owners["u1"] = {"metadata": {"name": "tiny", "namespace": "ns1", "uid": "u1"}}
    controller.pod_event(event, body)
    assert ("u1" in controller.queue._pending) is scheduled
    controller.queue.close()


def test_the_status_patch_removes_what_a_pod_or_role_no_longer_says():
    """A count that became unknown is removed, not left stale: a merge patch deletes by
    null at any depth of objects, and replaces a list whole."""
    from bidirkv.operator.reconcile.status import merge_patch

    old = {"phase": "Ready", "decode": {"draining": 1, "drainingConversations": 3,
                                        "drainingPods": [entry("d1", conversations=3)]}}
    new = {"decode": {"draining": 1, "drainingPods": [entry("d1")]}}
    assert merge_patch(old, new) == {
        "phase": None, "decode": {"draining": 1, "drainingConversations": None,
                                  "drainingPods": [entry("d1")]}}
