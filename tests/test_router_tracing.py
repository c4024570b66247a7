"""Traces through the router, against the fake engines over HTTP: W3C trace context on
every upstream request (tracing off and on), the request span and one child per upstream
request in the span file and at an OTLP/HTTP collector, the tracing config, the span
file's reader and formatter; and the two gauges the dashboard reads (prefill-only mode,
the handle store in use)."""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib

import pytest
from fake_engine import Cluster
from opentelemetry.sdk.trace.export import SpanExportResult
from otlp_receiver import receiving

from bidirkv.bench.traces import (
    by_trace,
    format_trace,
    read_spans,
    returning_turn,
    returning_turn_text,
    tree,
)
from bidirkv.router.config import ConfigError, parse_config
from bidirkv.router.server.app import build_app
from bidirkv.router.tracing.spanfile import SpanFileExporter
from bidirkv.router.tracing.spans import Traces, passthrough, upstream_attributes

pytestmark = pytest.mark.timeout(30)

U1 = [{"role": "user", "content": "a prompt that must stay out of every span"}]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
SAMPLED = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
UNSAMPLED = f"00-{TRACE_ID}-{CLIENT_SPAN}-00"
BASE = {"prefill": ["http://p:8100"], "decode": ["http://d:8200"]}
ROOT = pathlib.Path(__file__).resolve().parent.parent


def parts(traceparent: str) -> tuple[str, str, str, str]:
    version, trace_id, parent, flags = traceparent.split("-")
    return version, trace_id, parent, flags


def upstream(c: Cluster) -> list:
    """Every generation request the engines received, prefill's first."""
    return [g for e in c.p + c.d for g in e.generations()]


def with_file(tmp_path, decode: int = 1) -> Cluster:
    """A cluster whose router writes its spans to tmp_path/spans.jsonl."""
    return Cluster(decode=decode, config={"tracing": {"file": str(tmp_path / "spans.jsonl")}})


def spans_of(tmp_path) -> list[dict]:
    return read_spans(tmp_path / "spans.jsonl")


def only(spans: list[dict], name: str) -> dict:
    (span,) = [s for s in spans if s["name"] == name]
    return span


async def metric(c: Cluster, line: str) -> bool:
    return any(m.startswith(line) for m in (await c.metrics()).splitlines())


# -- propagation with tracing off -------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("traceparent", [SAMPLED, UNSAMPLED])
async def test_off_a_clients_traceparent_reaches_both_engines(stream, traceparent):
    async with Cluster() as c:
        assert c.router.ctx.traces.provider is None  # nothing recorded, nothing exported
        r = await c.chat(U1, stream, headers={"traceparent": traceparent,
                                              "tracestate": "vendor=opaque"})
        assert r["status"] == 200
        (p,), (d,) = c.p[0].generations(), c.d[0].generations()
        for g in (p, d):
            # As the client sent it: the router records no span of its own to name.
            assert g.headers["traceparent"] == traceparent
            assert g.headers["tracestate"] == "vendor=opaque"


async def test_off_without_a_traceparent_nothing_is_added_upstream():
    async with Cluster() as c:
        assert (await c.chat(U1, True))["status"] == 200
        assert (await c.complete("once", False))["status"] == 200
        for g in upstream(c):
            assert "traceparent" not in g.headers and "tracestate" not in g.headers


@pytest.mark.parametrize("bad", [
    "not-a-traceparent", f"00-{'0' * 32}-{CLIENT_SPAN}-01", f"00-{TRACE_ID}-{'0' * 16}-01",
    f"00-{TRACE_ID.upper()}-{CLIENT_SPAN}-01x",
])
async def test_off_a_malformed_traceparent_is_dropped(bad):
    async with Cluster() as c:
        assert (await c.chat(U1, headers={"traceparent": bad}))["status"] == 200
        assert all("traceparent" not in g.headers for g in upstream(c))


def test_passthrough_goes_through_the_propagator():
    assert passthrough({"traceparent": SAMPLED}).headers == {"traceparent": SAMPLED}
    assert passthrough({"traceparent": "garbage"}).headers is None
    assert passthrough({"traceparent": SAMPLED, "tracestate": "a=1,b=2"}).headers == {
        "traceparent": SAMPLED, "tracestate": "a=1,b=2"}


