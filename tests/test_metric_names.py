"""Every metric bidir-kv exports follows Prometheus' naming conventions, has bounded labels
and is listed in docs/observability.md, where platform teams look names up."""

from __future__ import annotations

import ast
import pathlib
import re

from prometheus_client import Counter, Gauge, Histogram

from bidirkv.router.metrics import Metrics

ROOT = pathlib.Path(__file__).parent.parent
LISTED = (ROOT / "docs" / "observability.md").read_text()
STATS = ROOT / "bidirkv" / "connector" / "nixl" / "stats.py"
# Label names whose values come from fixed sets in the code, or from the configured
# replicas (url); none takes a request's, tenant's or conversation's value.
BOUNDED_LABELS = {"route", "outcome", "decision", "reason", "source", "stream", "leg",
                  "result", "url", "field", "op", "role", "mode", "cause", "kind"}
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


def test_every_router_metric_is_listed_in_the_docs():
    missing = [name for name, _, _ in router_metrics() if f"`{name}`" not in LISTED]
    assert missing == []


def connector_metrics() -> list[tuple[str, str | None]]:
    """(name, label) of the connector's METRICS table, read from its source: the module
    imports vLLM, which takes seconds to load."""
    tree = ast.parse(STATS.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["METRICS"]:
            return [(row.elts[1].value, row.elts[2].value) for row in node.value.elts]
    raise AssertionError(f"no METRICS table in {STATS}")


def test_connector_metrics_follow_the_conventions_and_are_listed():
    metrics = connector_metrics()
    assert len(metrics) >= 7
    for name, label in metrics:
        assert name.startswith("vllm:bidirkv_") and SNAKE.match(name.split(":", 1)[1]), name
        assert label is None or label in BOUNDED_LABELS, (name, label)
        assert f"`{name}_total" in LISTED, name


def connector_gauges() -> list[str]:
    """The gauges the connector exports beside its counters (core/workingset.py)."""
    from bidirkv.connector.core import workingset

    return [v for k, v in vars(workingset).items() if k.endswith("_METRIC")]


def test_connector_gauges_follow_the_conventions_and_are_listed():
    gauges = connector_gauges()
    assert "vllm:bidirkv_retained_requests" in gauges and len(gauges) >= 2
    for name in gauges:
        assert name.startswith("vllm:bidirkv_") and SNAKE.match(name.split(":", 1)[1]), name
        assert not name.endswith("_total"), f"{name}: _total is for counters"
        assert f"`{name}` (gauge)" in LISTED, name
