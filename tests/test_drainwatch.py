"""Leaving engine pods in the status (bidirkv/operator/reconcile/drainwatch.py, pure), then
through the controller: the Draining condition and fields, and one DrainTimedOut Event."""

from __future__ import annotations

import datetime as dt

import pytest

from bidirkv.operator.reconcile.drainwatch import (
    RECHECK_S,
    draining_condition,
    draining_pods,
    leaving,
    newly_timed_out,
    next_look,
    timed_out_message,
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


def entry(name, deadline=120, timed_out=False):
    return {"name": name, "deadline": stamp(deadline), "timedOut": timed_out}


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
    assert ("u1" in controller._pending) is scheduled
    controller.close()
