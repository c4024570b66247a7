"""KV transfer and EFA settings of a DisaggregatedInference."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from bidirkv.knobs import KvKnobs
from bidirkv.operator.api.base import Quantity, _Model


class NixlBackend(StrEnum):
    UCX = "UCX"
    LIBFABRIC = "LIBFABRIC"


class KvBufferDevice(StrEnum):
    cuda = "cuda"
    cpu = "cpu"


class LoadFailurePolicy(StrEnum):
    fail = "fail"
    recompute = "recompute"


class KvTransferSpec(KvKnobs, _Model):
    """The knobs decode's retained KV shares with the router (bidirkv/knobs.py), and what
    only the engines' kv-transfer config holds."""

    backend: NixlBackend = Field(
        default=NixlBackend.UCX,
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
    side_channel_port: int = Field(
        default=5600, ge=1024, le=65535,
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