# -- spans in the file --------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
async def test_file_holds_the_request_span_and_one_child_per_leg(tmp_path, stream):
    async with with_file(tmp_path) as c:
        r = await c.chat(U1, stream, conversation_id="conv-1",
                         headers={"traceparent": SAMPLED, "Authorization": "Bearer s3cret",
                                  "X-Request-Id": "rid-1"})
        assert r["status"] == 200
        (p,), (d,) = c.p[0].generations(), c.d[0].generations()
    spans = spans_of(tmp_path)
    assert len(spans) == 3 and {s["traceId"] for s in spans} == {TRACE_ID}
    req, pre, dec = (only(spans, n) for n in ("POST /v1/chat/completions", "prefill",
                                               "decode"))
    # The router's span continues the client's; each leg's is its child.
    assert req["parentSpanId"] == CLIENT_SPAN and req["kind"] == "SPAN_KIND_SERVER"
    for leg in (pre, dec):
        assert leg["parentSpanId"] == req["spanId"] and leg["kind"] == "SPAN_KIND_CLIENT"
        assert req["startTimeUnixNano"] <= leg["startTimeUnixNano"] <= leg[
            "endTimeUnixNano"] <= req["endTimeUnixNano"]
    # Each engine got its own leg's context: its spans hang under that leg.
    assert parts(p.headers["traceparent"]) == ("00", TRACE_ID, pre["spanId"], "01")
    assert parts(d.headers["traceparent"]) == ("00", TRACE_ID, dec["spanId"], "01")
    a = req["attributes"]
    assert a["http.request.method"] == "POST" and a["http.route"] == "/v1/chat/completions"
    assert a["http.response.status_code"] == 200 and a["bidirkv.outcome"] == "ok"
    assert a["bidirkv.stream"] is stream and a["bidirkv.reuse"] == "miss"
    assert a["bidirkv.request_id"] == "rid-1" and a["gen_ai.request.model"] == "fake-model"
    assert a["gen_ai.usage.input_tokens"] > 0
    assert req["status"]["code"] == "STATUS_CODE_UNSET"
    assert req["resource"]["service.name"] == "bidir-kv-router"
    pa = pre["attributes"]
    assert pa["bidirkv.leg.result"] == "ok"
    assert pa["url.full"] == c.p[0].url + "/v1/chat/completions"
    assert pa["server.address"] == "127.0.0.1" and pa["server.port"] == c.p[0].port
    assert pa["http.response.status_code"] == 200 and "bidirkv.leg.attempt" not in pa
    assert "bidirkv.kv.offered_tokens" not in pa  # turn one: no handle
    # D is offered P's KV: the prompt's tokens.
    assert dec["attributes"]["bidirkv.kv.offered_tokens"] == a["gen_ai.usage.input_tokens"]
    text = (tmp_path / "spans.jsonl").read_text()
    for secret in ("a prompt that must", "s3cret", "conv-1", "remote_block_ids"):
        assert secret not in text


async def test_a_returning_turn_records_the_kv_offered_and_reused(tmp_path):
    async with with_file(tmp_path) as c:
        r1 = await c.chat(U1, conversation_id="a")
        r2 = await c.chat(U1 + [r1["message"], {"role": "user", "content": "more"}],
                          conversation_id="a")
        assert r2["status"] == 200
        offered = c.p[0].generations()[1].kv["remote_num_tokens"]
    spans = spans_of(tmp_path)
    trace_id = returning_turn(spans)
    second = by_trace(spans)[trace_id]
    req = next(s for s in second if s["kind"] == "SPAN_KIND_SERVER")
    assert req["attributes"]["bidirkv.reuse"] == "hit"
    pa = only(second, "prefill")["attributes"]
    assert pa["bidirkv.kv.offered_tokens"] == offered
    assert pa["bidirkv.kv.reused_tokens"] == offered and pa["bidirkv.kv.reuse_source"] == \
        "bidirkv"
    # The router started this trace (no client traceparent): its span is the root.
    assert req["parentSpanId"] == "" and len(by_trace(spans)) == 2


