"""Every setting that more than one side reads, defined once: type, bounds, default and
description, in vLLM's names where vLLM has the setting.

The CRD's `kvTransfer` is `KvKnobs` plus what only the engines' command line needs
(bidirkv/operator/api/transfer.py), its `router` `RouterKnobs` plus what only the Deployment
needs (api/router.py), its `monitoring.tracing` `TracingKnobs` plus the collector's headers
(api/monitoring.py); the router's config file (bidirkv/router/config.py) is the three plus
what the operator derives; decode's plugin (bidirkv/connector/settings.py) reads
`RetentionWatermark` and `OwnerLeaseSeconds` from its environment. A rule between knobs is
a `Rule`: its Python form is what the operator and the router check, its CEL form what the
API server checks; tests/test_knob_rules.py holds the two equal. Imports no component.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StringConstraints,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.fields import FieldInfo

from bidirkv.otlp import endpoint_problem

MIB = 1024 * 1024
# Prefill declines a remote read this close to decode's deadline, so a router handle must
# expire at least this much earlier than the decoder blocks it points at. Not a knob: the
# operator renders it as the router's `safetyMarginSeconds`.
TTL_SAFETY_MARGIN_SECONDS = 10


class Section(BaseModel):
    # forbid: a misspelt key is an error, not a silent default. Each knob is Strict: "5"
    # or "true" where a number or a boolean belongs is a rendering bug, not a value.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


def _positive(le: float, description: str, default: float) -> Any:
    """A duration above zero. The API server's schema (OpenAPI v3.0) writes an exclusive
    bound as a flag beside `minimum`, not as JSON Schema's number."""
    return Field(default=default, gt=0, le=le, description=description,
                 json_schema_extra={"minimum": 0, "exclusiveMinimum": True})


@dataclass(frozen=True)
class Rule:
    """A rule between knobs, written once. `cel` and `says` take the operands' places
    ({0}, {1}): CEL paths for the API server, names as the reader writes them for the
    Python message, which also shows the values."""

    cel: str
    says: str
    holds: Callable[..., bool]

    def cel_at(self, *paths: str) -> str:
        return self.cel.format(*paths)

    def message(self, *names: str) -> str:
        return self.says.format(*names)

    def problem(self, names: tuple[str, ...], values: tuple[Any, ...]) -> str | None:
        if self.holds(*values):
            return None
        return self.says.format(*(f"{n} ({v})" for n, v in zip(names, values, strict=True)))


# A thresholds bound above the cap that every policy obeys could never apply.
LOCAL_PREFILL_UNDER_CAP = Rule(
    cel="{0} <= {1}", says="{0} must be at most {1}", holds=lambda local, cap: local <= cap)
# The lease is renewed once per health check round: one late round must not release
# every conversation.
LEASE_OUTLIVES_RENEWALS = Rule(
    cel="double({0}) >= 2.0 * double({1})",
    says="{0} must be at least twice {1}: the lease is renewed once per health check round, "
    "and one late round must not release every conversation",
    holds=lambda lease, interval: lease >= 2 * interval)
ONE_BODY_FITS_IN_FLIGHT = Rule(
    cel="{0} >= {1}", says="{0} must be at least {1}: a body the router accepts must fit",
    holds=lambda inflight, body: inflight >= body)
RULES = (LOCAL_PREFILL_UNDER_CAP, LEASE_OUTLIVES_RENEWALS, ONE_BODY_FITS_IN_FLIGHT)


def default_of(knob: Any) -> Any:
    """The default a knob declared as `Annotated[type, ..., Field(default=...)]` carries."""
    return next(m.default for m in knob.__metadata__ if isinstance(m, FieldInfo))


def check_rule(rule: Rule, section: str, model: BaseModel, *fields: str) -> None:
    """The rule on the model's fields: a ValueError naming them by their keys."""
    names = tuple(f"{section}{type(model).model_fields[f].alias}" for f in fields)
    problem = rule.problem(names, tuple(getattr(model, f) for f in fields))
    if problem:
        raise ValueError(problem)


def _refused(problem_of: Callable[[str], str | None]) -> AfterValidator:
    """A value `problem_of` finds a problem with is refused, with what it says."""
    def check(value: str) -> str:
        if problem := problem_of(value):
            raise ValueError(problem)
        return value
    return AfterValidator(check)


HIDDEN = "<not shown: it holds credentials>"


