"""One definition per knob (bidirkv/knobs.py): each rule between knobs agrees with its CEL
form on a table of values, wherever it is checked (the API server, the operator, the
router), and every key of the router's config is set from the CRD or listed as derived or
fixed by the operator."""

import ast
import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from bidirkv import knobs
from bidirkv.operator.api.spec import CEL_RULES, SpecError, parse_spec
from bidirkv.operator.crd.schema import build_crd
from bidirkv.operator.render.naming import Owner
from bidirkv.operator.render.router import (
    DERIVED_ROUTER_KEYS,
    FIXED_ROUTER_KEYS,
    router_config,
)
from bidirkv.router.config import ConfigError, RouterConfig, parse_config
from kubeapi.crdcel import evaluate, to_cel
from kubeapi.crdschema import validate_custom_resource

MIB = 1024 * 1024
SPEC = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
ROUTER = SPEC["properties"]["router"]
KV = SPEC["properties"]["kvTransfer"]
PLACEMENT = ROUTER["properties"]["placement"]
BASE = {"prefill": ["http://p:1"], "decode": ["http://d:1"]}


def _cel(rule, values, schemas):
    """The rule's CEL form on operands typed as the CRD types them (integer or number)."""
    names = [f"a{i}" for i in range(len(values))]
    node = {"type": "object", "properties": dict(zip(names, schemas, strict=True))}
    self = to_cel(dict(zip(names, values, strict=True)), node)
    return bool(evaluate(rule.cel_at(*(f"self.{n}" for n in names)), {"self": self}))


# (rule, the CRD schemas of its operands, a table of operand values)
TABLES = [
    (knobs.LOCAL_PREFILL_UNDER_CAP,
     [PLACEMENT["properties"]["localPrefillTokens"],
      PLACEMENT["properties"]["maxLocalPrefillTokens"]],
     [(0, 0), (256, 1024), (1024, 1024), (1025, 1024), (1, 0), (1_048_576, 0)]),
    (knobs.LEASE_OUTLIVES_RENEWALS,
     [KV["properties"]["ownerLeaseSeconds"], ROUTER["properties"]["healthCheckIntervalSeconds"]],
     [(10, 5.0), (9, 5.0), (1, 0.5), (1, 0.51), (2, 0.5), (30, 14.9), (30, 15.0), (30, 15.01),
      (400, 200.0), (400, 200.5)]),
    (knobs.ONE_BODY_FITS_IN_FLIGHT,
     [ROUTER["properties"]["maxInflightBodyBytes"], ROUTER["properties"]["maxBodyBytes"]],
     [(1024, 1024), (1024, 1025), (32 * MIB, 4 * MIB), (4 * MIB, 4 * MIB + 1)]),
]


def test_every_rule_has_a_table():
    assert {id(rule) for rule, _, _ in TABLES} == {id(rule) for rule in knobs.RULES}


@pytest.mark.parametrize(("rule", "schemas", "rows"), TABLES)
def test_a_rule_and_its_cel_form_agree(rule, schemas, rows):
    verdicts = [(_cel(rule, row, schemas), rule.holds(*row)) for row in rows]
    assert all(cel == py for cel, py in verdicts), list(zip(rows, verdicts, strict=True))
    assert {py for _, py in verdicts} == {True, False}  # the table crosses the boundary


def test_the_crd_carries_each_rule_as_written():
    placement = [r["rule"] for r in PLACEMENT["x-kubernetes-validations"]]
    assert placement == [knobs.LOCAL_PREFILL_UNDER_CAP.cel_at(
        "self.localPrefillTokens", "self.maxLocalPrefillTokens")]
    router = [r["rule"] for r in ROUTER["x-kubernetes-validations"]]
    assert router == [knobs.ONE_BODY_FITS_IN_FLIGHT.cel_at(
        "self.maxInflightBodyBytes", "self.maxBodyBytes")]
    assert knobs.LEASE_OUTLIVES_RENEWALS.cel_at(
        "self.kvTransfer.ownerLeaseSeconds", "self.router.healthCheckIntervalSeconds") in [
        rule for rule, _, _ in CEL_RULES]


def _operator_refuses(spec):
    try:
        parse_spec(spec)
    except SpecError as err:
        return str(err)
    return None


