"""Decode's NIXL notifications with shared reads taken out, and handed to the scheduler's
side (bidirkv/connector/nixl/notifs.py)."""

from bidirkv.connector.core.residency import Residency
from bidirkv.connector.nixl.notifs import SharedNotifs, SharedReadsDone, shared_request
from bidirkv.wire import SHARE_PREFIX


class Agent:
    def __init__(self, notifs):
        self.notifs = notifs
        self.name = "agent-d"

    def get_new_notifs(self):
        out, self.notifs = self.notifs, {}
        return out


def test_shared_reads_notifications_are_taken_out_and_handed_over_once():
    shared = (SHARE_PREFIX + "parent:1").encode()
    notifs = SharedNotifs(Agent({"p0": [shared, b"other-req:1", b"HB:x"], "p1": [shared]}))
    assert notifs.get_new_notifs() == {"p0": [b"other-req:1", b"HB:x"]}
    assert notifs.take() == SharedReadsDone(["parent", "parent"])
    assert notifs.take() is None
    assert notifs.name == "agent-d"  # everything else is the agent's


def test_what_the_workers_hand_over_is_what_the_residency_counts():
    res = Residency(shares=True)
    res.retain("parent", 2, "r", 1e9, block_ids=[1, 2], groups=(2,))
    for _ in range(3):
        assert res.share("parent")[0]
    step = SharedReadsDone(["parent"]).aggregate(SharedReadsDone(["parent", "stray"]))
    for rid in step.req_ids:
        res.shared_done(rid)
    assert res.held["parent"].readers == 1


def test_only_a_prefixed_notification_names_a_shared_read():
    assert shared_request((SHARE_PREFIX + "a:b:2").encode()) == "a:b"
    assert shared_request(b"plain:1") is None
    assert shared_request(SHARE_PREFIX.encode() + b":1") is None
