"""Decode's KV working set: the pure computation, the gauge an engine core keeps, and the
value reaching vLLM's connector stats and Prometheus beside bidir-kv's counters."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from decode_gauges import engine_metrics, on_engine, residency, retain

from bidirkv.connector.core import workingset
from bidirkv.operator.render.autoscaling import KV_WORKING_SET_METRIC

# (vLLM's usage, retained blocks, usable blocks, working set)
TABLE = [
    (0.0, 0, 100, 0.0),
    (0.5, 0, 100, 0.5),  # nothing retained: vLLM's usage
    (0.8, 30, 100, 0.5),  # retained blocks are not live work
    (0.3, 30, 100, 0.0),  # all of it retained
    (0.3, 50, 100, 0.0),  # the two read a step apart: never below zero
    (1.0, 0, 100, 1.0),
    (0.75, 1, 4, 0.5),
    (0.5, 0, 0, 0.0),  # no usable blocks (a pool of the null block only)
]


@pytest.mark.parametrize(("usage", "retained", "usable", "expected"), TABLE)
def test_working_set_against_the_table(usage, retained, usable, expected):
    assert workingset.working_set(usage, retained, usable) == pytest.approx(expected)


def test_retained_blocks_are_held_granted_and_releasing_ones():
    res = residency()
    assert workingset.retained_blocks(None) == 0
    assert workingset.retained_blocks(res) == 0
    retain(res, a=4, b=3, c=2)
    assert workingset.retained_blocks(res) == 9
    assert res.grant("a")[:2] == (True, "granted")  # freed once prefill's read completes
    assert res.release(["b"]) == 3  # on its way out, still allocated in vLLM
    assert workingset.retained_blocks(res) == 9
    res.frees(["a", "b"])  # vLLM freed them: no longer in vLLM's usage either
    assert workingset.retained_blocks(res) == 2


@dataclass
class Pool:
    """vLLM's BlockPool as the gauge reads it (the null block is one of num_gpu_blocks)."""

    num_gpu_blocks: int
    free: int

    def get_usage(self) -> float:
        return 1.0 - self.free / (self.num_gpu_blocks - 1)


def test_the_gauge_reads_the_bound_pool_and_reports_changes_only():
    gauge = workingset.WorkingSetGauge()
    res = residency()
    assert gauge.value(res) is None and gauge.changed(res) is None  # no pool yet
    pool = Pool(num_gpu_blocks=101, free=40)  # 60 of 100 usable blocks in use
    gauge.bind(pool)
    assert gauge.changed(res) == pytest.approx(0.6)
    assert gauge.changed(res) is None  # unchanged: no stats for an idle engine
    retain(res, a=20)  # 20 of the 60 only kept for reuse
    assert gauge.changed(res) == pytest.approx(0.4)
    pool.free = 10  # live work grows
    assert gauge.changed(res) == pytest.approx(0.7)
    assert gauge.value(res) == pytest.approx(0.7)


def test_the_engines_gauge_is_the_one_the_operator_scales_on():
    assert workingset.KV_WORKING_SET_METRIC == KV_WORKING_SET_METRIC
    name = KV_WORKING_SET_METRIC
    assert name.startswith("vllm:bidirkv_") and name.endswith("_ratio")
    assert not name.endswith("_total")


def test_stats_carry_the_latest_reading():
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    from bidirkv.connector.hooks import tally
    from bidirkv.connector.nixl import stats
    from bidirkv.connector.nixl.connector import NixlConnector

    key = workingset.WORKING_SET
    only = stats.BidirkvStats(data={key: 0.25})
    assert not only.is_empty()
    both = stats.of(NixlKVConnectorStats()).aggregate(only)
    assert both.data[key] == 0.25
    both.aggregate(stats.BidirkvStats(data={tally.REUSED_TOKENS: 8, key: 0.5}))
    assert both.data[key] == 0.5 and both.data[tally.REUSED_TOKENS] == 8
    both.aggregate(stats.BidirkvStats(data={tally.REUSED_TOKENS: 1}))  # no new reading
    assert both.data[key] == 0.5
    again = NixlConnector.build_kv_connector_stats(both.to_dict())
    assert again.reduce()["KV working set"] == 0.5
    again.reset()
    assert key not in again.data and again.is_empty()


def test_prometheus_exports_the_working_set_per_engine():
    reg, prom = engine_metrics()
    from bidirkv.connector.hooks import tally

    got = reg.get_sample_value
    prom.observe({workingset.WORKING_SET: 0.4}, 0)
    prom.observe({workingset.WORKING_SET: 0.9}, 1)
    prom.observe({tally.REUSED_TOKENS: 5}, 0)  # counters alone leave the gauge as it was
    assert got(KV_WORKING_SET_METRIC, on_engine(0)) == 0.4
    assert got(KV_WORKING_SET_METRIC, on_engine(1)) == 0.9
    prom.observe({workingset.WORKING_SET: 0.1}, 0)
    assert got(KV_WORKING_SET_METRIC, on_engine(0)) == 0.1


def test_the_connectors_stats_hand_over_the_gauge_when_it_changed(monkeypatch):
    pytest.importorskip("vllm")
    from bidirkv.connector.hooks.tally import Tally
    from bidirkv.connector.nixl import connector
    from bidirkv.connector.nixl.connector import NixlConnector

    gauge = workingset.WorkingSetGauge()
    monkeypatch.setattr(workingset, "gauge", lambda: gauge)
    monkeypatch.setattr(connector, "current", lambda: None)  # retaining nothing
    conn = NixlConnector.__new__(NixlConnector)  # the scheduler side, without an engine
    conn.connector_worker, conn._retention, conn._tally = None, None, Tally()
    assert conn.get_kv_connector_stats() is None  # no pool bound: nothing to say
    gauge.bind(Pool(num_gpu_blocks=11, free=5))
    first = conn.get_kv_connector_stats()
    assert first.data[workingset.WORKING_SET] == pytest.approx(0.5)
    assert conn.get_kv_connector_stats() is None