def _router_refuses(data):
    try:
        parse_config({**BASE, **data})
    except ConfigError as err:
        return str(err)
    return None


# Where each rule is written into a resource and into the router's config.
PLACES = {
    id(knobs.LOCAL_PREFILL_UNDER_CAP): (
        lambda a, b: {"router": {"placement": {"localPrefillTokens": a,
                                               "maxLocalPrefillTokens": b}}},
        lambda a, b: {"placement": {"localPrefillTokens": a, "maxLocalPrefillTokens": b}}),
    id(knobs.LEASE_OUTLIVES_RENEWALS): (
        lambda a, b: {"kvTransfer": {"ownerLeaseSeconds": a},
                      "router": {"healthCheckIntervalSeconds": b}},
        lambda a, b: {"ownerLeaseSeconds": a, "healthCheckIntervalSeconds": b}),
    id(knobs.ONE_BODY_FITS_IN_FLIGHT): (
        lambda a, b: {"router": {"maxInflightBodyBytes": a, "maxBodyBytes": b}},
        lambda a, b: {"maxInflightBodyBytes": a, "maxBodyBytes": b}),
}


@pytest.mark.parametrize(("rule", "schemas", "rows"), TABLES)
def test_the_api_server_the_operator_and_the_router_refuse_alike(rule, schemas, rows):
    in_spec, in_router = PLACES[id(rule)]
    for row in rows:
        spec = {"model": {"name": "m"}, **in_spec(*row)}
        _, errors = validate_custom_resource(build_crd(), {
            "apiVersion": "bidirkv.io/v1alpha1", "kind": "DisaggregatedInference",
            "metadata": {"name": "x", "namespace": "default"}, "spec": spec})
        verdicts = (not errors, _operator_refuses(spec) is None,
                    _router_refuses(in_router(*row)) is None)
        assert verdicts == (rule.holds(*row),) * 3, (row, errors, verdicts)


def test_a_refusal_names_both_knobs_and_their_values():
    said = _router_refuses({"ownerLeaseSeconds": 9, "healthCheckIntervalSeconds": 5.0})
    assert "ownerLeaseSeconds (9) must be at least twice healthCheckIntervalSeconds (5.0)" \
        in said
    said = _operator_refuses({"model": {"name": "m"},
                              "router": {"placement": {"localPrefillTokens": 300,
                                                       "maxLocalPrefillTokens": 200}}})
    assert "spec.router.placement" in said
    assert "placement.localPrefillTokens (300) must be at most " \
        "placement.maxLocalPrefillTokens (200)" in said


