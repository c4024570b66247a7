"""The chart's Grafana dashboard (charts/bidir-kv/dashboards/bidir-kv.json), written from the
rows and panels below.

A development tool (`make monitoring` runs it), not part of the package. The JSON is
generated so that a panel is a few lines here, not a hundred in a file nobody can review;
tests/test_chart_monitoring.py fails when the committed JSON is not what this writes (a
change of the alerts' default thresholds in values.yaml included: two panels draw them).

Every query filters on the `namespace` variable. Engine panels split by `role`, the label
the chart's PodMonitor (and the operator's, spec.monitoring.podMonitor) copies from the
pod's app.kubernetes.io/component; router panels by the labels the router exports.
"""

from __future__ import annotations

import json
import pathlib
import sys
from dataclasses import dataclass, field
from typing import Any

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
DASHBOARD_FILE = ROOT / "charts" / "bidir-kv" / "dashboards" / "bidir-kv.json"
# Panels that an alert watches draw its default threshold.
_ALERTS = yaml.safe_load((ROOT / "charts" / "bidir-kv" / "values.yaml").read_text())[
    "prometheusRule"]["alerts"]
REUSE_THRESHOLD = _ALERTS["reuseHitRatioLow"]["threshold"]
PINNED_THRESHOLD = _ALERTS["decodePinnedNearCapacity"]["threshold"]

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
NS = 'namespace=~"$namespace"'
RATE = "$__rate_interval"

# Outcome sets of bidirkv_router_reuse_total and bidirkv_router_requests_total
# (bidirkv/router/metrics.py); the chart's alerts use the same ones.
# Turns that reached prefill, bidirectional on: "off" and "extended" (no prefill leg) are
# left out.
REACHED_PREFILL = ("hit", "miss", "expired", "verified-partial", "dropped")
# Of those, the ones where prefill read decode's KV (all of it, or the verified part).
REUSED = ("hit", "verified-partial")
# The router's or the engines' fault, not the client's (client_error,
# upstream_client_error) nor its choice (cancelled).
SERVER_ERRORS = ("unavailable", "upstream_error", "timeout", "stream_error")
# The fields of bidirkv_router_decode_residency that count blocks.
RESIDENCY_BLOCK_FIELDS = ("retained_blocks", "granted_blocks", "free_blocks")


def regex(values: tuple[str, ...]) -> str:
    return "|".join(values)


def sel(metric: str, *matchers: str) -> str:
    return f"{metric}{{{', '.join([NS, *matchers])}}}"


def rate(metric: str, *matchers: str) -> str:
    return f"rate({sel(metric, *matchers)}[{RATE}])"


def by(labels: str) -> str:
    return f" by ({labels})" if labels else ""


def sum_rate(metric: str, labels: str = "", *matchers: str) -> str:
    return f"sum{by(labels)} ({rate(metric, *matchers)})"


def quantile(q: float, histogram: str, labels: str, *matchers: str) -> str:
    grouping = ", ".join(["le", *([labels] if labels else [])])
    return f"histogram_quantile({q}, {sum_rate(histogram + '_bucket', grouping, *matchers)})"


def ratio(numerator: str, denominator: str) -> str:
    return f"{numerator}\n/\n{denominator}"


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[Target, ...]
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 8
    height: int = 8
    stack: bool = False
    max: float | None = None
    # (value, color) steps above the base color; drawn as dashed lines on a timeseries.
    thresholds: tuple[tuple[float, str], ...] = ()
    base_color: str = "green"
    # Stat panels: value -> (text, color).
    mappings: tuple[tuple[int, str, str], ...] = ()
    text_mode: str = "auto"


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


def ts(title: str, description: str, *targets: Target, **kw: Any) -> Panel:
    return Panel(title, description, targets, **kw)


def stat(title: str, description: str, *targets: Target, **kw: Any) -> Panel:
    return Panel(title, description, targets, kind="stat", width=3, height=4, **kw)


def p50_p99(histogram: str, labels: str, legend: str, *matchers: str) -> tuple[Target, ...]:
    return tuple(Target(quantile(q, histogram, labels, *matchers), f"{legend} {name}")
                 for q, name in ((0.5, "p50"), (0.99, "p99")))


REUSED_RATE = sum_rate("bidirkv_router_reuse_total", "", f'outcome=~"{regex(REUSED)}"')
REACHED_RATE = sum_rate("bidirkv_router_reuse_total", "", f'outcome=~"{regex(REACHED_PREFILL)}"')
PINNED = "max by (url) ({})".format(sel("bidirkv_router_decode_pinned_blocks"))
CAPACITY = "max by (url) ({})".format(sel("bidirkv_router_decode_kv_blocks"))

