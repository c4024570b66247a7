"""Every metric bidir-kv exports follows Prometheus' naming conventions, has bounded labels
and is listed in the README, where platform teams look names up."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest
from prometheus_client import Counter, Gauge, Histogram

from bidirkv.router.metrics import Metrics

README = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
# Label names whose values come from fixed sets in the code, or from the configured
# replicas (url); none takes a request's, tenant's or conversation's value.
BOUNDED_LABELS = {"route", "outcome", "decision", "reason", "source", "stream", "leg",
                  "result", "url", "field", "op", "role", "mode", "cause"}
SNAKE = re.compile(r"^[a-z][a-z0-9_]*[a-z0-9]$")


def router_metrics() -> list[tuple[str, str, tuple[str, ...]]]:
    """(exposed name, type, label names) of every router metric."""
    out = []
    for value in vars(Metrics()).values():
        if isinstance(value, Counter):
            out.append((value._name + "_total", "counter", value._labelnames))
        elif isinstance(value, Gauge):
            out.append((value._name, "gauge", value._labelnames))
        elif isinstance(value, Histogram):
            out.append((value._name, "histogram", value._labelnames))
    return out


def test_router_metric_names_follow_the_conventions():
    metrics = router_metrics()
    assert len(metrics) >= 20
    for name, kind, labels in metrics:
        assert name.startswith("bidirkv_router_") and SNAKE.match(name), name
        if kind == "histogram":
            assert name.endswith("_seconds"), f"{name}: a histogram's unit goes in its name"
        if kind == "gauge":
            assert not name.endswith("_total"), f"{name}: _total is for counters"
        for label in labels:
            assert label in BOUNDED_LABELS, f"{name}: label {label!r} is not a bounded one"


def test_every_router_metric_is_listed_in_the_readme():
    missing = [name for name, _, _ in router_metrics() if f"`{name}`" not in README]
    assert missing == []


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed (`make engine`)")
def test_connector_metrics_follow_the_conventions_and_are_listed():
    from bidirkv.connector.nixl.stats import METRICS

    for _key, name, label, _help in METRICS:
        assert name.startswith("vllm:bidirkv_") and SNAKE.match(name.split(":", 1)[1]), name
        assert label is None or label in BOUNDED_LABELS, (name, label)
        assert f"`{name}_total" in README, name
