"""A leaving engine's drain: when `bidir-kv serve` passes SIGTERM on to vLLM (pure).

Passed straight to vLLM, SIGTERM would take with it the KV a decode server retains for
conversations not back yet, each of which would then recompute its whole history. So the
launcher first asks the engine to drain (`"drain": true` on POST /bidirkv/residency: the
router places nothing new there) and signals vLLM only once it holds nothing a peer
could still read, or at the deadline the grace period leaves. A prefill server waits
only for its legs in flight. `decide` is the whole policy; connector/supervise.py does
the signals and calls.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Seconds the launcher may spend draining before it passes SIGTERM on; the operator sets
# it from the role's drain (the pod's grace period minus the time vLLM needs to stop).
DRAIN_ENV = "BIDIRKV_DRAIN_SECONDS"
# Without the variable (a server started by hand): long enough for a conversation at a
# human's pace to come back, short of vLLM's retention.
DEFAULT_DRAIN_S = 60.0
MAX_DRAIN_S = 86400.0
# Consecutive failed residency calls after which the engine is taken as unable to answer
# (still loading its model, or gone): nothing to wait for.
MAX_FAILURES = 5

WAIT = "wait"
FORWARD = "forward"


@dataclass(frozen=True)
class Step:
    action: str  # WAIT or FORWARD
    reason: str  # what the engine still does, or why it stops waiting


def _count(report: Mapping[str, Any], key: str) -> int:
    value = report.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def readable_blocks(report: Mapping[str, Any]) -> int:
    """Retained blocks a peer may still read: held or granted. Blocks being released are
    on their way out (a read of them is refused), so they keep nobody waiting."""
    return max(0, _count(report, "retainedBlocks") - _count(report, "releasingBlocks"))


def decide(report: Mapping[str, Any] | None, failures: int, now: float,
           deadline: float) -> Step:
    """What the launcher does after one poll: `report` is the engine's last answer (None:
    the call failed, `failures` times in a row), `now` and `deadline` on one clock."""
    if now >= deadline:
        return Step(FORWARD, "deadline")
    if report is None:
        return Step(FORWARD, "unreachable") if failures >= MAX_FAILURES else Step(WAIT, "no_answer")
    if readable_blocks(report):
        return Step(WAIT, "held")
    if _count(report, "activeRequests"):
        # A leg in flight: a decode leg ends by retaining its blocks, a prefill leg by
        # answering; either is cut if vLLM stops now.
        return Step(WAIT, "active")
    return Step(FORWARD, "drained")


def drain_seconds(env: Mapping[str, str]) -> float:
    """The drain's cap from the environment; a bad value is refused naming it."""
    raw = env.get(DRAIN_ENV)
    if raw is None or raw == "":
        return DEFAULT_DRAIN_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= MAX_DRAIN_S):
        raise ValueError(f"{DRAIN_ENV}={raw!r}: must be a number of seconds in "
                         f"0-{MAX_DRAIN_S:.0f}")
    return value