# The spec-wide rules (bidirkv/operator/api/spec.py): each CEL rule, by its message, and
# what the operator's Python form says when it refuses the same thing.
PYTHON_SAYS = {
    "router.conversationTtlSeconds must be at least": "spec.router.conversationTtlSeconds:",
    "router.replicas > 1 needs": "spec.router.replicas:",
    "kvTransfer.ownerLeaseSeconds must not exceed": "spec.kvTransfer.ownerLeaseSeconds:",
    "kvTransfer.ownerLeaseSeconds must be at least twice":
        "spec.kvTransfer.ownerLeaseSeconds (",
    "every networkPolicy.metricsFrom": "needs namespaceSelector or podSelector",
    "router.trustedTenantHeader needs": "spec.router.trustedTenantHeader:",
    "router.serviceType must be ClusterIP": "spec.router.serviceType:",
    "kvTransfer.backend must be LIBFABRIC": "spec.kvTransfer.backend:",
    "prefill.efaDevices and decode.efaDevices must be at least 1": "must be >= 1 when efa",
    "efaDevices must be 0 on both roles": "must be 0 unless efa.enabled",
    "engine.modelCache needs exactly one": "spec.engine.modelCache",
    "prefill.modelCache needs exactly one": "spec.prefill.modelCache",
    "decode.modelCache needs exactly one": "spec.decode.modelCache",
}
GATEWAY = {"podSelector": {"matchLabels": {"app": "gateway"}}}
SPECS = [
    {},
    {"router": {"conversationTtlSeconds": 470}},
    {"router": {"conversationTtlSeconds": 470.5}},
    {"router": {"conversationTtlSeconds": 0.5}, "kvTransfer": {"decoderKvBlocksTtlSeconds": 10}},
    {"router": {"conversationTtlSeconds": 1}, "kvTransfer": {"decoderKvBlocksTtlSeconds": 10}},
    {"router": {"replicas": 2}},
    {"router": {"replicas": 2, "handleStore": {"url": "redis://v:6379/0"}}},
    {"kvTransfer": {"ownerLeaseSeconds": 480}},
    {"kvTransfer": {"ownerLeaseSeconds": 481, "decoderKvBlocksTtlSeconds": 480}},
    {"kvTransfer": {"ownerLeaseSeconds": 10}},
    {"kvTransfer": {"ownerLeaseSeconds": 9}},
    {"kvTransfer": {"ownerLeaseSeconds": 1}, "router": {"healthCheckIntervalSeconds": 0.5}},
    {"networkPolicy": {"metricsFrom": [{}]}},
    {"networkPolicy": {"routerFrom": [{"namespaceSelector": {}}, {}]}},
    {"networkPolicy": {"metricsFrom": [{"podSelector": {}}]}},
    {"router": {"trustedTenantHeader": "X-Tenant"}},
    {"router": {"trustedTenantHeader": "X-Tenant"}, "networkPolicy": {"routerFrom": [GATEWAY]}},
    {"router": {"trustedTenantHeader": "X-Tenant"},
     "networkPolicy": {"enabled": False, "routerFrom": [GATEWAY]}},
    {"router": {"trustedTenantHeader": "X-Tenant"},
     "networkPolicy": {"routerFrom": [GATEWAY, {"namespaceSelector": {}}]}},
    {"router": {"trustedTenantHeader": "X-Tenant"}, "networkPolicy": {"routerFrom": [
        {"namespaceSelector": {"matchLabels": {}, "matchExpressions": []},
         "podSelector": {}}]}},
    {"router": {"trustedTenantHeader": "X-Tenant"}, "networkPolicy": {"routerFrom": [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "gateway"}}}]}},
    {"router": {"trustedTenantHeader": "X-Tenant", "serviceType": "LoadBalancer"},
     "networkPolicy": {"routerFrom": [GATEWAY]}},
    {"router": {"trustedTenantHeader": "X-Tenant", "serviceType": "NodePort"}},
    {"router": {"serviceType": "LoadBalancer"}},
    {"efa": {"enabled": True}, "prefill": {"efaDevices": 1}, "decode": {"efaDevices": 1}},
    {"efa": {"enabled": True}, "kvTransfer": {"backend": "LIBFABRIC"},
     "prefill": {"efaDevices": 1}, "decode": {"efaDevices": 1}},
    {"efa": {"enabled": True}, "kvTransfer": {"backend": "LIBFABRIC"},
     "prefill": {"efaDevices": 1}},
    {"decode": {"efaDevices": 2}},
    {"engine": {"modelCache": {"hostPath": {"path": "/a"}, "emptyDir": {}}}},
    {"prefill": {"modelCache": {"emptyDir": {}}}},
    {"decode": {"modelCache": {"mountPath": "/m"}}},
]


@pytest.mark.parametrize("change", SPECS)
def test_the_spec_rules_and_their_cel_forms_agree(change):
    spec = {"model": {"name": "m"}, **change}
    obj, _ = validate_custom_resource(build_crd(), {
        "apiVersion": "bidirkv.io/v1alpha1", "kind": "DisaggregatedInference",
        "metadata": {"name": "x", "namespace": "default"}, "spec": spec})
    self = to_cel(obj["spec"], SPEC)
    said = _operator_refuses(spec) or ""
    for rule, message, _ in CEL_RULES:
        marker = next(v for k, v in PYTHON_SAYS.items() if message.startswith(k))
        assert bool(evaluate(rule, {"self": self})) == (marker not in said), (message, said)


def test_every_spec_rule_is_in_the_table():
    for _, message, _ in CEL_RULES:
        assert any(message.startswith(k) for k in PYTHON_SAYS), message


def _leaves(data, prefix=""):
    """A config's keys, the sections' ones dotted (`timeouts.connectSeconds`)."""
    out = set()
    for key, value in data.items():
        out |= _leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key}
    return out


def _model_leaves(model, prefix=""):
    out = set()
    for name, field in model.model_fields.items():
        key, inner = field.alias or name, field.annotation
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            out |= _model_leaves(inner, f"{prefix}{key}.")
        else:
            out.add(prefix + key)
    return out


