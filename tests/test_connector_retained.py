"""Decode's count of requests retained for a later turn: the reading an engine core hands
over when it changed, its way through vLLM's connector stats, and the Prometheus gauge a
draining decode pod's operator reads (operator/reconcile/heldcount.py)."""

from __future__ import annotations

import pytest
from decode_gauges import engine_metrics, on_engine, residency, retain

from bidirkv.connector.core import workingset
from bidirkv.operator.reconcile.heldcount import RETAINED_REQUESTS_METRIC, retained_in


def test_the_reading_counts_parked_requests_and_goes_out_when_it_changed():
    gauge = workingset.WorkingSetGauge()  # no block pool bound: only the count
    res = residency()
    assert gauge.readings(None) == {}  # prefill: no residency, no count
    assert gauge.readings(res) == {workingset.RETAINED: 0}
    assert gauge.readings(res) == {}  # unchanged: an idle engine says nothing
    retain(res, a=2, b=2, c=2)
    assert gauge.readings(res) == {workingset.RETAINED: 3}
    assert res.grant("a")[:2] == (True, "granted")  # its turn came back: it is being read
    res.release(["b"])  # the router let it go
    assert gauge.readings(res) == {workingset.RETAINED: 1}
    res.frees(["a", "b"])
    assert gauge.readings(res) == {}


def test_the_engines_gauge_is_the_one_the_operator_reads():
    assert workingset.RETAINED_REQUESTS_METRIC == RETAINED_REQUESTS_METRIC


def test_stats_carry_the_latest_count():
    pytest.importorskip("vllm")
    from bidirkv.connector.hooks import tally
    from bidirkv.connector.nixl import stats
    from bidirkv.connector.nixl.connector import NixlConnector

    key = workingset.RETAINED
    got = stats.BidirkvStats(data={key: 0})
    assert not got.is_empty()  # a count of 0 is a reading: the drain's last one
    got.aggregate(stats.BidirkvStats(data={key: 4}))
    got.aggregate(stats.BidirkvStats(data={tally.REUSED_TOKENS: 2}))  # no new reading
    assert got.data[key] == 4
    again = NixlConnector.build_kv_connector_stats(got.to_dict())
    assert again.reduce()["Retained requests"] == 4
    again.reset()
    assert key not in again.data and again.is_empty()


def test_prometheus_exports_the_count_per_engine_from_the_start():
    reg, prom = engine_metrics()
    from prometheus_client.exposition import generate_latest

    name = RETAINED_REQUESTS_METRIC
    assert reg.get_sample_value(name, on_engine(0)) == 0
    prom.observe({workingset.RETAINED: 3}, 0)
    prom.observe({workingset.RETAINED: 2}, 1)
    prom.observe({workingset.WORKING_SET: 0.5}, 0)  # the other gauge leaves it as it was
    assert reg.get_sample_value(name, on_engine(0)) == 3
    # The operator's reading of the exposition: both engines' counts.
    assert retained_in(generate_latest(reg).decode()) == 5