async def test_on_without_a_client_traceparent_the_router_starts_the_trace(tmp_path):
    async with with_file(tmp_path) as c:
        assert (await c.chat(U1, True))["status"] == 200
        tps = [parts(g.headers["traceparent"]) for g in upstream(c)]
    (trace_id,) = {s["traceId"] for s in spans_of(tmp_path)}
    assert [t[1] for t in tps] == [trace_id, trace_id]
    assert all(int(t[3], 16) & 1 for t in tps)  # sampled (sampleRatio 1.0)


async def test_decode_down_the_prefill_only_request_gets_its_span(tmp_path):
    async with with_file(tmp_path, decode=2) as c:
        for d in c.d:
            d.behaviour.health_status = 503
        await c.router.health.check_health()
        r = await c.chat(U1, True, headers={"traceparent": SAMPLED})
        assert r["status"] == 200
        (p,) = c.p[0].generations()
    spans = spans_of(tmp_path)
    req = only(spans, "POST /v1/chat/completions")
    leg = only(spans, "prefill_only")
    assert leg["parentSpanId"] == req["spanId"] and len(spans) == 2
    assert req["attributes"]["bidirkv.serving_mode"] == "prefill-only"
    assert leg["attributes"]["bidirkv.leg.result"] == "ok"
    assert parts(p.headers["traceparent"])[1:3] == (TRACE_ID, leg["spanId"])


async def test_retries_are_spans_of_their_own(tmp_path):
    """D fails before the first byte: the turn is retried on the other decode with a
    fresh prefill leg; each upstream request is a span, numbered by attempt."""
    async with Cluster(decode=2, config={"tracing": {"file": str(tmp_path / "s.jsonl")}}
                       ) as c:
        c.d[0].behaviour.fail_next = 1
        c.router.ctx.decode.backends[1].outstanding += 1  # so that d0 is tried first
        r = await c.chat(U1, True, headers={"traceparent": SAMPLED})
        c.router.ctx.decode.backends[1].outstanding -= 1
        assert r["status"] == 200
        sent = {g.headers["traceparent"].split("-")[2] for g in upstream(c)}
    spans = read_spans(tmp_path / "s.jsonl")
    req = only(spans, "POST /v1/chat/completions")
    legs = sorted((s for s in spans if s is not req), key=lambda s: s["startTimeUnixNano"])
    assert [(s["name"], s["attributes"].get("bidirkv.leg.attempt", 0)) for s in legs] == [
        ("prefill", 0), ("decode", 0), ("prefill", 1), ("decode", 1)]
    assert all(s["parentSpanId"] == req["spanId"] for s in legs)
    failed = legs[1]
    assert failed["attributes"]["bidirkv.leg.result"] == "status"
    assert failed["attributes"]["http.response.status_code"] == 500
    assert failed["attributes"]["error.type"] == "500"
    assert failed["status"]["code"] == "STATUS_CODE_ERROR"
    assert legs[3]["attributes"]["bidirkv.leg.result"] == "ok"
    assert sent == {s["spanId"] for s in legs}  # each request carried its own span
    assert req["attributes"]["http.response.status_code"] == 200


async def test_a_stale_connection_resend_is_a_sibling_span(tmp_path):
    async with with_file(tmp_path) as c:
        assert (await c.chat(U1))["status"] == 200  # leaves a kept-alive connection to P
        c.p[0].behaviour.close_next = 1
        assert (await c.chat(U1, headers={"traceparent": SAMPLED}))["status"] == 200
        first, resent = c.p[0].generations()[1:]
    second = by_trace(spans_of(tmp_path))[TRACE_ID]
    legs = sorted((s for s in second if s["name"] == "prefill"),
                  key=lambda s: s["startTimeUnixNano"])
    assert [s["attributes"]["bidirkv.leg.result"] for s in legs] == ["stale_connection", "ok"]
    assert legs[1]["attributes"]["http.request.resend_count"] == 1
    assert legs[0]["parentSpanId"] == legs[1]["parentSpanId"]
    assert [parts(g.headers["traceparent"])[2] for g in (first, resent)] == [
        s["spanId"] for s in legs]