def test_every_router_key_is_set_from_the_crd_or_listed():
    spec = parse_spec({
        "model": {"name": "m"},
        "router": {"maxConversationsPerTenant": 5, "trustedTenantHeader": "X-Tenant",
                   "replicas": 2,
                   "handleStore": {"url": "redis://v:6379/0"}},
        "networkPolicy": {"routerFrom": [GATEWAY]},
        "monitoring": {"tracing": {"otlpEndpoint": "http://c:4318/v1/traces"}},
    })
    rendered = _leaves(router_config(Owner("x", "ns", "u"), spec))
    knob_keys = (_model_leaves(knobs.RouterKnobs) | _model_leaves(knobs.KvKnobs)
                 | _model_leaves(knobs.TracingKnobs, "tracing."))
    derived, fixed = set(DERIVED_ROUTER_KEYS), set(FIXED_ROUTER_KEYS)
    assert not (knob_keys & derived or knob_keys & fixed or derived & fixed)
    assert _model_leaves(RouterConfig) == knob_keys | derived | fixed
    assert knob_keys | derived <= rendered


def test_what_the_crd_sets_reaches_the_router_as_set():
    spec = parse_spec({
        "model": {"name": "m"},
        "router": {"tenantHeader": "X-Tenant", "healthCheckIntervalSeconds": 2.5,
                   "maxBodyBytes": 2048, "maxInflightBodyBytes": 4096,
                   "maxInflightRequests": 7, "maxJsonContainers": 100,
                   "conversationTtlSeconds": 60.5,
                   "timeouts": {"connectSeconds": 1.5, "idleConnectionSeconds": 9},
                   "placement": {"policy": "thresholds", "localPrefillTokens": 8}},
        "kvTransfer": {"ownerLeaseSeconds": 45, "retentionWatermark": 0.5,
                       "decoderKvBlocksTtlSeconds": 120, "kvRecomputeThreshold": 0},
        "monitoring": {"tracing": {"otlpEndpoint": "http://c:4318/v1/traces",
                                   "sampleRatio": 0.25}},
    })
    cfg = parse_config(json.loads(json.dumps(router_config(Owner("x", "ns", "u"), spec))))
    for ours, theirs, knob_model in _sections(spec, cfg):
        for name in knob_model.model_fields:
            assert getattr(theirs, name) == getattr(ours, name), name


def _sections(spec, cfg):
    """(the CRD's section, the router's, the knobs they share)"""
    return ((spec.router, cfg, knobs.RouterKnobs), (spec.kv_transfer, cfg, knobs.KvKnobs),
            (spec.monitoring.tracing, cfg.tracing, knobs.TracingKnobs))


def test_the_router_and_the_crd_share_each_knobs_default():
    spec, cfg = parse_spec({"model": {"name": "m"}}), parse_config(BASE)
    for ours, theirs, knob_model in _sections(spec, cfg):
        for name in knob_model.model_fields:
            assert getattr(theirs, name) == getattr(ours, name), name


@pytest.mark.parametrize(("tracing", "in_the_schema"), [
    ({"sampleRatio": "0.5"}, True), ({"sampleRatio": True}, True), ({"sampleRatio": 1.5}, True),
    ({"otlpEndpoint": ""}, True), ({"otlpEndpoint": "ftp://c/v1/traces"}, False),
    ({"otlpEndpoint": "http://u:p@c:4318/v1/traces"}, False)])
def test_the_operator_and_the_router_refuse_a_tracing_knob_alike(tracing, in_the_schema):
    """One definition, one verdict: and the API server's too where its schema can say
    (a URL's shape it cannot)."""
    spec = {"model": {"name": "m"}, "monitoring": {"tracing": tracing}}
    _, errors = validate_custom_resource(build_crd(), {
        "apiVersion": "bidirkv.io/v1alpha1", "kind": "DisaggregatedInference",
        "metadata": {"name": "x", "namespace": "default"}, "spec": spec})
    assert bool(errors) == in_the_schema
    assert _operator_refuses(spec) and _router_refuses({"tracing": tracing})