def shown_input(value: Any) -> Any:
    """A refused value as an error may show it: a URL with credentials in it is not
    shown (an error lands in logs, Events and status, readable by many)."""
    if isinstance(value, str) and "@" in value:
        try:
            parts = urlsplit(value)
        except ValueError:
            return HIDDEN
        if parts.username is not None or parts.password is not None:
            return HIDDEN
    return value


def _node_rule(rule: Rule, *fields: str) -> dict[str, str]:
    """The rule as the API server checks it on the node whose keys these are."""
    keys = [to_camel(f) for f in fields]
    return {"rule": rule.cel_at(*(f"self.{k}" for k in keys)),
            "message": rule.message(*keys), "fieldPath": f".{keys[0]}"}


# --- Decode's retained KV: the CRD's kvTransfer, the router, decode's plugin ------------

RetentionWatermark = Annotated[float, Strict(), Field(
    default=0.9, ge=0.05, le=1,
    description="Share of each decode replica's KV blocks that retained conversations may "
    "pin. Above it the router releases the ones expected back last (overdue ones first), "
    "and decode enforces the same bound itself. Whatever the value, a request waiting for "
    "blocks takes retained ones first: retention never makes new work wait. Lower values "
    "release conversations that would have come back (measured: 0.5 lost most reuse under "
    "pressure, 0.9 and 1.0 kept it).",
)]
OwnerLeaseSeconds = Annotated[int, Strict(), Field(
    default=30, ge=1, le=86400,
    description="Decode frees the retained blocks of a router that has not renewed its lease "
    "for this long (the router renews every `router.healthCheckIntervalSeconds`; a router "
    "that is gone stops, a restarted one is the same owner and renews). At least twice that "
    "interval; at most `decoderKvBlocksTtlSeconds`.",
)]


class KvKnobs(Section):
    bidirectional: Annotated[bool, Strict()] = Field(
        default=True,
        description="Decode keeps each finished request's KV and prefill reads it back on the "
        "next turn (vLLM `bidirectional_kv_xfer`, set identically on both roles).",
    )
    decoder_kv_blocks_ttl_seconds: Annotated[int, Strict()] = Field(
        default=480, ge=10, le=86400,
        description="How long decode pins a finished request's blocks for reuse; fixed, not "
        "renewed (vLLM `decoder_kv_blocks_ttl`).",
    )
    kv_recompute_threshold: Annotated[int, Strict()] = Field(
        default=64, ge=0, le=10_000_000,
        description="Prefill reads decode's KV only when at least this many tokens are "
        "reusable; shorter prefixes are recomputed (vLLM `kv_recompute_threshold`).",
    )
    retention_watermark: RetentionWatermark
    owner_lease_seconds: OwnerLeaseSeconds


# --- The router: the CRD's router section and the router's config file ---------------

PlacementPolicy = Literal["cost", "alwaysDisaggregate", "thresholds"]


class Placement(Section):
    """Where each turn runs (bidirkv/router/pool/placement.py)."""

    model_config = ConfigDict(frozen=True, json_schema_extra={"x-kubernetes-validations": [
        _node_rule(LOCAL_PREFILL_UNDER_CAP, "local_prefill_tokens", "max_local_prefill_tokens"),
    ]})

    policy: PlacementPolicy = Field(
        default="cost",
        description="Where each turn runs. `cost` (the default): where its time to first "
        "token is estimated lowest, from per-token costs the router learns online: extended "
        "on the decode replica that holds its conversation (decode prefills only the new "
        "tokens, nothing is transferred), or the prefill leg reading back what decode "
        "holds; a first turn runs whole on the least loaded decode replica when that is "
        "sooner (always when both are idle), and a busy holder's turn is decoded by another "
        "replica. "
        "`alwaysDisaggregate`: every turn takes the prefill leg, reading back what decode "
        "holds. `thresholds`: extend on decode when the new tokens are at most "
        "`localPrefillTokens`, or prefill has `prefillBusyRequests` requests in flight. "
        "Every choice gives the same output.",
    )
    max_local_prefill_tokens: Annotated[int, Strict()] = Field(
        default=1024, ge=0, le=1_048_576,
        description="Most new tokens a decode replica prefills for one turn under any "
        "policy: keeps the inter-token latency of what it is decoding bounded. The router "
        "has no tokenizer: the tokens are estimated from the prompt's characters (no less "
        "than 2/3 of English text's real count). 0: never.",
    )
    decode_busy_requests: Annotated[int, Strict()] = Field(
        default=4, ge=1, le=100_000,
        description="A decode replica with this many requests in flight from this router "
        "is busy: it prefills nothing for a turn, and a turn it holds takes the prefill "
        "leg, decoded by a less busy replica where there is one.",
    )
    local_prefill_tokens: Annotated[int, Strict()] = Field(
        default=256, ge=0, le=1_048_576,
        description="`thresholds`: extend on decode at most this many new tokens (like "
        "llm-d's `nonCachedTokens`). At most `maxLocalPrefillTokens`.",
    )
    prefill_busy_requests: Annotated[int, Strict()] = Field(
        default=2, ge=1, le=100_000,
        description="`thresholds`: with this many requests in flight on prefill, extend on "
        "decode up to `maxLocalPrefillTokens` new tokens.",
    )

    @model_validator(mode="after")
    def _thresholds_under_the_cap(self) -> Placement:
        check_rule(LOCAL_PREFILL_UNDER_CAP, "placement.", self, "local_prefill_tokens",
                   "max_local_prefill_tokens")
        return self