async def test_an_unavailable_request_is_an_error_span(tmp_path):
    async with with_file(tmp_path) as c:
        c.p[0].behaviour.health_status = 500
        await c.router.health.check_health()
        assert (await c.chat(U1))["status"] == 503
    (req,) = spans_of(tmp_path)
    assert req["attributes"]["http.response.status_code"] == 503
    assert req["attributes"]["bidirkv.outcome"] == "unavailable"
    assert req["status"]["code"] == "STATUS_CODE_ERROR"


async def test_models_and_ending_a_conversation_are_traced(tmp_path):
    async with with_file(tmp_path) as c:
        async with c.session.get(c.url + "/v1/models", headers={"traceparent": SAMPLED}) as r:
            assert r.status == 200
        async with c.session.delete(c.url + "/v1/conversations/private-id") as r:
            assert r.status == 404
    spans = spans_of(tmp_path)
    models = only(spans, "GET /v1/models")
    assert only(spans, "models")["parentSpanId"] == models["spanId"]
    end = only(spans, "DELETE /v1/conversations/{conversation_id}")
    assert end["attributes"]["http.response.status_code"] == 404
    assert "private-id" not in (tmp_path / "spans.jsonl").read_text()


async def test_the_router_decides_sampling_whatever_the_clients_flag(tmp_path):
    async with Cluster(config={"tracing": {"file": str(tmp_path / "spans.jsonl"),
                                           "sampleRatio": 0.0}}) as c:
        assert (await c.chat(U1))["status"] == 200  # the router's own trace: not sampled
        assert (await c.chat(U1, headers={"traceparent": UNSAMPLED}))["status"] == 200
        assert (await c.chat(U1, headers={"traceparent": SAMPLED}))["status"] == 200
        tps = [parts(g.headers["traceparent"]) for g in c.p[0].generations()]
    # Unsampled traces still carry their context, with the sampled flag off; a client's
    # sampled flag does not make the router record (and export) its request, but its
    # trace id is continued.
    assert [int(t[3], 16) & 1 for t in tps] == [0, 0, 0]
    assert tps[1][1] == TRACE_ID and tps[2][1] == TRACE_ID
    path = tmp_path / "spans.jsonl"
    assert not path.exists() or spans_of(tmp_path) == []
    async with Cluster(config={"tracing": {"file": str(path), "sampleRatio": 1.0}}) as c:
        assert (await c.chat(U1, headers={"traceparent": UNSAMPLED}))["status"] == 200
        tp = parts(c.p[0].generations()[0].headers["traceparent"])
    assert tp[1] == TRACE_ID and int(tp[3], 16) & 1  # the router's ratio, not the flag
    spans = spans_of(tmp_path)
    assert {s["traceId"] for s in spans} == {TRACE_ID} and len(spans) == 3


def test_a_trace_id_picked_to_pass_the_ratio_is_not_sampled_for_it():
    from opentelemetry.sdk.trace.sampling import Decision, TraceIdRatioBased

    from bidirkv.router.tracing.sampling import OwnDraw

    picked = int(TRACE_ID[:16] + "0" * 16, 16)  # its low 64 bits pass any ratio above 0
    assert TraceIdRatioBased(0.01).should_sample(None, picked, "x").decision \
        is Decision.RECORD_AND_SAMPLE
    draws = [OwnDraw(0.01).should_sample(None, picked, "x").decision for _ in range(2000)]
    assert draws.count(Decision.RECORD_AND_SAMPLE) < 100  # ~20 expected, not 2000