BIDIRKV = Path(__file__).resolve().parents[1] / "bidirkv"
# Names the operator's spec and the router's config both declare that are not one setting.
NOT_ONE_KNOB = {
    "prefill": "a role's engines in the spec (its counts in the status), their URLs in "
    "the router's config",
    "decode": "the same, for decode",
    "model": "the model the engines load; the name the router serves it as",
    "handle_store": "the store and its password's Secret; the router's URL of it (one "
    "type, knobs.HandleStoreUrl)",
    "kv_fingerprint": "recorded in the status; rendered from the spec into the config",
    "tracing": "the sections; the knobs they share are knobs.TracingKnobs",
}


def declared_fields(paths) -> dict[str, set[str]]:
    """Each field a class in `paths` declares (`name: type`) -> `module:class`."""
    out: dict[str, set[str]] = {}
    for path in paths:
        for cls in ast.walk(ast.parse(path.read_text())):
            for line in cls.body if isinstance(cls, ast.ClassDef) else []:
                if isinstance(line, ast.AnnAssign) and isinstance(line.target, ast.Name):
                    out.setdefault(line.target.id, set()).add(f"{path.name}:{cls.name}")
    return out


def second_definitions(operator_files, router_files) -> list[str]:
    """The settings declared both by the CRD's models and by the router's config, or
    declared again over a knob of bidirkv/knobs.py (which they inherit)."""
    operator, router = declared_fields(operator_files), declared_fields(router_files)
    shared = {name for section in (knobs.KvKnobs, knobs.RouterKnobs, knobs.Placement,
                                   knobs.Timeouts, knobs.TracingKnobs)
              for name in section.model_fields}
    both = sorted(operator.keys() & router.keys() - NOT_ONE_KNOB.keys())
    return ([f"{n}: {sorted(operator[n] | router[n])}" for n in both]
            + [f"{n}: {sorted(where)} over knobs.py's" for side in (operator, router)
               for n, where in sorted(side.items()) if n in shared])


def test_a_knob_both_sides_read_is_declared_once():
    """A setting that the CRD and the router's config both hold is declared in
    bidirkv/knobs.py alone."""
    assert second_definitions(sorted((BIDIRKV / "operator" / "api").glob("*.py")),
                              [BIDIRKV / "router" / "config.py"]) == []


def test_a_second_definition_of_a_tracing_knob_is_caught(tmp_path):
    operator, router = tmp_path / "monitoring.py", tmp_path / "config.py"
    operator.write_text("class TracingSpec(_Model):\n    otlp_endpoint: str | None = None\n")
    router.write_text("class Tracing(_Model):\n    otlp_endpoint: str | None = None\n")
    assert second_definitions([operator], [router]) == [
        "otlp_endpoint: ['config.py:Tracing', 'monitoring.py:TracingSpec']",
        "otlp_endpoint: ['monitoring.py:TracingSpec'] over knobs.py's",
        "otlp_endpoint: ['config.py:Tracing'] over knobs.py's"]
    router.write_text("class Tracing(TracingKnobs, _Model):\n    sample_ratio: float = 1\n")
    assert second_definitions([], [router]) == [
        "sample_ratio: ['config.py:Tracing'] over knobs.py's"]


@pytest.mark.parametrize("url", [
    "redis://v:6379/0", "rediss://valkey.cache:6379/99", "redis://v", "redis://v:6379",
    "redis://v:6379/", "redis://v:6379/100", "redis://v:6379/db", "redis://u:pw@v:6379/0",
    "redis://@v/0", "http://v:6379", "redis://v:6379/0?timeout=1", "redis://v:6379/0#x",
    "redis:///0", "redis://v 1:6379", "REDIS://v:6379", "redis://v:6379/0/1",
])
def test_the_handle_store_address_rule_and_its_pattern_agree(url):
    """The CRD checks the address with a pattern; the operator and the router with the
    same rule in Python, which also says what is wrong."""
    import re

    problem = knobs.handle_store_url_problem(url)
    assert (re.match(knobs.HANDLE_STORE_URL_PATTERN, url) is not None) == (problem is None), \
        problem
    crd = ROUTER["properties"]["handleStore"]["properties"]["url"]
    assert crd["pattern"] == knobs.HANDLE_STORE_URL_PATTERN
    assert (_router_refuses({"handleStore": url}) is None) == (problem is None)
