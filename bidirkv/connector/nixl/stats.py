"""bidir-kv's counters in vLLM's connector stats and Prometheus metrics.

vLLM gathers a connector's stats from its workers (NIXL's transfer times and bytes) and
from its scheduler-side connector (here: reuse outcomes, dropped handles, releases,
grants; hooks/tally.py), sends them to the API server as one dict, and there logs them
and feeds `build_prom_metrics`' object. The stats class is NIXL's with bidir-kv's keys
beside NIXL's, so either side's stats aggregate with the other's.

Prometheus: the counters in `METRICS` (each with vLLM's `model_name` and `engine`
labels, and `_total` added by the client library); labels are bounded (hooks/tally.py).
Two gauges beside them, each the latest reading (core/workingset.py): the KV working set,
and the requests retained for a later turn.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)

from bidirkv.connector.core import workingset
from bidirkv.connector.hooks import tally

# (data key, metric name, label or None, help)
METRICS = (
    (tally.REUSE, "vllm:bidirkv_reuse", "reason",
     "Prefill requests offered a decode handle, by reuse outcome."),
    (tally.REUSED_TOKENS, "vllm:bidirkv_reused_tokens", None,
     "Prompt tokens read from decode's retained KV instead of computed."),
    (tally.RECOMPUTED_TOKENS, "vllm:bidirkv_recomputed_tokens", None,
     "Offered prompt tokens that prefill computed after all."),
    (tally.DROPPED, "vllm:bidirkv_handles_dropped", "reason",
     "KV handles refused at admission, by reason."),
    (tally.UNPROVEN, "vllm:bidirkv_unproven_requests", None,
     "Requests whose KV was not kept for reuse: they carried no router proof."),
    (tally.RELEASED, "vllm:bidirkv_released_requests", "cause",
     "Retained decode requests released before their TTL, by cause."),
    (tally.GRANTS, "vllm:bidirkv_grants", "result",
     "Read grants answered by decode: granted, or the reason refused."),
)

RETAINED_HELP = ("Requests retained for a later turn that no read or release acts on yet: "
                 "one per conversation whose next turn has not come back. What a draining "
                 "decode still holds.")
# The gauges, by stats key: a later reading replaces an earlier one.
GAUGES = (workingset.WORKING_SET, workingset.RETAINED)
WORKING_SET_HELP = ("Share of the KV blocks in use by live work: vLLM's KV usage less the "
                    "blocks retained for a later turn (given up to new work or freed once "
                    "read). What decode autoscales on.")

# NIXL's own keys, each a list of observations (read once: building stats happens on
# every engine step).
NIXL_KEYS = tuple(NixlKVConnectorStats().data)


def _with_nixl_keys(data: dict[str, Any]) -> dict[str, Any]:
    for k in NIXL_KEYS:
        data.setdefault(k, [])
    return data


class BidirkvStats(NixlKVConnectorStats):
    """NIXL's transfer stats and bidir-kv's counters in one container."""

    def __post_init__(self):
        if not self.data:
            self.reset()
            return
        _with_nixl_keys(self.data)
        tally.merge(self.data, {})  # bidir-kv's keys, zero where missing

    def reset(self):
        super().reset()
        self.data.update(tally.empty())
        for key in GAUGES:
            self.data.pop(key, None)

    def is_empty(self) -> bool:
        return (super().is_empty() and tally.is_empty(self.data)
                and not any(key in self.data for key in GAUGES))

    def aggregate(self, other):
        if other.is_empty():
            return self
        for k in NIXL_KEYS:
            self.data.setdefault(k, []).extend(other.data.get(k) or [])
        tally.merge(self.data, other.data)
        for key in GAUGES:
            if (value := other.data.get(key)) is not None:
                self.data[key] = value
        return self

    def reduce(self) -> dict[str, int | float]:
        out = super().reduce()
        d = self.data
        out["Reused tokens"] = d.get(tally.REUSED_TOKENS, 0)
        out["Reuse matches"] = (d.get(tally.REUSE) or {}).get("match", 0)
        out["Handles dropped"] = sum((d.get(tally.DROPPED) or {}).values())
        out["Retained released early"] = sum((d.get(tally.RELEASED) or {}).values())
        if (share := d.get(workingset.WORKING_SET)) is not None:
            out["KV working set"] = round(share, 4)
        if (n := d.get(workingset.RETAINED)) is not None:
            out["Retained requests"] = n
        return out


def of(stats: Any) -> BidirkvStats | None:
    """A worker's NIXL stats as bidir-kv's (None stays None)."""
    return None if stats is None else BidirkvStats(data=dict(stats.data))


class BidirkvPromMetrics(NixlPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._bidirkv: dict[str, tuple[Any, bool]] = {}
        for key, name, label, doc in METRICS:
            names = [*labelnames, label] if label else labelnames
            self._bidirkv[key] = (self._counter_cls(name=name, documentation=doc,
                                                    labelnames=names), label is not None)
        self._working_set = self._gauge_cls(
            name=workingset.KV_WORKING_SET_METRIC, documentation=WORKING_SET_HELP,
            multiprocess_mode="mostrecent", labelnames=labelnames)
        self._retained = self._gauge_cls(
            name=workingset.RETAINED_REQUESTS_METRIC, documentation=RETAINED_HELP,
            multiprocess_mode="mostrecent", labelnames=labelnames)
        # Present from the start: an engine that never retained anything reports 0, not
        # nothing (its first stats come with its first step).
        for values in per_engine_labelvalues.values():
            self._retained.labels(*values).set(0)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        data = _with_nixl_keys(dict(transfer_stats_data))
        super().observe(data, engine_idx)
        values = self.per_engine_labelvalues[engine_idx]
        for key, (counter, labelled) in self._bidirkv.items():
            got = data.get(key)
            if labelled:
                for label, n in (got or {}).items():
                    if n:
                        counter.labels(*values, str(label)).inc(n)
            elif got:
                counter.labels(*values).inc(got)
        if (share := data.get(workingset.WORKING_SET)) is not None:
            self._working_set.labels(*values).set(share)
        if (n := data.get(workingset.RETAINED)) is not None:
            self._retained.labels(*values).set(n)