Seconds = Annotated[float, Strict()]


class Timeouts(Section):
    """How long the router waits on each step of a turn."""

    model_config = ConfigDict(frozen=True)

    connect_seconds: Seconds = _positive(
        3600, "Opening a connection to an engine.", 5.0)
    prefill_seconds: Seconds = _positive(
        86400, "The whole prefill leg (prefill answers once, after computing the prompt).",
        300.0)
    decode_seconds: Seconds = _positive(
        86400, "Longest silence on the decode leg, between bytes: a streamed generation may "
        "run for minutes, a stalled one must not hold the client forever.", 600.0)
    decode_first_byte_seconds: Seconds = _positive(
        86400, "A streamed decode leg's first byte (the first token, after decode's KV "
        "read): past it the turn goes to another replica, as before any byte of a failed "
        "leg.", 120.0)
    body_read_seconds: Seconds = _positive(
        3600, "A client's whole request body, else a 408: a slow sender must not hold its "
        "connection and its place among the requests still reading for long.", 30.0)
    idle_connection_seconds: Seconds = _positive(
        86400, "A client connection that has sent no complete request head this long after "
        "it opened, or after its last response, is closed (like nginx's "
        "`keepalive_timeout`). Read when the router starts.", 75.0)


# The API server's form of the handle store's address; `handle_store_url_problem` is the
# same rule in Python, with the reason (tests/test_knob_rules.py holds the two equal).
HANDLE_STORE_URL_PATTERN = r"^rediss?://[^/@\s]+(/[0-9]{1,2})?$"


def handle_store_url_problem(value: str) -> str | None:
    parts = urlsplit(value)
    if parts.scheme not in ("redis", "rediss") or not parts.netloc:
        return "expected redis://HOST:PORT/DB or rediss://HOST:PORT/DB"
    if "@" in parts.netloc:
        return ("no credentials in the URL: the password comes from a Secret "
                "(router.handleStore.passwordSecretRef, BIDIRKV_HANDLE_STORE_PASSWORD)")
    if parts.path and not re.fullmatch(r"/[0-9]{1,2}", parts.path):
        return f"database {parts.path[1:]!r} must be a number from 0 to 99"
    if not re.match(HANDLE_STORE_URL_PATTERN, value):
        return ("expected redis://HOST:PORT/DB or rediss://HOST:PORT/DB, without a query, "
                "a fragment or whitespace")
    return None


HandleStoreUrl = Annotated[str, Strict(), Field(
    max_length=512,
    json_schema_extra={"pattern": HANDLE_STORE_URL_PATTERN},
    description="Redis-protocol server shared by the router replicas (Valkey, Redis, "
    "ElastiCache without cluster mode): `redis://HOST:PORT/DB`, `rediss://` for TLS. No "
    "password here: it comes from a Secret.",
), _refused(handle_store_url_problem)]


# The parent headers agents send (Dynamo's, Claude Code's and Codex's sub-agents).
PARENT_HEADERS = ("X-Dynamo-Parent-Session-ID", "x-claude-code-parent-agent-id",
                  "x-codex-parent-thread-id")
HeaderName = Annotated[str, Strict(), StringConstraints(min_length=1, max_length=128,
                                                        pattern=r"^[A-Za-z0-9-]+$")]