async def test_a_clients_long_model_name_is_cut_in_the_span(tmp_path):
    model = "m" * 200_000
    async with with_file(tmp_path) as c:
        r = await c.chat(U1, headers={"traceparent": SAMPLED}, model=model)
        assert r["status"] == 200
    from bidirkv.router.tracing.sampling import MAX_ATTRIBUTE_CHARS

    server = next(s for s in spans_of(tmp_path) if s["kind"] == "SPAN_KIND_SERVER")
    kept = server["attributes"]["gen_ai.request.model"]
    assert kept == model[:MAX_ATTRIBUTE_CHARS]
    assert (tmp_path / "spans.jsonl").stat().st_size < 20_000
    # The SDK's own limit, for any attribute set past the router's bound.
    assert c.router.ctx.traces.provider._span_limits.max_attribute_length \
        == MAX_ATTRIBUTE_CHARS


async def test_a_reload_applies_new_tracing_settings(tmp_path):
    path = tmp_path / "spans.jsonl"

    def files(c):
        return {"prefill": [c.p[0].url], "decode": [c.d[0].url]}

    async with Cluster(config_path=tmp_path / "router.json", file_config=files) as c:
        assert (await c.chat(U1))["status"] == 200
        old = c.router.ctx.traces
        c.write_config({**files(c), "tracing": {"file": str(path), "serviceName": "r2"}})
        for _ in range(250):
            if c.router.ctx.traces is not old:
                break
            await asyncio.sleep(0.02)
        assert c.router.ctx.traces.cfg.file == str(path) and old.retired
        assert (await c.chat(U1, headers={"traceparent": SAMPLED}))["status"] == 200
    (req, *_) = [s for s in read_spans(path) if s["kind"] == "SPAN_KIND_SERVER"]
    assert req["traceId"] == TRACE_ID and req["resource"]["service.name"] == "r2"


async def test_a_reload_keeps_tracing_when_the_new_file_cannot_be_opened(tmp_path, caplog):
    async with with_file(tmp_path) as c:
        before = c.router.ctx.traces
        bad = c.router.ctx.cfg.model_copy(update={"tracing": parse_config(
            {"tracing": {"file": str(tmp_path / "missing" / "x.jsonl")}}).tracing})
        with caplog.at_level(logging.ERROR, logger="bidirkv.router"):
            c.router.apply_config(bad)
        assert c.router.ctx.traces is before and not before.retired
        assert "tracing.file" in caplog.text and "missing" in caplog.text


async def test_a_retired_provider_shuts_down_after_its_last_request(tmp_path):
    traces = Traces(parse_config({"tracing": {"file": str(tmp_path / "s.jsonl")}}).tracing)
    trace = traces.request("POST", "/v1/completions", {})
    traces.retire()
    assert traces.active == 1 and not traces.shut_down
    trace.end(200, "ok")
    for _ in range(100):
        if traces.shut_down:
            break
        await asyncio.sleep(0.01)
    assert traces.shut_down
    assert len(read_spans(tmp_path / "s.jsonl")) == 1  # flushed on the way out


# -- OTLP/HTTP ----------------------------------------------------------------------------
async def test_spans_reach_an_otlp_http_collector():
    with receiving() as receiver:
        cfg = {"tracing": {"otlpEndpoint": receiver.url, "serviceName": "router-under-test"}}
        async with Cluster(config=cfg) as c:
            assert (await c.chat(U1, True, headers={"traceparent": SAMPLED}))["status"] == 200
        # Router close flushed them (no wait for the batch delay).
        spans = receiver.of_trace(TRACE_ID)
        assert set(receiver.content_types) == {"application/x-protobuf"}
        assert sorted(s.name for s in spans) == ["POST /v1/chat/completions", "decode",
                                                 "prefill"]
        assert len(receiver.spans) == len(spans)  # all of them in the client's trace
        assert {s.service for s in spans} == {"router-under-test"}


async def test_file_and_otlp_at_once_both_get_the_spans(tmp_path):
    with receiving() as receiver:
        async with Cluster(config={"tracing": {
                "file": str(tmp_path / "spans.jsonl"), "otlpEndpoint": receiver.url}}) as c:
            assert (await c.chat(U1))["status"] == 200
        assert receiver.spans and len(spans_of(tmp_path)) == 3


