"""The PromQL of the chart's dashboard and alerts, and a real parser for it.

For tests: tests/test_chart_monitoring.py checks that every expression parses; a test
against a running stack can check that every metric they name is exported:

    import monitoring
    monitoring.require_parser()               # skips (fails under CI) without the parser
    names = monitoring.metric_names_of_all()  # e.g. {"bidirkv_router_requests_total", ...}

API:
- `dashboard_exprs() -> dict[str, str]`: every PromQL expression of the chart's dashboard
  (panel targets, and the selector of each variable's label_values()), by where it is
  ("Row / Panel / refId"), as written (Grafana variables in it).
- `rule_exprs(values=None) -> dict[str, str]`: alert name -> `expr` of the chart's
  PrometheusRule, rendered by Helm with prometheusRule.enabled and `values` over the
  chart's defaults.
- `parse(exprs) -> list[Parsed]`: per expression, `(ok, metric_names)`: whether the
  Prometheus project's PromQL grammar parses it with no error (nor a type error of the
  kind `rate(foo)`), and the metric names its selectors name (as exposed: `foo_total`,
  `foo_bucket`; a selector with only a `__name__` matcher names none). Grafana variables
  are replaced by valid stand-ins first. `parse_report(exprs)` gives the errors as well.
- `metric_names_of_all() -> set[str]`: the metric names of every dashboard and rule
  expression.
- `parser_missing() -> str | None`, `require_parser()`: why the parser cannot run, and a
  pytest skip for that (a failure when the environment variable CI is set: CI runs the
  tests through `make test`, which installs it).

The parser is @prometheus-io/lezer-promql (npm, pinned in the Makefile, installed into
.cache/promql by `make test`), driven by tools/promql.mjs: one node process per call.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
from collections.abc import Iterable
from typing import Any, NamedTuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "bidir-kv"
DASHBOARD_FILE = CHART / "dashboards" / "bidir-kv.json"
PARSER_DIR = ROOT / ".cache" / "promql"
PARSER_PACKAGE = PARSER_DIR / "node_modules" / "@prometheus-io" / "lezer-promql"
PROMQL_SCRIPT = ROOT / "tools" / "promql.mjs"

# Grafana's interval variables stand where PromQL wants a duration; any other variable
# stands inside a label matcher's string (a namespace, or a regex of them).
DURATION_VARIABLES = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*[A-Za-z_]\w*\s*\)\s*$", re.S)


class Parsed(NamedTuple):
    ok: bool
    metric_names: frozenset[str]


class Report(NamedTuple):
    ok: bool
    metric_names: frozenset[str]
    errors: tuple[str, ...]


def substitute_grafana_variables(expr: str) -> str:
    def stand_in(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return DURATION_VARIABLES.get(name, "stand_in")
    return _VARIABLE.sub(stand_in, expr)


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_FILE.read_text())


def dashboard_exprs() -> dict[str, str]:
    dash = dashboard()
    out: dict[str, str] = {}
    row = ""
    for panel in dash["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            continue
        for target in panel.get("targets", []):
            out[f"{row} / {panel['title']} / {target['refId']}"] = target["expr"]
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = _LABEL_VALUES.match(query)
        # label_values(selector, label) is Grafana's, not PromQL: its selector is.
        out[f"variable {var['name']}"] = m.group(1) if m else query
    return out


def render_chart(values: dict[str, Any]) -> list[dict[str, Any]]:
    from test_chart import render  # imported here: the e2e suites use this module too

    return render(values)[0]


def prometheus_rule(values: dict[str, Any] | None = None) -> dict[str, Any]:
    values = dict(values or {})
    values["prometheusRule"] = {**values.get("prometheusRule", {}), "enabled": True}
    (rule,) = [d for d in render_chart(values) if d["kind"] == "PrometheusRule"]
    return rule


def rule_exprs(values: dict[str, Any] | None = None) -> dict[str, str]:
    rule = prometheus_rule(values)
    return {r["alert"]: r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]}


def parser_missing() -> str | None:
    if shutil.which("node") is None:
        return "node is not installed (Node.js 20 runs tools/promql.mjs)"
    if not PARSER_PACKAGE.is_dir():
        return (f"the PromQL parser is not installed in {PARSER_DIR.relative_to(ROOT)}: "
                "run `make test` (or `make .cache/promql/.installed-<version>`)")
    return None


def require_parser() -> None:
    why = parser_missing()
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI is set and {why}")
    pytest.skip(why)


def parse_report(exprs: Iterable[str]) -> list[Report]:
    exprs = [substitute_grafana_variables(e) for e in exprs]
    why = parser_missing()
    if why is not None:
        raise RuntimeError(why)
    done = subprocess.run(["node", str(PROMQL_SCRIPT), str(PARSER_DIR)],
                          input=json.dumps(exprs), capture_output=True, text=True,
                          timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"tools/promql.mjs failed ({done.returncode}): {done.stderr}")
    results = json.loads(done.stdout)
    assert len(results) == len(exprs)
    return [Report(r["ok"], frozenset(r["metrics"]), tuple(r["errors"])) for r in results]


def parse(exprs: Iterable[str]) -> list[Parsed]:
    return [Parsed(r.ok, r.metric_names) for r in parse_report(exprs)]


def metric_names_of_all() -> set[str]:
    exprs = [*dashboard_exprs().values(), *rule_exprs().values()]
    return {name for parsed in parse(exprs) for name in parsed.metric_names}