class RouterKnobs(Section):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        _node_rule(ONE_BODY_FITS_IN_FLIGHT, "max_inflight_body_bytes", "max_body_bytes"),
    ]})

    conversation_ttl_seconds: Seconds = _positive(
        86400, "How long the router keeps a conversation's decode handle. Must be at "
        f"least {TTL_SAFETY_MARGIN_SECONDS} s below `kvTransfer.decoderKvBlocksTtlSeconds`, "
        "so the router never hands out blocks decode is about to free.", 420.0)
    max_conversations: Annotated[int, Strict()] = Field(
        default=100_000, ge=1, le=10_000_000,
        description="Most conversation handles kept per router; past it the least recently "
        "stored handle of the tenant holding the most is dropped.",
    )
    max_conversations_per_tenant: Annotated[int, Strict()] | None = Field(
        default=None, ge=1, le=10_000_000,
        description="Most conversation handles one tenant may keep (its least recently "
        "used dropped first); unset: up to `maxConversations`. Whatever the caps, the "
        "`maxConversations` bound and the retention watermark evict from the tenant "
        "holding the most.",
    )
    tenant_retention_share: Annotated[float, Strict()] = Field(
        default=1.0, ge=0.01, le=1,
        description="Share of each decode replica's retention budget "
        "(`kvTransfer.retentionWatermark` of its KV blocks) that one tenant's "
        "conversations may pin.",
    )
    tenant_header: Annotated[str, Strict()] = Field(
        default="Authorization",
        min_length=1, max_length=128,
        pattern=r"^[A-Za-z0-9-]+$",
        description="Request header whose value names the tenant a conversation belongs to "
        "(its caps and fair eviction, its `cache_salt`; conversations of different tenants "
        "never share a handle nor cached KV). The client chooses it: see "
        "`trustedTenantHeader` and `maxTenantsPerSource`.",
    )
    trusted_tenant_header: Annotated[str, Strict()] | None = Field(
        default=None, min_length=1, max_length=128,
        pattern=r"^[A-Za-z0-9-]+$",
        description="Request header that a gateway in front of the router sets to the caller "
        "it authenticated (and strips from what clients send). Set, it alone names the "
        "tenant, `tenantHeader` and `maxTenantsPerSource` are not used, and a request "
        "without it belongs to one anonymous tenant. The per-tenant caps and fair eviction "
        "are fair between real tenants only with it. Whoever reaches the router can send "
        "it: a DisaggregatedInference with it needs `networkPolicy.routerFrom` admitting "
        "the gateway alone and a ClusterIP Service.",
    )
    parent_headers: Annotated[list[HeaderName], Strict()] = Field(
        default=list(PARENT_HEADERS), max_length=8,
        description="Request headers that name the conversation a sub-agent or a fork "
        "comes from (its `X-Session-ID` or `conversation_id`), the first one sent wins: "
        "the child's first turn reads the prefix decode holds for that conversation "
        "without taking its handle (docs/router.md, Agents). An unknown or another "
        "tenant's conversation is ignored. Empty: children are found by their prompt alone.",
    )
    max_tenants_per_source: Annotated[int, Strict()] = Field(
        default=64, ge=1, le=1_000_000,
        description="Without `trustedTenantHeader`: most tenants one client address names "
        "at a time (a tenant unseen for `conversationTtlSeconds` frees its place); past "
        "it, that address's new tenants count as one tenant for the caps and eviction, "
        "each keeping its own handles and cache. Behind a proxy every client has the "
        "proxy's address: set `trustedTenantHeader` there.",
    )
    prefill_only_fallback: Annotated[bool, Strict()] = Field(
        default=True,
        description="With no healthy decode replica, prefill serves whole requests itself "
        "(no KV kept for reuse) instead of the router answering 503; `/ready` says so.",
    )
    placement_header: Annotated[bool, Strict()] = Field(
        default=False,
        description="Each answer names where its turn ran (`X-Bidirkv-Placement: extend; "
        "reason=short_append`), for benchmarks and debugging. Off by default: it tells any "
        "client whether the exact history it sent is stored and how busy the decode "
        "replicas are.",
    )
    health_check_interval_seconds: Seconds = _positive(
        3600, "How often the router probes every engine and renews its residency lease on "
        "decode.", 5.0)
    # A 200k-token agent history is ~0.85 MB of JSON in English (~4.2 bytes a token), ~0.95
    # MB with a tool call every few messages (code's quotes and line breaks escaped), and up
    # to ~1.8 MB as JSON-escaped CJK (1.5 characters a token, 6 bytes each as \uXXXX): 4 MiB
    # leaves room for 2x the largest. A 1M-token model needs 16 MiB (docs/router.md, Long
    # contexts).
    max_body_bytes: Annotated[int, Strict()] = Field(
        default=4 * MIB, ge=1024, le=1024 * MIB,
        description="Largest request body the router accepts (413 above).")
    # Parsed, a body takes up to ~20x its size in objects (many tiny messages): 32 MiB of
    # bodies in flight stays well inside the router pod's 1 GiB.
    max_inflight_body_bytes: Annotated[int, Strict()] = Field(
        default=32 * MIB, ge=1024, le=16 * 1024 * MIB,
        description="Request body bytes the router holds at once (429 past it), charged "
        "as they arrive; bodies up to 64 KiB keep a reserve of 1/8 of it. Parsed, a body "
        "takes up to ~20x its size: the default stays well inside the router pod's 1 GiB "
        "memory limit. At least `maxBodyBytes`.")
    max_inflight_requests: Annotated[int, Strict()] = Field(
        default=512, ge=1, le=1_000_000,
        description="Requests the router serves at once, each counted from when its whole "
        "body has arrived; past it a 429 with `Retry-After: 1` (nothing waits for a "
        "slot).")
    # A request whose body is still arriving holds a connection, a task and the bytes it
    # was charged, not an in-flight slot; silent ones are gone after the upload grace.
    max_reading_requests: Annotated[int, Strict()] = Field(
        default=2048, ge=1, le=1_000_000,
        description="Requests whose body is still arriving, at once (a body that came with "
        "its request head is never one of them); past it a 429 and the connection closed. "
        "Each is cut off (408) once its body falls under 32 KiB/s on average after its "
        "first 2 s, or past `timeouts.bodyReadSeconds`.")
    # 64: a client whose bodies arrive in a few ms has a handful arriving at once even at
    # thousands of requests a second; one address sending only request heads holds 64
    # places for 2 s at a time, never an in-flight slot.
    max_reading_requests_per_source: Annotated[int, Strict()] = Field(
        default=64, ge=1, le=1_000_000,
        description="Requests whose body is still arriving from one client address at "
        "once; past it that address's new ones get a 429 and their connection closed, "
        "while other addresses are served. Behind a proxy that passes bodies on as they "
        "arrive every client has the proxy's address: raise it there, or let the proxy "
        "bound its clients. `maxReadingRequests` bounds all addresses together.")
    # Their count, not the bytes, is what a body costs on the event loop (~12 us each):
    # a 200k-token agent history (a tool call every 3 messages, ~150 tokens a message) has
    # ~3,600, so 8192 holds it with 2x to spare (messages averaging over ~67 tokens), and at
    # most ~0.1 s of work. A 1M-token model's agent histories need 32768 (~18,600).
    max_json_containers: Annotated[int, Strict()] = Field(
        default=8192, ge=64, le=10_000_000,
        description="Most JSON objects and arrays in one request body: their count, not its "
        "bytes, is what a body costs the router to check.")
    timeouts: Timeouts = Field(
        default_factory=Timeouts, description="How long the router waits on each step.")
    placement: Placement = Field(
        default_factory=Placement,
        description="Per-turn placement: extend a conversation on the decode replica that "
        "holds it, or take the prefill leg.",
    )

    @model_validator(mode="after")
    def _one_body_fits_in_flight(self) -> RouterKnobs:
        check_rule(ONE_BODY_FITS_IN_FLIGHT, "", self, "max_inflight_body_bytes", "max_body_bytes")
        return self


# --- Traces: the CRD's monitoring.tracing and the router's config file ---------------

class TracingKnobs(Section):
    # Used as given, as vLLM's --otlp-traces-endpoint is; the collector's headers (a token)
    # never sit here: they come from OTEL_EXPORTER_OTLP_TRACES_HEADERS.
    otlp_endpoint: Annotated[str, Strict(), Field(min_length=1, max_length=512),
                             _refused(endpoint_problem)] | None = Field(
        default=None,
        description="OTLP/HTTP (protobuf) traces endpoint, e.g. "
        "`http://otel-collector.monitoring:4318/v1/traces`. The router exports a span per "
        "request with a child per leg there, and both engines get vLLM's "
        "`--otlp-traces-endpoint` with it. Unset: nothing is exported, and a client's own "
        "`traceparent` still reaches both engines through the router.",
    )
    # bidirkv/router/tracing/spans.py says why a client's sampled flag is not obeyed.
    sample_ratio: Annotated[float, Strict()] = Field(
        default=1.0, ge=0, le=1,
        description="Share of the router's requests whose traces are sampled, whether or "
        "not the client sent a `traceparent`: a client's sampled flag does not decide, or "
        "any client could have every request it sends recorded and exported.",
    )
