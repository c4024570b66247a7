"""Engine pods that are leaving: which drain, until when, and whose drain ran out (pure).

A deleted pod gets a deletionTimestamp and SIGTERM; `bidir-kv serve` then drains
(connector/drain.py) for at most the cap rendered in its env (render/drain.py). So the
pod itself says when its drain started, its deadline, and whether it outlived it (a
drain that ends early lets vLLM stop before the deadline). The pass that first sees a
pod past its deadline marks it `timedOut` and says so in one `DrainTimedOut` Event.
What a draining decode pod still holds only its engine says (heldcount.py): its entry
keeps the last good reading (`conversations`), and the role sums them.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bidirkv.operator.render.drain import DRAIN_ENV
from bidirkv.roleconfig import ROLES

# The event's reason and the condition's type.
DRAIN_TIMED_OUT = "DrainTimedOut"
DRAINING = "Draining"
# While pods drain, the operator looks again at least this often (seconds): a pod may
# start or end its drain without a change of its StatefulSet.
RECHECK_S = 10.0
_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def parse_time(value: Any) -> dt.datetime | None:
    """An RFC 3339 time as the API server writes it (seconds, UTC); None if not one."""
    if not isinstance(value, str):
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(dt.UTC)
    except ValueError:
        return None


def format_time(value: dt.datetime) -> str:
    return value.astimezone(dt.UTC).strftime(_FORMAT)


@dataclass(frozen=True)
class Leaving:
    name: str
    deadline: dt.datetime  # when its launcher stops waiting


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, int | float) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


def _drain_cap(pod: Mapping[str, Any]) -> float | None:
    """The pod's drain cap: its engine container's DRAIN_ENV (None: not set there)."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for env in container.get("env") or []:
            if env.get("name") == DRAIN_ENV:
                return _seconds(env.get("value"))
    return None


def leaving(pod: Mapping[str, Any]) -> Leaving | None:
    """The pod's drain, when it is being deleted (None: it is not, or says too little).

    The drain started when the pod was deleted: its deletionTimestamp less the grace
    period it was given (`deletionGracePeriodSeconds`, else its spec's). It lasts the
    drain cap, or the grace period when that is shorter (`kubectl delete --grace-period`,
    an eviction with its own)."""
    meta = pod.get("metadata") or {}
    end = parse_time(meta.get("deletionTimestamp"))
    if end is None or not meta.get("name"):
        return None
    grace = _seconds(meta.get("deletionGracePeriodSeconds"))
    if grace is None:
        grace = _seconds((pod.get("spec") or {}).get("terminationGracePeriodSeconds"))
    if grace is None:
        grace = 30.0  # Kubernetes' default grace period
    start = end - dt.timedelta(seconds=grace)
    cap = _drain_cap(pod)
    drain = grace if cap is None else min(cap, grace)
    return Leaving(meta["name"], start + dt.timedelta(seconds=drain))


def draining_pods(pods: Sequence[Mapping[str, Any]], previous: Mapping[str, Any] | None,
                  now: dt.datetime, held: Mapping[str, int] | None = None
                  ) -> list[dict[str, Any]]:
    """The role's draining pods as its status lists them, by name: each with its deadline,
    whether it outlived it (`previous`: the role's last status, whose marks stay) and the
    conversations it holds (`held`: this pass's readings by pod name; without one, the
    last reading of the same drain stays)."""
    before = {p.get("name"): p for p in (previous or {}).get("drainingPods") or []}
    out = []
    for pod in pods:
        drain = leaving(pod)
        if drain is None:
            continue
        deadline = format_time(drain.deadline)
        old = before.get(drain.name) or {}
        same = old.get("deadline") == deadline
        timed_out = now >= drain.deadline or (same and old.get("timedOut") is True)
        entry: dict[str, Any] = {"name": drain.name, "deadline": deadline,
                                 "timedOut": timed_out}
        count = (held or {}).get(drain.name)
        if count is None and same:
            count = old.get("conversations")
        if _is_count(count):
            entry["conversations"] = count
        out.append(entry)
    return sorted(out, key=lambda p: p["name"])


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def role_drains(listed: list[dict[str, Any]]) -> dict[str, Any]:
    """The role's status fields of its draining pods: their number, the pods, the
    conversations they hold (summed over the pods with a reading; absent when none has
    one) and the printer column's summary: `0`, `2` (counts unknown), `2 (5 held)`, or
    `2 (5+ held)` when some pod's count is unknown."""
    counts = [p["conversations"] for p in listed if _is_count(p.get("conversations"))]
    out: dict[str, Any] = {"draining": len(listed), "drainingPods": listed}
    summary = str(len(listed))
    if counts:
        total = sum(counts)
        out["drainingConversations"] = total
        summary += f" ({total}{'+' if len(counts) < len(listed) else ''} held)"
    out["drainingSummary"] = summary
    return out


