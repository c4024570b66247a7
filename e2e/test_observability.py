"""What a platform team reads, against the real stack: every metric the chart's dashboard
and alerts name is exported by the router or the vLLM servers, and a request's trace id
reaches both engines (vLLM's own exporter) through the router. The stack is the one
e2e/test_connector.py drives (`traced`, e2e/conftest.py): one start for both."""

from __future__ import annotations

import importlib.util
import json
import secrets
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    pytest.skip("the vLLM CPU engine stack is not installed (make engine)",
                allow_module_level=True)

from bidirkv.local.model import random_text  # noqa: E402

from .vllm_stack import (  # noqa: E402
    REQUEST_TIMEOUT,
    chat,
    running_router,
    stream_text,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(420)]
ROUTER, PREFILL, DECODE = "bidir-kv-router", "bidir-kv-prefill", "bidir-kv-decode"
# Every panel's metric exists once a conversation has been extended on decode and read back.
PLACEMENT = {"policy": "thresholds", "localPrefillTokens": 64, "maxLocalPrefillTokens": 2048}


def send(url: str, body: dict, traceparent: str | None = None) -> str:
    headers = {"Content-Type": "application/json"}
    if traceparent:
        headers["traceparent"] = traceparent
    req = urllib.request.Request(url + "/v1/chat/completions",
                                 json.dumps({**body, "stream": True}).encode(), headers)
    events = []
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                events.append(json.loads(line[5:]))
    return stream_text(events)


def exported(url: str) -> set[str]:
    """Metric names a scrape declares, in every form a query may name them by."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names |= {s.name for s in family.samples}
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
    return names


def conversation(url: str, seed: int) -> None:
    """A first turn, a short append (extended on decode) and a long one (read back)."""
    conv = {"conversation_id": f"conv-{seed}"}
    msgs = [{"role": "user", "content": random_text(300, seed=seed)}]
    for words in (8, 200):
        reply = send(url, {**chat(msgs), **conv})
        msgs += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": random_text(words, seed=seed + words)}]
    send(url, {**chat(msgs), **conv})


def traced_turn(url: str, seed: int) -> tuple[str, str]:
    """A first turn sent with a client's sampled traceparent: (trace id, its parent id)."""
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    body = {**chat([{"role": "user", "content": random_text(200, seed=seed)}]),
            "conversation_id": f"conv-{seed}"}
    send(url, body, f"00-{trace_id}-{parent}-01")
    return trace_id, parent


def test_every_metric_the_dashboard_and_alerts_name_is_exported(traced):
    from monitoring import metric_names_of_all

    stack, _ = traced
    with running_router(stack, "router-metrics", placement=PLACEMENT) as (url, _):
        conversation(url, seed=81)
        names = exported(url) | exported(stack.p_url) | exported(stack.d_url)
    wanted = metric_names_of_all()
    assert len(wanted) >= 25, sorted(wanted)
    assert sorted(wanted - names) == []


def test_a_clients_trace_reaches_both_engines_through_the_router(traced):
    stack, receiver = traced
    with running_router(stack, "router-traces") as (url, _):
        trace_id, parent = traced_turn(url, seed=91)
        engines = receiver.wait_for(trace_id, {PREFILL, DECODE})
    spans = receiver.wait_for(trace_id, {ROUTER, PREFILL, DECODE})  # flushed at the stop
    by_service = {svc: [s for s in spans if s.service == svc] for svc in (ROUTER, PREFILL,
                                                                           DECODE)}
    assert all(by_service.values()), [(s.service, s.name) for s in spans]
    router_ids = {s.span_id for s in by_service[ROUTER]}
    (root,) = [s for s in by_service[ROUTER] if s.parent_span_id == parent]
    assert root.span_id in router_ids
    # Each engine's span hangs under one of the router's leg spans.
    for svc in (PREFILL, DECODE):
        assert {s.parent_span_id for s in by_service[svc]} <= router_ids - {root.span_id}, svc
    assert {s.service for s in engines} >= {PREFILL, DECODE}


def test_without_the_routers_exporter_a_clients_trace_id_still_reaches_the_engines(traced):
    stack, receiver = traced
    with running_router(stack, "router-untraced", tracing=None) as (url, _):
        trace_id, _ = traced_turn(url, seed=95)
        spans = receiver.wait_for(trace_id, {PREFILL, DECODE})
    assert {s.service for s in spans} == {PREFILL, DECODE}
