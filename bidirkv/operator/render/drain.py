"""How an engine pod leaves: its drain cap, its grace period, one pod at a time (pure).

Every pod Kubernetes deletes gets SIGTERM, then SIGKILL once its grace period ran out.
`bidir-kv serve` drains on SIGTERM (bidirkv/connector/drain.py) for at most the cap
rendered here as an env var; vLLM then stops within `engine.terminationGracePeriodSeconds`.
StatefulSet rolling updates replace one pod at a time, waiting for each to be gone and
its successor Ready, so a rollout of N decode pods takes at most N drain caps (plus their
restarts), never N retention periods: a drain ends as soon as the pod holds nothing.
"""

from __future__ import annotations

from typing import Any

from bidirkv.operator.api import spec as api

# Read by the launcher (bidirkv/connector/drain.py DRAIN_ENV; tests hold the two equal).
DRAIN_ENV = "BIDIRKV_DRAIN_SECONDS"
# As the API server stores a StatefulSet's default: one pod at a time, all of them.
UPDATE_STRATEGY: dict[str, Any] = {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}}


def drain_seconds(spec: api.DisaggregatedInferenceSpec, role: str) -> int:
    return getattr(spec, role).drain_seconds


def grace_seconds(spec: api.DisaggregatedInferenceSpec, role: str) -> int:
    """The pod's terminationGracePeriodSeconds: the drain, then vLLM's own stop."""
    return drain_seconds(spec, role) + spec.engine.termination_grace_period_seconds


def drain_env(spec: api.DisaggregatedInferenceSpec, role: str) -> list[dict[str, Any]]:
    return [{"name": DRAIN_ENV, "value": str(drain_seconds(spec, role))}]


def short_drain(spec: api.DisaggregatedInferenceSpec) -> str | None:
    """Why a leaving decode pod may drop conversations it holds (None: it waits as long
    as it retains them): the drain is shorter than decode's retention."""
    drain = drain_seconds(spec, "decode")
    ttl = spec.kv_transfer.decoder_kv_blocks_ttl_seconds
    if drain >= ttl:
        return None
    return (f"spec.decode.drainSeconds {drain} is shorter than "
            f"kvTransfer.decoderKvBlocksTtlSeconds {ttl}: a leaving decode pod stops after "
            f"{drain} s, and the conversations it still holds then recompute their history")
