"""Prometheus metrics; one CollectorRegistry per router, so several can live in a process."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Added latency is the router's budget (milliseconds), engine TTFT is seconds: both ends.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)

REQUEST_OUTCOMES = (
    "ok", "client_error", "upstream_client_error", "unavailable", "upstream_error",
    "timeout", "stream_error", "cancelled",
)


class ReuseOutcome(StrEnum):
    """What became of a turn's handle (datapath/reservation.py writes it, alone): the
    metric's label, the span's attribute and the log's word, as they were as strings."""

    HIT = "hit"
    MISS = "miss"
    EXPIRED = "expired"
    VERIFIED_PARTIAL = "verified-partial"
    DROPPED = "dropped"
    OFF = "off"
    EXTENDED = "extended"


REUSE_OUTCOMES = tuple(ReuseOutcome)
# Whose KV an answered turn started from (metrics `reuse_kind`; datapath/parents.py).
RETURNING, CHILD, FORK, PREFIX = "returning", "child", "fork", "prefix"
REUSE_KINDS = (RETURNING, CHILD, FORK, PREFIX)


class Children(dict[Any, Any]):
    """A metric's children by their label values (a tuple, or the one value), each bound
    on first use."""

    def __init__(self, metric: Any) -> None:
        super().__init__()
        self.metric = metric

    def __missing__(self, key: Any) -> Any:
        child = self[key] = self.metric.labels(*key) if isinstance(key, tuple) \
            else self.metric.labels(key)
        return child


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        p = "bidirkv_router_"
        self.requests = Counter(
            p + "requests", "Client requests by route and outcome.", ["route", "outcome"],
            registry=r,
        )
        self.reuse = Counter(
            p + "reuse", "Decode-handle reuse outcome per request that reached P: hit (P took the "
            "handle), miss (none stored), expired (stored but past its TTL), verified-partial "
            "(P reported reusing fewer tokens than offered), dropped (P failed with the "
            "handle; retried without), off (bidirectional disabled); extended: the turn "
            "was extended on the decode replica holding it, without P.", ["outcome"],
            registry=r,
        )
        self.reuse_kind = Counter(
            p + "reuse_kind", "Answered turns that started from KV decode held, by whose it "
            "was (bidirkv/router/datapath/parents.py): returning (the conversation's own "
            "handle, read back or extended), child (the conversation a parent header "
            "names), fork (a conversation whose prompt and answer this prompt extends), "
            "prefix (a conversation with the same tools and system message).", ["kind"],
            registry=r,
        )
        self.placements = Counter(
            p + "placements", "Where each turn ran, and why (bidirkv/router/pool/"
            "placement.py): decision extend, decode, read_back, move or prefill.",
            ["decision", "reason"],
            registry=r,
        )
        self.tokens_offered = Counter(
            p + "reuse_tokens_offered",
            "remote_num_tokens of handles sent to P at or above kvRecomputeThreshold "
            "(an upper bound of reuse).", registry=r,
        )
        self.tokens_reused = Counter(
            p + "reuse_tokens", "Tokens P reports it did not recompute, by where the number "
            "came from (bidirkv: P's reuse report; usage_cached: usage.prompt_tokens_details"
            ".cached_tokens, which includes P's local prefix-cache hits).", ["source"],
            registry=r,
        )
        self.ttft = Histogram(
            p + "ttft_seconds", "Request arrival to first byte written to the client.",
            ["route", "stream"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.leg = Histogram(
            p + "leg_duration_seconds", "Duration of one upstream leg (decode: to its end).",
            ["leg", "result"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.retries = Counter(
            p + "retries", "Upstream retries by reason.", ["reason"], registry=r,
        )
        self.prefill_only = Counter(
            p + "prefill_only", "Client requests served by prefill alone, by route: no "
            "decode replica was healthy (prefillOnlyFallback).", ["route"], registry=r,
        )
        self.prefill_only_mode = Gauge(
            p + "prefill_only_mode", "1 while prefill serves whole requests because no "
            "decode replica is healthy (prefillOnlyFallback), else 0.", registry=r,
        )
        self.handles = Gauge(p + "handles", "Decode handles stored.", registry=r)
        self.evictions = Counter(
            p + "handle_evictions", "Handles removed before use, by reason.", ["reason"],
            registry=r,
        )
        self.residency_calls = Counter(
            p + "residency_calls", "Calls to decode's /bidirkv/residency (lease renewal and "
            "releases) by result: ok, error, unsupported.", ["result"], registry=r,
        )
        self.releases_sent = Counter(
            p + "releases_sent", "Decode request ids sent for release, by call result.",
            ["result"], registry=r,
        )
        self.recalled = Counter(
            p + "recalled_handles", "Handles a starting router put back into its in-process "
            "store from the notes decode kept for it (bidirkv/router/pool/recall.py), per "
            "decode replica.", ["url"], registry=r,
        )
        self.pinned_blocks = Gauge(
            p + "decode_pinned_blocks", "Decode KV blocks pinned by this router's handles.",
            ["url"], registry=r,
        )
        self.decode_blocks = Gauge(
            p + "decode_kv_blocks", "KV blocks of the decode replica (reported by it).",
            ["url"], registry=r,
        )
        self.decode_residency = Gauge(
            p + "decode_residency", "The decode replica's own residency report: retained_"
            "blocks, granted_blocks, free_blocks, grants, and per cause released_<cause> and "
            "refused_<reason> (counts since the engine started).", ["url", "field"],
            registry=r,
        )
        self.store_errors = Counter(
            p + "handle_store_errors", "Shared handle store calls that failed, by operation "
            "(those turns were served without reuse).", ["op"], registry=r,
        )
        self.store_up = Gauge(
            p + "handle_store_up", "1 while the handle store answers (always 1 in-process).",
            registry=r,
        )
        self.store_up.set(1)
        self.store_info = Gauge(
            p + "handle_store_info", "1 for the handle store in use: memory (in this "
            "process) or redis (shared by router replicas).", ["mode"], registry=r,
        )
        self.backend_healthy = Gauge(
            p + "backend_healthy", "1 when the backend is usable.", ["role", "url"], registry=r,
        )
        self.backend_outstanding = Gauge(
            p + "backend_outstanding", "Legs in flight per backend.", ["role", "url"],
            registry=r,
        )
        self.config_reloads = Counter(
            p + "config_reloads", "Config file reloads by result.", ["result"], registry=r,
        )
        # Bound children, so the hot path does no label lookups.
        self._req = Children(self.requests)
        self._reuse = Children(self.reuse)
        # Created up front so every outcome is exported (at zero) from the start.
        self._reuse.update({o: self.reuse.labels(o) for o in REUSE_OUTCOMES})
        self._reuse_kind = Children(self.reuse_kind)
        self._reuse_kind.update({k: self.reuse_kind.labels(k) for k in REUSE_KINDS})
        self._ttft = Children(self.ttft)
        self._leg = Children(self.leg)
        self._placed = Children(self.placements)
        self._reused = Children(self.tokens_reused)
        self._evicted = Children(self.evictions)

    def request(self, route: str, outcome: str) -> None:
        self._req[route, outcome].inc()

    def placed(self, path: str, reason: str) -> None:
        self._placed[path, reason].inc()

    def reused(self, source: str, tokens: int) -> None:
        self._reused[source].inc(tokens)

    def evicted(self, reason: str, n: int) -> None:
        self._evicted[reason].inc(n)

    def reused_from(self, kind: str) -> None:
        self._reuse_kind[kind].inc()

    def reuse_outcome(self, outcome: ReuseOutcome) -> None:
        self._reuse[outcome].inc()

    def observe_ttft(self, route: str, stream: bool, seconds: float) -> None:
        self._ttft[route, "true" if stream else "false"].observe(seconds)

    def observe_leg(self, leg: str, result: str, seconds: float) -> None:
        self._leg[leg, result].observe(seconds)

    def export_residency(self, url: str, replica: Any, pinned: int) -> None:
        self.pinned_blocks.labels(url).set(pinned)
        if replica.num_blocks is not None:
            self.decode_blocks.labels(url).set(replica.num_blocks)
        rep = replica.last
        fields = {"retained_blocks": rep.get("retainedBlocks"),
                  "granted_blocks": rep.get("grantedBlocks"),
                  "free_blocks": rep.get("freeBlocks"), "grants": rep.get("grants"),
                  "shared_reads": rep.get("sharedReads")}
        for prefix, key in (("released_", "released"), ("refused_", "refusals")):
            for cause, n in (rep.get(key) or {}).items():
                fields[prefix + str(cause)] = n
        for name, value in fields.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.decode_residency.labels(url, name).set(value)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
