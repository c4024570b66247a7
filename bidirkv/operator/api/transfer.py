"""KV transfer and EFA settings of a DisaggregatedInference."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from bidirkv.operator.api.base import Quantity, _Model


class Backend(StrEnum):
    UCX = "UCX"
    LIBFABRIC = "LIBFABRIC"


class KvBufferDevice(StrEnum):
    cuda = "cuda"
    cpu = "cpu"


class LoadFailurePolicy(StrEnum):
    fail = "fail"
    recompute = "recompute"


class KvTransferSpec(_Model):
    bidirectional: bool = Field(
        default=True,
        description="Decode keeps each finished request's KV and prefill reads it back on the "
        "next turn (vLLM `bidirectional_kv_xfer`, set identically on both roles).",
    )
    decoder_kv_blocks_ttl_seconds: int = Field(
        default=480,
        ge=10,
        le=86400,
        description="How long decode pins a finished request's blocks for reuse; fixed, not "
        "renewed (vLLM `decoder_kv_blocks_ttl`).",
    )
    kv_recompute_threshold: int = Field(
        default=64,
        ge=0,
        le=10_000_000,
        description="Prefill reads decode's KV only when at least this many tokens are "
        "reusable; shorter prefixes are recomputed (vLLM `kv_recompute_threshold`).",
    )
    backend: Backend = Field(
        default=Backend.UCX,
        description="NIXL backend (vLLM `kv_connector_extra_config.backends`): UCX, or "
        "LIBFABRIC on EFA (UCX over EFA silently falls back to TCP).",
    )
    kv_buffer_device: KvBufferDevice | None = Field(
        default=None,
        description="Where the connector stages KV (vLLM `kv_buffer_device`): `cuda` on "
        "GPUs; `cpu` for the CPU build of vLLM. Unset: vLLM's default for the platform.",
    )
    load_failure_policy: LoadFailurePolicy = Field(
        default=LoadFailurePolicy.recompute,
        description="What prefill does when a KV read fails or expires (vLLM "
        "`kv_load_failure_policy`). vLLM's own default is `fail`; `recompute` serves the "
        "request from scratch instead of erroring.",
    )
    retention_watermark: float = Field(
        default=0.9,
        ge=0.05,
        le=1,
        description="Share of each decode replica's KV blocks that retained conversations may "
        "pin. Above it the router releases the ones expected back last (overdue ones first), "
        "and decode "
        "enforces the same bound itself. Whatever the value, a request waiting for blocks "
        "takes retained ones first: retention never makes new work wait. Lower values "
        "release conversations that would have come back (measured: 0.5 lost most reuse "
        "under pressure, 0.9 and 1.0 kept it).",
    )
    owner_lease_seconds: int = Field(
        default=30,
        ge=10,
        le=3600,
        description="Decode frees the retained blocks of a router that has not renewed its "
        "lease for this long (the router renews every 5 s; a router that is gone or "
        "restarted stops). Must not exceed `decoderKvBlocksTtlSeconds`.",
    )
    side_channel_port: int = Field(
        default=5600,
        ge=1024,
        le=65535,
        description="NIXL handshake port in every engine pod (VLLM_NIXL_SIDE_CHANNEL_PORT).",
    )


class EfaSpec(_Model):
    enabled: bool = Field(
        default=False,
        description="Run the KV transfer over AWS EFA: FI_* environment, IPC_LOCK, "
        "memory-backed /dev/shm, prefill and decode on different nodes. Needs backend "
        "LIBFABRIC and `efaDevices` >= 1 on both roles.",
    )
    hugepages_2mi: Quantity | None = Field(
        default=None,
        alias="hugepages2Mi",
        description="hugepages-2Mi per engine pod (e.g. `5Gi`); sets FI_EFA_USE_HUGE_PAGE=1.",
    )
    shm_size: Quantity = Field(
        default="16Gi", description="Size limit of the memory-backed /dev/shm of engine pods."
    )
