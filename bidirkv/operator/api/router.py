"""The router of a DisaggregatedInference."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from bidirkv.operator.api.base import _Model

# P declines a remote read this close to D's deadline, so a router handle must expire
# at least this much earlier than the decoder blocks it points at.
TTL_SAFETY_MARGIN_SECONDS = 10


class ServiceType(StrEnum):
    ClusterIP = "ClusterIP"
    NodePort = "NodePort"
    LoadBalancer = "LoadBalancer"


class PlacementPolicy(StrEnum):
    cost = "cost"
    alwaysDisaggregate = "alwaysDisaggregate"
    thresholds = "thresholds"


class PlacementSpec(_Model):
    policy: PlacementPolicy = Field(
        default=PlacementPolicy.cost,
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
    max_local_prefill_tokens: int = Field(
        default=1024,
        ge=0,
        le=1_048_576,
        description="Most new tokens a decode replica prefills for one turn under any "
        "policy: keeps the inter-token latency of what it is decoding bounded. 0: never.",
    )
    decode_busy_requests: int = Field(
        default=4,
        ge=1,
        le=100_000,
        description="A decode replica with this many requests in flight from this router "
        "is busy: it prefills nothing for a turn, and a turn it holds takes the prefill "
        "leg, decoded by a less busy replica where there is one.",
    )
    local_prefill_tokens: int = Field(
        default=256,
        ge=0,
        le=1_048_576,
        description="`thresholds`: extend on decode at most this many new tokens (like "
        "llm-d's `nonCachedTokens`). At most `maxLocalPrefillTokens`.",
    )
    prefill_busy_requests: int = Field(
        default=2,
        ge=1,
        le=100_000,
        description="`thresholds`: with this many requests in flight on prefill, extend on "
        "decode up to `maxLocalPrefillTokens` new tokens.",
    )


class SecretKeyRef(_Model):
    name: str = Field(min_length=1, max_length=253, description="Secret name.")
    key: str = Field(min_length=1, max_length=253, description="Key in the Secret.")


class HandleStoreSpec(_Model):
    url: str = Field(
        pattern=r"^rediss?://[^/@\s]+(/[0-9]{1,2})?$",
        max_length=512,
        description="Redis-protocol server shared by the router replicas (Valkey, Redis, "
        "ElastiCache without cluster mode): `redis://HOST:PORT/DB`, `rediss://` for TLS. "
        "No password here: use `passwordSecretRef`.",
    )
    password_secret_ref: SecretKeyRef | None = Field(
        default=None, description="Where the store's password is (read by the router pods)."
    )


class RouterSpec(_Model):
    replicas: int = Field(default=1, ge=1, le=64, description="Router pods.")
    image: str = Field(
        default="bidir-kv:0.1.0",
        min_length=1,
        description="Router image (the bidir-kv image; command `bidir-kv router`).",
    )
    port: int = Field(default=8000, ge=1, le=65535, description="Router service port.")
    service_type: ServiceType = Field(
        default=ServiceType.ClusterIP, description="Kubernetes Service type of the router."
    )
    conversation_ttl_seconds: int = Field(
        default=420,
        ge=1,
        le=86400,
        description="How long the router keeps a conversation's decode handle. Must be at "
        f"least {TTL_SAFETY_MARGIN_SECONDS} s below `kvTransfer.decoderKvBlocksTtlSeconds`, "
        "so the router never hands out blocks decode is about to free.",
    )
    max_conversations: int = Field(
        default=100_000,
        ge=1,
        le=10_000_000,
        description="Most conversation handles kept per router; past it the least recently "
        "stored handle of the tenant holding the most is dropped.",
    )
    max_conversations_per_tenant: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="Most conversation handles one tenant may keep (its least recently "
        "used dropped first); unset: up to `maxConversations`. Whatever the caps, the "
        "`maxConversations` bound and the retention watermark evict from the tenant "
        "holding the most.",
    )
    tenant_retention_share: float = Field(
        default=1.0,
        ge=0.01,
        le=1,
        description="Share of each decode replica's retention budget "
        "(`kvTransfer.retentionWatermark` of its KV blocks) that one tenant's "
        "conversations may pin.",
    )
    prefill_only_fallback: bool = Field(
        default=True,
        description="With no healthy decode replica, prefill serves whole requests itself "
        "(no KV kept for reuse) instead of the router answering 503; `/ready` says so.",
    )
    handle_store: HandleStoreSpec | None = Field(
        default=None,
        description="Share conversation handles between router replicas (and across router "
        "restarts) through a Redis-protocol store. Required when `replicas` > 1.",
    )
    placement: PlacementSpec = Field(
        default_factory=PlacementSpec,
        description="Per-turn placement: extend a conversation on the decode replica that "
        "holds it, or take the prefill leg.",
    )
