"""The plugin's settings: `BIDIRKV_*` environment variables of the engine pod.

The CPU knobs default to `auto`: on for vLLM's CPU platform, where the problems they fix
were measured (see docs/protocol.md, section 5), and untouched elsewhere, where vLLM's defaults were
tuned for accelerators. A value that does not parse falls back to `auto` with a
warning: a typo must not take a serving pod down.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from bidirkv.knobs import OwnerLeaseSeconds, RetentionWatermark, default_of

log = logging.getLogger("vllm.bidirkv")

TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off"}
AUTO = {"", "auto"}
# Engine-loop wait while the scheduler only holds finished requests' blocks. Long enough
# to free the core, short enough that freeing blocks after a peer's read, lease expiry
# and UCX progress without the NIXL thread stay prompt.
CPU_IDLE_POLL_MS = 20
# How long NIXL's progress thread sleeps at most when UCX signals no event (a read by a
# peer arrives as one, over the TCP lane); only a fallback, so idle servers stay idle.
CPU_PROGRESS_WAIT_US = 100_000
MAX_IDLE_POLL_MS = 1000


def _tristate(env: Mapping[str, str], name: str) -> bool | None:
    raw = env.get(name, "").strip().lower()
    if raw in AUTO:
        return None
    if raw in TRUE:
        return True
    if raw in FALSE:
        return False
    log.warning("bidir-kv: %s=%r is not one of auto, 1, 0; using auto", name, raw)
    return None


def _knob(env: Mapping[str, str], name: str, knob: Any) -> Any:
    """A knob the operator also renders (bidirkv/knobs.py): its type, bounds and default."""
    default = default_of(knob)
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        # JSON reads "45" as an integer and "0.3" as a number, as the CRD's schema does.
        return TypeAdapter(knob).validate_json(raw)
    except ValidationError as exc:
        problem = exc.errors(include_url=False)[0]["msg"]
    log.warning("bidir-kv: %s=%r: %s; using %s", name, raw, problem, default)
    return default


def _ms(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip().lower()
    if raw in AUTO:
        return None
    if raw.isdigit() and int(raw) <= MAX_IDLE_POLL_MS:
        return int(raw)
    log.warning("bidir-kv: %s=%r is not auto or 0-%d (ms); using auto", name, raw,
                MAX_IDLE_POLL_MS)
    return None


def bind_cores(bind: str) -> frozenset[int] | None:
    """The cores VLLM_CPU_OMP_THREADS_BIND names ("0", "0-3", "0,2|4-7": one list per
    rank), or None where vLLM chooses ("auto", "nobind") or the value is not understood."""
    cores: set[int] = set()
    for part in bind.replace("|", ",").split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return None
        cores.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cores) or None


@dataclass(frozen=True)
class Settings:
    """Raw settings; `None` means auto (decided per platform by `resolve`)."""

    keep_affinity: bool | None = None
    nixl_progress_thread: bool | None = None
    idle_poll_ms: int | None = None
    stream_params: bool = True
    pin_engine_core: bool | None = None
    omp_threads_bind: str = "auto"
    handle_key: bytes | None = None
    # Accepted besides handle_key while a rotation rolls out (never used to sign).
    handle_key_previous: bytes | None = None
    # Decode residency (residency.py): how long a router's handles outlive its last
    # heartbeat, and the share of decode's KV that retained blocks may pin.
    owner_lease_s: float = default_of(OwnerLeaseSeconds)
    retention_watermark: float = default_of(RetentionWatermark)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        key = env.get("BIDIRKV_HANDLE_KEY", "").strip()
        previous = env.get("BIDIRKV_HANDLE_KEY_PREVIOUS", "").strip()
        return cls(
            keep_affinity=_tristate(env, "BIDIRKV_CPU_KEEP_AFFINITY"),
            nixl_progress_thread=_tristate(env, "BIDIRKV_NIXL_PROGRESS_THREAD"),
            idle_poll_ms=_ms(env, "BIDIRKV_IDLE_POLL_MS"),
            stream_params=_tristate(env, "BIDIRKV_STREAM_PARAMS") is not False,
            pin_engine_core=_tristate(env, "BIDIRKV_CPU_PIN_ENGINE_CORE"),
            omp_threads_bind=env.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
            handle_key=key.encode() if key else None,
            handle_key_previous=previous.encode() if previous else None,
            owner_lease_s=_knob(env, "BIDIRKV_OWNER_LEASE_SECONDS", OwnerLeaseSeconds),
            retention_watermark=_knob(env, "BIDIRKV_RETENTION_WATERMARK", RetentionWatermark),
        )

    @property
    def handle_keys(self) -> tuple[bytes, ...]:
        """Keys a handle may be signed with: the current one first."""
        return tuple(k for k in (self.handle_key, self.handle_key_previous) if k)

    def resolve(self, is_cpu: bool) -> Resolved:
        return Resolved(
            # vLLM only re-pins on the CPU platform, so keeping the binding is a no-op
            # elsewhere either way.
            keep_affinity=self.keep_affinity is not False,
            # None: leave vLLM's choice (the thread is on) alone.
            # On CPU the thread is on, with a wait (patches/cpu.py); None: leave vLLM's
            # choice (the thread is on, NIXL polling without a wait) alone.
            nixl_progress_thread=(
                self.nixl_progress_thread
                if self.nixl_progress_thread is not None
                else (True if is_cpu else None)
            ),
            nixl_progress_wait_us=CPU_PROGRESS_WAIT_US if is_cpu else 0,
            idle_poll_ms=(
                self.idle_poll_ms
                if self.idle_poll_ms is not None
                else (CPU_IDLE_POLL_MS if is_cpu else 0)
            ),
            stream_params=self.stream_params,
            # Only where vLLM pins the workers to cores the spec names (CPU platform).
            engine_core_cores=(
                bind_cores(self.omp_threads_bind)
                if is_cpu and self.pin_engine_core is not False else None
            ),
        )


@dataclass(frozen=True)
class Resolved:
    keep_affinity: bool
    nixl_progress_thread: bool | None
    idle_poll_ms: int
    stream_params: bool
    engine_core_cores: frozenset[int] | None = None
    nixl_progress_wait_us: int = 0