ROWS = (
    Row("Overview", (
        stat("Requests", "Client requests per second, every router of the namespaces.",
             Target(sum_rate("bidirkv_router_requests_total"), "requests"), unit="reqps"),
        stat("Server errors", "Share of requests that ended unavailable, upstream_error, "
             "timeout or stream_error (not the client's doing).",
             Target(ratio(sum_rate("bidirkv_router_requests_total", "",
                                   f'outcome=~"{regex(SERVER_ERRORS)}"'),
                          sum_rate("bidirkv_router_requests_total")), "errors"),
             unit="percentunit", thresholds=((0.01, "orange"), (0.05, "red"))),
        stat("Reuse hit ratio", "Of the turns that reached prefill with bidirectional on, the "
             "share where prefill read decode's KV (hit or verified-partial).",
             Target(ratio(REUSED_RATE, REACHED_RATE), "hit ratio"), unit="percentunit"),
        stat("TTFT p99", "Router: request arrival to the first byte written to the client.",
             Target(quantile(0.99, "bidirkv_router_ttft_seconds", ""), "p99"), unit="s"),
        stat("Decode replicas healthy", "Decode replicas some router finds healthy, of those "
             "the routers know.",
             Target("sum(max by (namespace, url) ({}))".format(
                 sel("bidirkv_router_backend_healthy", 'role="decode"')), "healthy"),
             Target("count(max by (namespace, url) ({}))".format(
                 sel("bidirkv_router_backend_healthy", 'role="decode"')), "known"),
             text_mode="value_and_name"),
        stat("Prefill-only mode", "ON while a router serves requests on prefill alone: no "
             "decode replica is healthy (router.prefillOnlyFallback).",
             Target("max({})".format(sel("bidirkv_router_prefill_only_mode")), "mode"),
             mappings=((0, "off", "green"), (1, "ON", "red"))),
        stat("Handle store", "down while a router's handle store does not answer: turns are "
             "served without reuse.",
             Target("min({})".format(sel("bidirkv_router_handle_store_up")), "store"),
             mappings=((0, "down", "red"), (1, "up", "green"))),
        stat("Handle store mode", "memory: in the router process (one replica); redis: a "
             "shared store (router.handleStore).",
             Target("max by (mode) ({})".format(sel("bidirkv_router_handle_store_info")),
                    "{{mode}}"),
             text_mode="name"),
    )),
    Row("TTFT", (
        ts("Router TTFT by route", "Request arrival at the router to the first byte written "
           "to the client: what a client sees.",
           *p50_p99("bidirkv_router_ttft_seconds", "route", "{{route}}"), unit="s", width=12),
        ts("Upstream legs by leg", "Duration of each successful upstream leg: prefill (the "
           "prompt on P, a reuse turn's read of decode's KV included), decode (to its end), "
           "extend (a turn run whole on decode), prefill_only.",
           *p50_p99("bidirkv_router_leg_duration_seconds", "leg", "{{leg}}", 'result="ok"'),
           unit="s", width=12),
        ts("Engine TTFT by role", "vLLM's own time to first token. Prefill: the prompt's "
           "compute (one token); decode: until its first token, pulling the KV included.",
           *p50_p99("vllm:time_to_first_token_seconds", "role", "{{role}}"), unit="s",
           width=12),
        ts("Failed upstream legs by leg", "Legs that failed; the router retries some of them "
           "(Router row, retries).",
           Target(sum_rate("bidirkv_router_leg_duration_seconds_count", "leg",
                           'result="error"'), "{{leg}}"), unit="ops", width=12),
    )),
    Row("Reuse", (
        ts("Reuse outcomes", "Per turn: hit (prefill took decode's handle), miss (none "
           "stored: a conversation's first turn), expired (stored past its TTL), "
           "verified-partial (prefill reused the verified part), dropped (prefill failed "
           "with the handle; retried without), off (bidirectional off), extended (run on "
           "the decode replica holding it).",
           Target(sum_rate("bidirkv_router_reuse_total", "outcome"), "{{outcome}}"),
           unit="ops", stack=True),
        ts("Reuse hit ratio", "hit and verified-partial among the turns that reached "
           "prefill with bidirectional on. The line: the default threshold of "
           "BidirKVReuseHitRatioLow (which judges it over 15m).",
           Target(ratio(
               sum_rate("bidirkv_router_reuse_total", "namespace",
                        f'outcome=~"{regex(REUSED)}"'),
               sum_rate("bidirkv_router_reuse_total", "namespace",
                        f'outcome=~"{regex(REACHED_PREFILL)}"')), "{{namespace}}"),
           unit="percentunit", max=1, thresholds=((REUSE_THRESHOLD, "green"),),
           base_color="red"),
        ts("Prompt tokens reused vs recomputed (prefill)", "Prefill engines: prompt tokens "
           "read from decode's retained KV, and offered tokens computed after all.",
           Target("sum ({})".format(rate("vllm:bidirkv_reused_tokens_total")), "reused"),
           Target("sum ({})".format(rate("vllm:bidirkv_recomputed_tokens_total")),
                  "recomputed"), unit="short"),
        ts("Tokens offered vs reused (router)", "Offered: the token counts of handles sent "
           "to prefill (an upper bound of reuse). Reused: what prefill reports, by source "
           "(bidirkv: its reuse report; usage_cached: usage's cached tokens, prefill's own "
           "prefix cache included).",
           Target(sum_rate("bidirkv_router_reuse_tokens_offered_total"), "offered"),
           Target(sum_rate("bidirkv_router_reuse_tokens_total", "source"),
                  "reused ({{source}})"), unit="short"),
        ts("Prefill reuse by reason", "Prefill requests that were offered a handle: match "
           "(read from decode); any other reason says why prefill computed instead.",
           Target(sum_rate("vllm:bidirkv_reuse_total", "reason"), "{{reason}}"),
           unit="ops", stack=True),
        ts("Placement decisions", "Where each turn ran (router.placement): extend, "
           "decode, read_back, move or prefill, and why.",
           Target(sum_rate("bidirkv_router_placements_total", "decision, reason"),
                  "{{decision}}: {{reason}}"), unit="ops", stack=True),
    )),
    Row("Decode residency", (
        ts("Pinned blocks vs capacity", "Per decode replica: the KV blocks the routers' "
           "handles pin there, and the replica's KV blocks.",
           Target(PINNED, "pinned {{url}}"), Target(CAPACITY, "capacity {{url}}"),
           unit="short", width=12),
        ts("Pinned share of each decode replica", "Pinned blocks over the replica's KV "
           "blocks; the routers keep it under kvTransfer.retentionWatermark. The line: "
           "BidirKVDecodePinnedNearCapacity's default threshold.",
           Target(ratio(PINNED, CAPACITY), "{{url}}"), unit="percentunit", max=1,
           width=12, thresholds=((PINNED_THRESHOLD, "red"),)),
        ts("Decode's residency report", "What each decode replica reports on "
           "/bidirkv/residency: blocks retained for reuse, granted to a reader, free.",
           Target("max by (url, field) ({})".format(
               sel("bidirkv_router_decode_residency",
                   f'field=~"{regex(RESIDENCY_BLOCK_FIELDS)}"')), "{{field}} {{url}}"),
           unit="short"),
        ts("Retained requests released by cause", "Decode engines: retained requests "
           "released before their TTL (router: the router asked; owner_gone: a router's "
           "lease lapsed; pressure: new work needed the blocks; watermark).",
           Target(sum_rate("vllm:bidirkv_released_requests_total", "cause"), "{{cause}}"),
           unit="ops", stack=True),
        ts("Read grants by result", "Decode engines: prefill's requests to read retained "
           "blocks, granted or the reason refused.",
           Target(sum_rate("vllm:bidirkv_grants_total", "result"), "{{result}}"),
           unit="ops", stack=True),
        ts("Lease renewals and releases", "Router calls to decode's /bidirkv/residency "
           "(lease renewals every health round, and releases) by result, and the request "
           "ids sent for release.",
           Target(sum_rate("bidirkv_router_residency_calls_total", "result"),
                  "calls {{result}}"),
           Target(sum_rate("bidirkv_router_releases_sent_total", "result"),
                  "released ids {{result}}"), unit="ops"),
        ts("Handles stored", "Conversation handles the routers hold (a shared store: one "
           "count for all its routers).",
           Target("max by (namespace, service) ({})".format(sel("bidirkv_router_handles")),
                  "{{namespace}} {{service}}"), unit="short"),
        ts("Handle evictions by reason", "Handles removed before use (lru, replaced, ttl, "
           "watermark, tenant_cap, ...): each frees decode's blocks.",
           Target(sum_rate("bidirkv_router_handle_evictions_total", "reason"), "{{reason}}"),
           unit="ops", stack=True),
        ts("Handles dropped at admission", "Engines: handles refused when a request arrived "
           "with one (unauthenticated, replayed, expired, malformed, wire_version): served "
           "without reuse.",
           Target(sum_rate("vllm:bidirkv_handles_dropped_total", "role, reason"),
                  "{{role}} {{reason}}"), unit="ops", stack=True),
    )),
    Row("Transfers", (
        ts("NIXL transfer time", "Duration of a KV transfer (the reader's side: decode "
           "pulling from prefill, prefill reading decode's retained KV).",
           *p50_p99("vllm:nixl_xfer_time_seconds", "role", "{{role}}"), unit="s"),
        ts("NIXL post time", "Time to post a transfer to NIXL.",
           *p50_p99("vllm:nixl_post_time_seconds", "role", "{{role}}"), unit="s"),
        ts("Transfers", "KV transfers completed per second, by the reader's role.",
           Target(sum_rate("vllm:nixl_xfer_time_seconds_count", "role"), "{{role}}"),
           unit="ops"),
        ts("Bytes transferred", "KV bytes moved per second, by the reader's role.",
           Target(sum_rate("vllm:nixl_bytes_transferred_sum", "role"), "{{role}}"),
           unit="Bps"),
        ts("Mean transfer size", "Bytes per KV transfer.",
           Target(ratio(sum_rate("vllm:nixl_bytes_transferred_sum", "role"),
                        sum_rate("vllm:nixl_bytes_transferred_count", "role")), "{{role}}"),
           unit="bytes"),
        ts("Failed transfers and expired KV", "NIXL transfers that failed (handshakes and "
           "notifications included), and requests whose KV expired on prefill before decode "
           "read it.",
           Target(sum_rate("vllm:nixl_num_failed_transfers_total", "role, pod"),
                  "failed {{role}} {{pod}}"),
           Target(sum_rate("vllm:nixl_num_kv_expired_reqs_total", "role, pod"),
                  "expired {{role}} {{pod}}"), unit="ops"),
    )),
    Row("Engines", (
        ts("Requests running", "Requests in the engine's batches.",
           Target("sum by (role, pod) ({})".format(sel("vllm:num_requests_running")),
                  "{{role}} {{pod}}"), unit="short"),
        ts("Requests waiting", "Requests queued in the engine: on decode, retained KV is "
           "released before new work waits for blocks.",
           Target("sum by (role, pod) ({})".format(sel("vllm:num_requests_waiting")),
                  "{{role}} {{pod}}"), unit="short"),
        ts("KV cache usage", "Share of the engine's KV blocks in use (retained blocks "
           "included on decode).",
           Target("max by (role, pod) ({})".format(sel("vllm:kv_cache_usage_perc")),
                  "{{role}} {{pod}}"), unit="percentunit", max=1),
        ts("Prefix cache hit ratio", "Engines' own prefix cache: cached tokens over queried "
           "tokens.",
           Target(ratio(sum_rate("vllm:prefix_cache_hits_total", "role"),
                        sum_rate("vllm:prefix_cache_queries_total", "role")), "{{role}}"),
           unit="percentunit", max=1, width=12),
        ts("Tokens per second", "Prompt tokens processed and tokens generated.",
           Target(sum_rate("vllm:prompt_tokens_total", "role"), "prompt {{role}}"),
           Target(sum_rate("vllm:generation_tokens_total", "role"), "generated {{role}}"),
           unit="short", width=12),
    )),
    Row("Router", (
        ts("Requests by outcome", "Client requests by outcome.",
           Target(sum_rate("bidirkv_router_requests_total", "outcome"), "{{outcome}}"),
           unit="reqps", stack=True),
        ts("Errors by route and outcome", "Requests that did not end ok: client_error and "
           "upstream_client_error are the client's, cancelled its choice; the rest are "
           "server errors.",
           Target(sum_rate("bidirkv_router_requests_total", "route, outcome",
                           'outcome!="ok"'), "{{route}} {{outcome}}"),
           unit="reqps", stack=True),
        ts("Retries by reason", "Upstream retries (prefill_reuse_failed, prefill_failed, "
           "prefill_stale_connection, decode_before_first_byte, prefill_only_failed, "
           "extend_failed).",
           Target(sum_rate("bidirkv_router_retries_total", "reason"), "{{reason}}"),
           unit="ops", stack=True),
        ts("Handle store up", "1 while a router's handle store answers (always 1 for "
           "the in-process store).",
           Target("min by (pod) ({})".format(sel("bidirkv_router_handle_store_up")),
                  "{{pod}}"), unit="short", max=1),
        ts("Handle store errors by operation", "Shared store calls that failed: those turns "
           "were served without reuse.",
           Target(sum_rate("bidirkv_router_handle_store_errors_total", "op"), "{{op}}"),
           unit="ops", stack=True),
        ts("Config reloads", "router.json reloads by result: a failed one keeps the "
           "running config.",
           Target(sum_rate("bidirkv_router_config_reloads_total", "result"), "{{result}}"),
           unit="ops"),
        ts("Prefill-only mode", "1 while a router serves on prefill alone (no healthy "
           "decode replica).",
           Target("max by (pod) ({})".format(sel("bidirkv_router_prefill_only_mode")),
                  "{{pod}}"), unit="short", max=1, width=12),
        ts("Requests served by prefill alone", "By route, while in prefill-only mode.",
           Target(sum_rate("bidirkv_router_prefill_only_total", "route"), "{{route}}"),
           unit="reqps", width=12),
        ts("Backend health", "1 when the router finds the backend usable (active health "
           "checks and failures seen on requests).",
           Target("min by (role, url) ({})".format(sel("bidirkv_router_backend_healthy")),
                  "{{role}} {{url}}"), unit="short", max=1, width=12),
        ts("Legs in flight per backend", "Upstream legs the routers have in flight on each "
           "backend.",
           Target("sum by (role, url) ({})".format(sel("bidirkv_router_backend_outstanding")),
                  "{{role}} {{url}}"), unit="short", width=12),
    )),
)

