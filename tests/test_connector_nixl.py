"""bidir-kv's NIXL connector classes, imported from vLLM 0.32 without starting an engine:
vLLM's factory loads them by the config roleconfig.py writes, the guard keeps vLLM's own
connector out, the retention hooks move ids in vLLM's bookkeeping, and the counters reach
vLLM's stats and Prometheus metrics. The connector in a running server: e2e/."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

from bidirkv.connector.core.residency import Residency
from bidirkv.connector.hooks import tally
from bidirkv.connector.hooks.retention import Retention
from bidirkv.connector.patches import connector as guard
from bidirkv.roleconfig import KV_CONNECTOR, KV_CONNECTOR_MODULE
from bidirkv.wire import COUNTS_KEY, OWNER_KEY, RETURN_KEY, SHARED_BLOCKS_KEY, TENANT_KEY

pytest.importorskip("vllm")


def test_vllms_factory_loads_bidirkvs_class_by_the_rendered_config():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

    from bidirkv.connector.nixl.connector import NixlConnector

    cfg = KVTransferConfig(kv_connector=KV_CONNECTOR, kv_role="kv_both",
                           kv_connector_module_path=KV_CONNECTOR_MODULE)
    cls = KVConnectorFactory.get_connector_class(cfg)
    assert cls is NixlConnector and issubclass(cls, NixlPullConnector)
    # vLLM's configuration checks compare this name (config/vllm.py, platforms/cpu.py).
    assert cfg.has_connector("NixlConnector") and cls.__name__ == "NixlConnector"


def test_the_guard_refuses_vllms_own_nixl_connector():
    calls = []
    init = guard._only_ours(lambda self, *a: calls.append(type(self).__name__))
    vllms = type("NixlPullConnector", (), {"__module__": "vllm.distributed.x.connector"})
    with pytest.raises(guard.ForeignConnector) as e:
        init(vllms(), None, None, None)
    assert "kv_connector_module_path='bidirkv.connector.nixl.connector'" in str(e.value)
    ours = type("NixlConnector", (), {"__module__": "bidirkv.connector.nixl.connector"})
    init(ours(), None, None, None)
    assert calls == ["NixlConnector"]


def test_the_connector_refuses_to_start_without_the_plugin_or_a_key(monkeypatch):
    from bidirkv.connector.nixl import connector
    from bidirkv.connector.settings import Settings

    monkeypatch.delattr(connector.NixlBaseConnector.__init__, "__bidirkv_patch__",
                        raising=False)
    keyed = Settings.from_env({"BIDIRKV_HANDLE_KEY": "k" * 64})
    assert "needs the bidirkv vLLM plugin" in connector._problem(keyed)
    with pytest.raises(connector.ConnectorError, match="needs the bidirkv vLLM plugin"):
        connector.NixlConnector(None, None, None)
    monkeypatch.setattr(connector.NixlBaseConnector.__init__, "__bidirkv_patch__", True,
                        raising=False)
    assert connector._problem(keyed) is None
    assert "BIDIRKV_HANDLE_KEY is not set" in connector._problem(Settings.from_env({}))


def sched(bidirectional=True):
    return SimpleNamespace(is_bidirectional_kv_xfer_enabled=bidirectional,
                           _reqs_need_send={}, _reqs_in_batch=set())


def req(rid, params):
    return SimpleNamespace(request_id=rid, kv_transfer_params=params)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_prefill_lends_the_ids_its_compact_handle_leaves_out(bidirectional):
    """Whatever the direction of transfer, D reads P's blocks each turn: P keeps the ids
    of a compact handle it hands out until vLLM frees the blocks."""
    s, res = sched(bidirectional), Residency()
    r = Retention(s, res)
    out = {"do_remote_prefill": True, "remote_block_ids": [[7, 8]], COUNTS_KEY: [2]}
    r.finished(req("p1", {}), True, out)
    assert res.answer("p1") == (True, "lent", [[7, 8]]) and "p1" not in res.held
    r.finished(req("p2", {}), False, dict(out))  # not delayed: nothing lent
    r.finished(req("p3", {}), True, {k: v for k, v in out.items() if k != COUNTS_KEY})
    assert len(res.lent) == 1
    r.sent(["p1"], [])
    assert res.answer("p1")[0] is False and len(res.lent) == 0


def test_retention_follows_vllms_bookkeeping():
    s, res = sched(), Residency()
    r = Retention(s, res)
    handle = {"do_remote_decode": True, "remote_block_ids": [[1, 2, 3]]}
    s._reqs_need_send["d1"] = 99.0  # vLLM's TTL deadline for a retained request
    r.finished(req("d1", {OWNER_KEY: "router-a", TENANT_KEY: "t1"}), True, handle)
    held = res.held["d1"]
    assert (held.blocks, held.owner, held.tenant, held.deadline) == (3, "router-a", "t1", 99.0)
    assert held.ids == (1, 2, 3)  # what an extend's blocks are told apart by
    # What a router's note leaves out of the handle, for its recall after a restart.
    assert held.bulk == {}
    # Per group, as vLLM lists them: what the grant hands the reader.
    assert held.id_lists() == [[1, 2, 3]]
    assert held.gap is None  # the conversation's first turn: no estimate
    for sent, kept in ((12.5, 12.5), (-1, None), ("5", None), (float("nan"), None),
                       (True, None), (1e9, 86_400.0)):
        s._reqs_need_send["g"] = 99.0
        r.finished(req("g", {RETURN_KEY: sent}), True, handle)
        assert res.held["g"].gap == kept, sent
        r.sent(["g"], [])
    r.finished(req("d2", {}), False, handle)  # not delayed: nothing retained
    assert "d2" not in res.held
    # A decode request that came without P's handle is tracked, so it can be freed.
    r.after_alloc(req("d3", {"do_remote_prefill": False, "do_remote_decode": False}))
    assert s._reqs_in_batch == {"d3"}
    assert res.release(["d1"], "router") == 3
    r.expire_pending()
    assert s._reqs_need_send["d1"] == 0.0  # vLLM's expiry path frees it on this step
    r.sent(["d1"], [])
    assert "d1" not in res.held
    r.count()
    assert r.tally.take()[tally.RELEASED] == {"router": 1}
    r.count()
    assert r.tally.take() is None  # only what grew since


def test_a_handle_says_how_many_of_its_blocks_decode_kept_already():
    """A fork's handle on the holder of its parent: the prefix it shares is pinned once
    on decode, and the handle tells the router so (wire.SHARED_BLOCKS_KEY)."""
    s, res = sched(), Residency()
    r = Retention(s, res)
    s._reqs_need_send.update(parent=99.0, fork=99.0, other=99.0)
    parent = {"do_remote_decode": True, "remote_block_ids": [[1, 2, 3, 4]]}
    fork = {"do_remote_decode": True, "remote_block_ids": [[1, 2, 3, 9]]}
    other = {"do_remote_decode": True, "remote_block_ids": [[7, 8]]}
    for rid, out in (("parent", parent), ("fork", fork), ("other", other)):
        r.finished(req(rid, {}), True, out)
    assert [o[SHARED_BLOCKS_KEY] for o in (parent, fork, other)] == [0, 3, 0]
    assert res.kept_blocks() == 7
    not_kept = {"do_remote_decode": True, "remote_block_ids": [[1, 2]]}
    r.finished(req("x", {}), False, not_kept)  # not delayed: no handle, nothing said
    assert SHARED_BLOCKS_KEY not in not_kept


def test_a_step_counts_its_shared_reads_before_it_frees_what_was_read():
    """The shared read's notification and the spending read's in one step: the shared one
    counts first, so the blocks go in that step; a shared read still in flight holds
    them back to a later step."""
    s, res = sched(), Residency(shares=True)
    r = Retention(s, res)
    for rid in ("a", "b"):
        s._reqs_need_send[rid] = 1e12
        r.finished(req(rid, {}), True, {"do_remote_decode": True, "remote_block_ids": [[1]]})
        assert res.share(rid)[0] and res.grant(rid)[0]
    assert r.sent({"a", "b"}, ["a"]) == {"a"} and "a" not in res.held
    assert r.sent(None, []) == set() and "b" in res.held
    assert r.sent(None, ["b"]) == {"b"} and not res.held


def test_retention_is_off_without_bidirectional_transfer():
    s, res = sched(bidirectional=False), Residency()
    r = Retention(s, res)
    s._reqs_need_send["d1"] = 99.0
    r.finished(req("d1", {}), True, {"do_remote_decode": True, "remote_block_ids": [[1]]})
    r.after_alloc(req("d3", {"do_remote_decode": False}))
    assert not res.held and not s._reqs_in_batch


def test_stats_aggregate_with_nixls_and_report_both():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    from bidirkv.connector.nixl import stats
    from bidirkv.connector.nixl.connector import NixlConnector

    worker = NixlKVConnectorStats()
    worker.record_failed_transfer()
    ours = stats.BidirkvStats(data={tally.REUSE: {"match": 2}, tally.REUSED_TOKENS: 96})
    assert not ours.is_empty() and stats.BidirkvStats().is_empty()
    both = stats.of(worker).aggregate(ours)  # the scheduler aggregates in this order
    assert both.data["num_failed_transfers"] == [1]
    assert both.data[tally.REUSE] == {"match": 2} and both.data[tally.REUSED_TOKENS] == 96
    both.aggregate(stats.BidirkvStats(data={tally.REUSE: {"match": 1, "load_failed": 1}}))
    assert both.data[tally.REUSE] == {"match": 3, "load_failed": 1}
    # What the API server rebuilds from the dict it is sent, and logs.
    again = NixlConnector.build_kv_connector_stats(both.to_dict())
    reduced = again.reduce()
    assert reduced["Reused tokens"] == 96 and reduced["Reuse matches"] == 3
    assert reduced["Num failed transfers"] == 1


def test_prometheus_counts_bidirkvs_counters_beside_nixls():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from bidirkv.connector.nixl.connector import NixlConnector

    reg = CollectorRegistry()
    types = {t: functools.partial(t, registry=reg) for t in (Gauge, Counter, Histogram)}
    prom = NixlConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types,
                                            ["model_name", "engine"], {0: ["m", "0"]})
    data = {tally.REUSE: {"match": 2, "load_failed": 1}, tally.REUSED_TOKENS: 96,
            tally.GRANTS: {"granted": 4}}
    prom.observe(data, 0)  # scheduler-side stats alone: no NIXL keys in them
    prom.observe({tally.REUSE: {"match": 1}}, 0)
    labels = {"model_name": "m", "engine": "0"}
    got = reg.get_sample_value
    assert got("vllm:bidirkv_reuse_total", {**labels, "reason": "match"}) == 3
    assert got("vllm:bidirkv_reuse_total", {**labels, "reason": "load_failed"}) == 1
    assert got("vllm:bidirkv_reused_tokens_total", labels) == 96
    assert got("vllm:bidirkv_grants_total", {**labels, "result": "granted"}) == 4
    assert got("vllm:nixl_num_failed_transfers_total", labels) == 0