# -- config -------------------------------------------------------------------------------
def test_tracing_defaults_off():
    t = parse_config(BASE).tracing
    assert (t.otlp_endpoint, t.file, t.service_name, t.sample_ratio) == (
        None, None, "bidir-kv-router", 1.0)
    assert not t.enabled
    t = parse_config({**BASE, "tracing": {"otlpEndpoint": "https://otel:4318/v1/traces",
                                          "file": "spans.jsonl", "sampleRatio": 0}}).tracing
    assert t.enabled and t.sample_ratio == 0.0 and t.file == "spans.jsonl"


@pytest.mark.parametrize(("tracing", "needles"), [
    ({"otlpEndpoint": "grpc://otel:4317"},
     ["tracing.otlpEndpoint", "'grpc://otel:4317'", "http(s) URL", "/v1/traces"]),
    ({"otlpEndpoint": "otel-collector:4318"}, ["tracing.otlpEndpoint", "'otel-collector:4318'"]),
    ({"otlpEndpoint": "http://user:pw@otel:4318/v1/traces"},
     ["tracing.otlpEndpoint", "<not shown", "no credentials",
      "OTEL_EXPORTER_OTLP_TRACES_HEADERS"]),
    ({"otlpEndpoint": "http://otel:99999/v1/traces"}, ["tracing.otlpEndpoint", "port"]),
    ({"otlpEndpoint": 4318}, ["tracing.otlpEndpoint", "4318", "valid string"]),
    ({"sampleRatio": 2}, ["tracing.sampleRatio", "2", "less than or equal to 1"]),
    ({"sampleRatio": -0.5}, ["tracing.sampleRatio", "-0.5", "greater than or equal to 0"]),
    ({"sampleRatio": "0.5"}, ["tracing.sampleRatio", "'0.5'", "valid number"]),
    ({"file": ""}, ["tracing.file", "''", "at least 1 character"]),
    ({"file": "traces/"}, ["tracing.file", "'traces/'", "path of a file"]),
    ({"serviceName": ""}, ["tracing.serviceName", "at least 1 character"]),
    ({"exporter": "otlp"},
     ["tracing.exporter", "unknown key", "file, otlpEndpoint, sampleRatio, serviceName"]),
])
def test_bad_tracing_names_the_field_the_value_and_the_rule(tracing, needles):
    with pytest.raises(ConfigError) as exc:
        parse_config({**BASE, "tracing": tracing}, "router.json")
    for needle in needles:
        assert needle in str(exc.value), str(exc.value)
    assert str(exc.value).startswith("router.json: tracing.")
    assert "pw@" not in str(exc.value)


def test_an_unknown_key_of_another_section_lists_that_sections_keys():
    with pytest.raises(ConfigError, match="placement.polcy: .*allowed keys: "
                       "decodeBusyRequests, localPrefillTokens"):
        parse_config({**BASE, "placement": {"polcy": "cost"}})


def test_a_span_file_that_cannot_be_opened_fails_the_start(tmp_path):
    cfg = parse_config({**BASE, "tracing": {"file": str(tmp_path / "no" / "such" / "f")}})
    with pytest.raises(ConfigError, match=r"tracing.file: cannot open .*no/such/f.* "
                       "No such file or directory"):
        build_app(cfg)