# The namespace variable lists the namespaces some router exports from.
NAMESPACE_QUERY = "label_values(bidirkv_router_requests_total, namespace)"


def _field_config(p: Panel) -> dict[str, Any]:
    steps = [{"color": p.base_color, "value": None},
             *({"color": color, "value": value} for value, color in p.thresholds)]
    defaults: dict[str, Any] = {
        "unit": p.unit,
        "min": 0,
        "thresholds": {"mode": "absolute", "steps": steps},
        "color": {"mode": "thresholds" if p.kind == "stat" else "palette-classic"},
        "mappings": [{"type": "value", "options": {
            str(value): {"text": text, "color": color, "index": i}}}
            for i, (value, text, color) in enumerate(p.mappings)],
    }
    if p.max is not None:
        defaults["max"] = p.max
    if p.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 20 if p.stack else 10,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if p.stack else "none", "group": "A"},
            "thresholdsStyle": {"mode": "dashed" if p.thresholds else "off"},
        }
    return {"defaults": defaults, "overrides": []}


def _options(p: Panel) -> dict[str, Any]:
    if p.kind == "stat":
        return {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "none" if p.mappings or p.text_mode == "name" else "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": p.text_mode,
        }
    return {
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }


def _panel(p: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "fieldConfig": _field_config(p),
        "options": _options(p),
        "targets": [{"datasource": DATASOURCE, "expr": t.expr, "legendFormat": t.legend,
                     "range": True, "refId": chr(ord("A") + i)}
                    for i, t in enumerate(p.targets)],
    }


