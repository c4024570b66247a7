"""The drain decision of a leaving engine (pure), and the endpoint's `drain` field."""

import pytest

from bidirkv.connector.drain import (
    DEFAULT_DRAIN_S,
    FORWARD,
    MAX_FAILURES,
    WAIT,
    Step,
    decide,
    drain_seconds,
)
from bidirkv.connector.endpoint import body_problem

HELD = {"retainedRequests": 2, "retainedBlocks": 40, "releasingBlocks": 0, "activeRequests": 0}
GRANTED_ONLY = {"retainedRequests": 1, "retainedBlocks": 8, "grantedBlocks": 8,
                "releasingBlocks": 0, "activeRequests": 0}
RELEASING_ONLY = {"retainedRequests": 1, "retainedBlocks": 8, "releasingBlocks": 8,
                  "activeRequests": 0}
IN_FLIGHT = {"retainedRequests": 0, "retainedBlocks": 0, "activeRequests": 1}
EMPTY = {"retainedRequests": 0, "retainedBlocks": 0, "activeRequests": 0}
PREFILL_IDLE = {"enabled": False, "numBlocks": 100, "freeBlocks": 100, "activeRequests": 0}
PREFILL_BUSY = {"enabled": False, "activeRequests": 3}


@pytest.mark.parametrize("report, failures, now, want", [
    # A decode that holds nothing ends its drain at once.
    (EMPTY, 0, 0.0, Step(FORWARD, "drained")),
    (PREFILL_IDLE, 0, 0.0, Step(FORWARD, "drained")),
    # Held or granted blocks a peer may still read keep it.
    (HELD, 0, 0.0, Step(WAIT, "held")),
    (GRANTED_ONLY, 0, 5.0, Step(WAIT, "held")),
    # Blocks on their way out keep nobody.
    (RELEASING_ONLY, 0, 0.0, Step(FORWARD, "drained")),
    # A leg in flight (decode's ends by retaining, prefill's by answering).
    (IN_FLIGHT, 0, 0.0, Step(WAIT, "active")),
    (PREFILL_BUSY, 0, 0.0, Step(WAIT, "active")),
    # The deadline wins over anything still held.
    (HELD, 0, 30.0, Step(FORWARD, "deadline")),
    (None, 1, 31.0, Step(FORWARD, "deadline")),
    # An engine that does not answer: a few tries, then nothing to wait for.
    (None, 1, 0.0, Step(WAIT, "no_answer")),
    (None, MAX_FAILURES - 1, 0.0, Step(WAIT, "no_answer")),
    (None, MAX_FAILURES, 0.0, Step(FORWARD, "unreachable")),
    # Junk counts are read as nothing.
    ({"retainedBlocks": "9", "activeRequests": True}, 0, 0.0, Step(FORWARD, "drained")),
])
def test_decide(report, failures, now, want):
    assert decide(report, failures, now, deadline=30.0) == want


def test_drain_seconds_from_env():
    assert drain_seconds({}) == DEFAULT_DRAIN_S
    assert drain_seconds({"BIDIRKV_DRAIN_SECONDS": "150"}) == 150.0
    assert drain_seconds({"BIDIRKV_DRAIN_SECONDS": "0"}) == 0.0
    for bad in ("-1", "soon", "nan", "inf", "86401"):
        with pytest.raises(ValueError, match=rf"BIDIRKV_DRAIN_SECONDS={bad!r}: must be a "
                                             r"number of seconds in 0-86400"):
            drain_seconds({"BIDIRKV_DRAIN_SECONDS": bad})


def test_endpoint_takes_drain_as_a_bool_only():
    assert body_problem({"drain": True, "wire": 2}) is None
    assert body_problem({"drain": False}) is None
    assert body_problem({"drain": "yes"}) == "drain 'yes': must be true or false"


def test_the_residency_utility_marks_draining_and_reports_work_in_flight():
    from types import SimpleNamespace

    from bidirkv.connector.patches.residency import residency_utility

    pool = SimpleNamespace(num_gpu_blocks=64, get_num_free_blocks=lambda: 60)
    engine = SimpleNamespace(scheduler=SimpleNamespace(
        kv_cache_manager=SimpleNamespace(block_pool=pool),
        get_num_unfinished_requests=lambda: 2))
    assert residency_utility(engine, {})["draining"] is False
    out = residency_utility(engine, {"drain": True})
    assert out["draining"] is True and out["activeRequests"] == 2
    assert residency_utility(engine, {"release": []})["draining"] is True  # it stays
    assert residency_utility(engine, {"drain": False})["draining"] is False
