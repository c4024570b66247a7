"""A worker reads its peer's blocks only with the ids the peer gave when asked: prefill
decode's retained ones with the grant, decode prefill's lent ones
(bidirkv/connector/nixl/worker.py), driven with stand-ins for vLLM's worker state."""

from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)

from bidirkv.connector.core.handles import placeholder_ids
from bidirkv.connector.nixl.worker import PullWorker


class Gate:
    def __init__(self, answer):
        self.answer, self.asked = answer, []

    def confirm(self, host, port, req_id):
        self.asked.append(req_id)
        return self.answer


def worker(answer):
    w = object.__new__(PullWorker)  # vLLM's __init__ needs a whole engine
    w.grant_gate = Gate(answer)
    w._bidirectional_kv_xfer_enabled = True
    w._remote_agents = {"eng-d": object()}
    w._invalid_remote_engines = set()
    w._recv_failures = object()
    w.failed = []
    w.expired = 0
    w.xfer_stats = SimpleNamespace(record_kv_expired_req=lambda: setattr(
        w, "expired", w.expired + 1))
    w._handle_failed_transfer = lambda req_id, *a, **k: w.failed.append(req_id)
    return w


def meta(ids, expiry=5.0):
    remote = SimpleNamespace(block_ids=ids, host="10.0.0.2", port=5600, engine_id="eng-d",
                             request_id="d-1", blocks_expiry_time=expiry)
    return SimpleNamespace(remote=remote, local_physical_block_ids=([1, 2],))


@pytest.fixture
def reads(monkeypatch):
    """What reached vLLM's own read: (request id, the remote ids it reads)."""
    seen = []
    monkeypatch.setattr(NixlPullConnectorWorker, "_read_blocks_for_req",
                        lambda self, req_id, m: seen.append((req_id, list(m.remote.block_ids))))
    return seen


def test_the_grants_ids_replace_the_placeholders_before_vllm_reads(reads):
    w = worker((True, "granted", [[40, 41, 42]]))
    w._read_blocks_for_req("p-1", meta(tuple(placeholder_ids([2]))))
    assert w.grant_gate.asked == ["d-1"] and reads == [("p-1", [[40, 41]])]
    assert w.failed == []


@pytest.mark.parametrize("answer", [
    (False, "released:router", []),
    (True, "granted", [[40]]),  # fewer ids than the read needs
    (True, "granted", []),
])
def test_a_refused_or_short_grant_recomputes_and_reads_nothing(reads, answer):
    w = worker(answer)
    w._read_blocks_for_req("p-1", meta(tuple(placeholder_ids([2]))))
    assert reads == [] and w.failed == ["p-1"] and w.expired == 1


def test_prefills_lent_blocks_are_read_with_the_ids_prefill_gives(reads):
    """A read of prefill's blocks (no deadline: decode, each turn) asks prefill for the
    ids its compact handle left out; without them nothing is read (vLLM recomputes)."""
    w = worker((True, "lent", [[40, 41, 42]]))
    w._read_blocks_for_req("d-1", meta(tuple(placeholder_ids([3])), expiry=None))
    assert w.grant_gate.asked == ["d-1"] and reads == [("d-1", [[40, 41, 42]])]
    for answer in ((False, "unknown", []), (True, "lent", [[40, 41]])):
        w = worker(answer)
        w._read_blocks_for_req("d-2", meta(tuple(placeholder_ids([3])), expiry=None))
        assert w.failed == ["d-2"] and w.expired == 0
    assert len(reads) == 1
    # A handle that carries its ids (vLLM's own) goes to vLLM as it is, unasked.
    w = worker((True, "lent", [[9, 9]]))
    w._read_blocks_for_req("d-3", meta(([5, 6],), expiry=None))
    assert w.grant_gate.asked == [] and reads[-1] == ("d-3", [[5, 6]])