def _conversations(n: int) -> str:
    return f"{n} conversation{'' if n == 1 else 's'}"


def newly_timed_out(previous: Mapping[str, Any], status: Mapping[str, Any]
                    ) -> list[tuple[str, dict[str, Any]]]:
    """(role, pod) of each pod this status first marks as timed out: one Event each."""
    out = []
    for role in ROLES:
        before = {(p.get("name"), p.get("deadline")): p.get("timedOut") is True
                  for p in ((previous.get(role) or {}).get("drainingPods") or [])}
        for pod in (status.get(role) or {}).get("drainingPods") or []:
            if pod["timedOut"] and not before.get((pod["name"], pod["deadline"]), False):
                out.append((role, pod))
    return out


def timed_out_message(role: str, pod: Mapping[str, Any], drain_seconds: int | None) -> str:
    cap = f"spec.{role}.drainSeconds {drain_seconds}" if drain_seconds is not None \
        else "its drain cap"
    count = pod.get("conversations")
    if role != "decode":
        lost = "the legs it still served fail"
    elif _is_count(count):
        lost = (f"it still held {_conversations(count)} at its last reading; "
                f"{'it recomputes its' if count == 1 else 'they recompute their'} history "
                "on the next turn")
    else:
        lost = "the conversations it still held recompute their history on their next turn"
    return (f"{role} pod {pod['name']} was still draining at its deadline "
            f"{pod['deadline']} ({cap}): {lost}")


def draining_condition(status: Mapping[str, Any]) -> tuple[bool, str, str]:
    """(any pod drains, reason, message) of the Draining condition."""
    parts = []
    for role in ROLES:
        pods = (status.get(role) or {}).get("drainingPods") or []
        if pods:
            names = ", ".join(_draining_pod(p) for p in pods)
            what = ("its conversations move to the other replicas on their next turn"
                    if role == "decode" else "no new legs, its legs in flight finish")
            parts.append(f"{role}: {names}: {what}")
    if not parts:
        return False, "NoneDraining", "no engine pod is leaving"
    return True, DRAINING, "; ".join(parts)


def _draining_pod(pod: Mapping[str, Any]) -> str:
    """`decode-1 holds 3 conversations (until T)`, `decode-1 (until T, timed out, still
    held 3 conversations)`, or without a reading `decode-1 (until T)`."""
    count = pod.get("conversations")
    known = _is_count(count)
    if pod.get("timedOut"):
        held = f", still held {_conversations(count)}" if known else ""
        return f"{pod['name']} (until {pod['deadline']}, timed out{held})"
    holds = f" holds {_conversations(count)}" if known else ""
    return f"{pod['name']}{holds} (until {pod['deadline']})"


def next_look(status: Mapping[str, Any], now: dt.datetime) -> float | None:
    """Seconds until the operator should look again at the draining pods (None: none
    drains): the next deadline not yet passed, and at most RECHECK_S."""
    waits = []
    for role in ROLES:
        for pod in (status.get(role) or {}).get("drainingPods") or []:
            waits.append(RECHECK_S)
            deadline = parse_time(pod.get("deadline"))
            if deadline is not None and not pod.get("timedOut"):
                waits.append(max(0.5, (deadline - now).total_seconds() + 0.5))
    return min(waits) if waits else None