def _panels() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    y = 0
    for row in ROWS:
        out.append({"id": len(out) + 1, "type": "row", "title": row.title, "collapsed": False,
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        y += 1
        x = height = 0
        for p in row.panels:
            if x + p.width > 24:
                x, y, height = 0, y + height, 0
            out.append(_panel(p, len(out) + 1, x, y))
            x, height = x + p.width, max(height, p.height)
        y += height
    return out


def dashboard() -> dict[str, Any]:
    return {
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard"}]},
        "description": "bidir-kv: disaggregated prefill/decode vLLM with bidirectional KV "
                       "transfer; routers, engines, reuse, decode residency and NIXL "
                       "transfers.",
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [],
        "panels": _panels(),
        "refresh": "30s",
        "schemaVersion": 39,
        "tags": ["bidir-kv", "vllm"],
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0, "includeAll": False,
             "multi": False, "options": [], "refresh": 1, "regex": ""},
            {"name": "namespace", "label": "Namespace", "type": "query",
             "datasource": DATASOURCE, "definition": NAMESPACE_QUERY,
             "query": NAMESPACE_QUERY,
             "current": {}, "hide": 0, "includeAll": True, "allValue": ".*", "multi": True,
             "options": [], "refresh": 2, "regex": "", "sort": 1},
        ]},
        "time": {"from": "now-3h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": "bidir-kv",
        "uid": "bidir-kv",
        "version": 1,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    path = pathlib.Path(argv[0]) if argv else DASHBOARD_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