def test_the_command_line_reports_an_unopenable_span_file(tmp_path, capsys, monkeypatch):
    from bidirkv.router.server.app import main

    config = tmp_path / "router.json"
    config.write_text(json.dumps({**BASE, "tracing": {"file": str(tmp_path)}}))
    monkeypatch.setenv("BIDIRKV_HANDLE_KEY", "k" * 32)
    assert main(["--config", str(config), "--port", "0", "--host", "127.0.0.1"]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err and "tracing.file" in err and str(tmp_path) in err


# -- the file's shape, its reader and the formatter ---------------------------------------
def test_span_record_is_otlp_json_shaped(tmp_path):
    traces = Traces(parse_config({"tracing": {"file": str(tmp_path / "s.jsonl"),
                                              "serviceName": "svc"}}).tracing)
    trace = traces.request("POST", "/v1/completions", {"traceparent": SAMPLED})
    leg = trace.leg("prefill", "http://user:pw@10.0.0.1:8100", "/v1/completions")
    leg.end("timeout")
    trace.end(504, "timeout")
    traces.provider.force_flush()
    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    assert len(lines) == 2
    child, parent = (json.loads(line) for line in lines)
    assert set(parent) == {"traceId", "spanId", "parentSpanId", "name", "kind",
                           "startTimeUnixNano", "endTimeUnixNano", "attributes", "status",
                           "events", "resource", "scope"}
    assert parent["traceId"] == TRACE_ID and parent["parentSpanId"] == CLIENT_SPAN
    assert child["parentSpanId"] == parent["spanId"] and len(child["spanId"]) == 16
    assert isinstance(parent["startTimeUnixNano"], int)
    assert parent["endTimeUnixNano"] >= parent["startTimeUnixNano"]
    assert parent["status"] == {"code": "STATUS_CODE_ERROR", "message": "timeout"}
    assert parent["attributes"]["error.type"] == "504"
    assert child["attributes"]["error.type"] == "timeout"
    assert child["attributes"]["url.full"] == "http://10.0.0.1:8100/v1/completions"  # no pw
    assert parent["resource"]["service.name"] == "svc" and parent["scope"] == "bidirkv.router"
    traces.provider.shutdown()


def test_upstream_attributes():
    assert upstream_attributes("http://[::1]:8200", "/v1/models") == {
        "server.address": "::1", "server.port": 8200, "url.full": "http://[::1]:8200/v1/models"}
    assert upstream_attributes("https://engine", "/x")["server.port"] == 443


def test_the_exporter_reports_a_write_it_could_not_do(tmp_path):
    exporter = SpanFileExporter(str(tmp_path / "s.jsonl"))
    exporter.shutdown()
    assert exporter.export([]) == SpanExportResult.FAILURE


def _span(name, span_id, parent, start_ms, end_ms, kind="SPAN_KIND_CLIENT", trace="t1",
          **attributes):
    return {"traceId": trace, "spanId": span_id, "parentSpanId": parent, "name": name,
            "kind": kind, "startTimeUnixNano": int(start_ms * 1e6),
            "endTimeUnixNano": int(end_ms * 1e6), "attributes": attributes}


SPANS = [
    _span("decode", "c2", "r1", 13.0, 41.5, **{"server.address": "127.0.0.1",
                                               "server.port": 8200,
                                               "http.response.status_code": 200,
                                               "bidirkv.leg.result": "ok",
                                               "bidirkv.kv.offered_tokens": 9412}),
    _span("POST /v1/chat/completions", "r1", "client", 0.0, 42.0, "SPAN_KIND_SERVER",
          **{"http.response.status_code": 200, "bidirkv.outcome": "ok",
             "bidirkv.reuse": "hit", "gen_ai.usage.input_tokens": 9412}),
    _span("prefill", "c1", "r1", 0.5, 12.5, **{
        "server.address": "127.0.0.1", "server.port": 8100, "http.response.status_code": 200,
        "bidirkv.leg.result": "ok", "bidirkv.kv.offered_tokens": 8400,
        "bidirkv.kv.reused_tokens": 8384}),
]


def test_format_trace_is_an_indented_tree_with_durations():
    assert format_trace(SPANS) == (
        "POST /v1/chat/completions  42.0 ms  HTTP 200, reuse hit, 9412 prompt tokens\n"
        "  prefill  12.0 ms at +0.5 ms  127.0.0.1:8100, HTTP 200, KV offered 8400, "
        "reused 8384\n"
        "  decode  28.5 ms at +13.0 ms  127.0.0.1:8200, HTTP 200, KV offered 9412")
    assert format_trace([]) == ""


def test_tree_nests_by_parent_and_survives_a_loop():
    spans = [_span("a", "1", "", 0, 5), _span("b", "2", "1", 1, 2), _span("c", "3", "2", 1, 2),
             _span("d", "4", "4", 3, 4)]
    assert [(depth, s["name"]) for depth, s in tree(spans)] == [
        (0, "a"), (1, "b"), (2, "c"), (0, "d")]


def test_returning_turn_picks_the_latest_reuse_else_the_latest_request():
    first = _span("POST /v1/chat/completions", "a", "", 0, 1, "SPAN_KIND_SERVER", "t0",
                  **{"bidirkv.reuse": "miss"})
    assert returning_turn([first]) == "t0"
    spans = [first, *SPANS, _span("POST /v1/chat/completions", "z", "", 99, 100,
                                  "SPAN_KIND_SERVER", "t9", **{"bidirkv.reuse": "miss"})]
    assert returning_turn(spans) == "t1"
    assert returning_turn([SPANS[0]]) is None


def test_returning_turn_text_reads_the_file(tmp_path):
    path = tmp_path / "spans.jsonl"
    assert returning_turn_text(path) is None  # no file yet
    path.write_text("".join(json.dumps(s) + "\n" for s in SPANS) + '{"traceId": "cut')
    assert returning_turn_text(path) == "trace t1\n" + format_trace(SPANS)


# -- gauges -------------------------------------------------------------------------------
async def test_prefill_only_mode_gauge_follows_decode_health():
    async with Cluster(decode=2) as c:
        assert await metric(c, "bidirkv_router_prefill_only_mode 0.0")
        for d in c.d:
            d.behaviour.health_status = 503
        await c.router.health.check_health()
        assert await metric(c, "bidirkv_router_prefill_only_mode 1.0")
        assert (await c.chat(U1))["status"] == 200  # served by prefill
        c.d[1].behaviour.health_status = 200
        await c.router.health.check_health()
        assert await metric(c, "bidirkv_router_prefill_only_mode 0.0")
        # Down again, but the fallback turned off by a reload: unavailable, not prefill-only.
        c.d[1].behaviour.health_status = 503
        await c.router.health.check_health()
        assert await metric(c, "bidirkv_router_prefill_only_mode 1.0")
        c.router.apply_config(c.router.ctx.cfg.model_copy(update={"prefill_only_fallback": False}))
        assert await metric(c, "bidirkv_router_prefill_only_mode 0.0")


async def test_prefill_only_mode_gauge_when_a_failed_leg_takes_the_last_decode_out():
    async with Cluster() as c:
        c.d[0].behaviour.fail_next = 2  # both attempts: the only decode is marked down
        assert (await c.chat(U1))["status"] == 502
        assert not c.router.ctx.decode.backends[0].healthy
        assert await metric(c, "bidirkv_router_prefill_only_mode 1.0")


async def test_handle_store_info_names_the_store_in_use(redis_url):
    async with Cluster() as c:
        m = await c.metrics()
        assert 'bidirkv_router_handle_store_info{mode="memory"} 1.0' in m
        assert 'mode="redis"' not in m
    async with Cluster(config={"handleStore": redis_url.url}) as c:
        m = await c.metrics()
        assert 'bidirkv_router_handle_store_info{mode="redis"} 1.0' in m
        assert 'mode="memory"' not in m


# -- the local stack ----------------------------------------------------------------------
@pytest.mark.parametrize("monitoring", [None, {"tracing": {
    "otlpEndpoint": "http://otel:4318/v1/traces", "sampleRatio": 0.5}}])
def test_the_local_stack_writes_the_routers_spans_in_its_state_dir(tmp_path, monitoring):
    from bidirkv.local.engines import ROUTER_TRACES
    from bidirkv.local.plan import local_spec, plan_stack, read_spec_file

    raw = read_spec_file(ROOT / "examples" / "local.yaml")
    (tmp_path / raw["model"]["name"]).mkdir(parents=True)
    if monitoring is not None:
        raw["monitoring"] = monitoring
    plan = plan_stack(local_spec(raw, tmp_path), [9000, 9001, 9002, 9003, 9004], tmp_path)
    tracing = parse_config(plan.router_config).tracing
    # Relative: the router runs in the state directory (the stack starts it there).
    assert tracing.file == ROUTER_TRACES == "router-traces.jsonl"
    if monitoring is not None:  # the spec's collector is kept beside the file
        assert tracing.otlp_endpoint == "http://otel:4318/v1/traces"
        assert tracing.sample_ratio == 0.5
