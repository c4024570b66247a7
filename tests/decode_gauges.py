"""What the tests of decode's gauges (the KV working set, the count of retained requests)
start from: a residency retaining requests, and the connector's Prometheus metrics on a
registry of their own."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest

from bidirkv.connector.core.residency import Residency

ROUTER = "r"
DEADLINE = 1000.0  # far past the stopped clock: nothing expires during a test
MODEL = "m"


def retain(res: Residency, **blocks: int) -> Residency:
    """`res` retaining, besides what it held, a request of `blocks[rid]` blocks for each
    id, for ROUTER until DEADLINE."""
    for rid, n in blocks.items():
        res.retain(rid, n, ROUTER, deadline=DEADLINE)
    return res


def residency(**blocks: int) -> Residency:
    """A residency on a clock stopped at 0, retaining `blocks` as `retain` does."""
    return retain(Residency(clock=lambda: 0.0), **blocks)


def on_engine(engine: int) -> dict[str, str]:
    """The labels of engine `engine`'s samples in `engine_metrics`' registry."""
    return {"model_name": MODEL, "engine": str(engine)}


def engine_metrics() -> tuple[Any, Any]:
    """The connector's Prometheus metrics for engines 0 and 1 of MODEL, as vLLM builds
    them, on a registry of their own: (the registry, what stats are observed into).
    Skips the test where vLLM is not installed."""
    pytest.importorskip("vllm")
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from bidirkv.connector.nixl.connector import NixlConnector

    reg = CollectorRegistry()
    types = {t: functools.partial(t, registry=reg) for t in (Gauge, Counter, Histogram)}
    prom = NixlConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types,
                                            ["model_name", "engine"],
                                            {i: list(on_engine(i).values()) for i in (0, 1)})
    return reg, prom
