"""When a conversation comes back, and why a turn that came back reused or did not (pure).

Think time: an agent's turns are not back to back. Between an answer and its
conversation's next turn the benchmark waits a think time drawn, per (seed, conversation,
turn), uniformly from a range, plus a longer pause before chosen turns (a tool call that
takes a minute). Seeded, so two runs (ON and OFF) share the schedule.

Reasons: every measured turn gets one, from what the router, P and D counted around it:
- `hit`: P read the history from D;
- `extended`: the router ran the turn on the decode replica holding the history, which
  extended its own KV (placement `cost` or `thresholds`);
- `first turn`: nothing could be held yet;
- `near expiry`: D refused the read, its blocks were about to reach the retention cap;
- `released under pressure`: D had given the blocks to new work (or its watermark);
- `released by the router`: the router held no live handle for a conversation that had one
  (dropped, superseded, past its TTL), or D refused because the router had released it or
  its lease lapsed;
- `none held`: D did not know the handle's request;
- `dropped`: P failed with the handle and the router retried without it;
- `other`: a handle was offered and nothing was read, for none of the reasons above (e.g.
  fewer tokens than kvRecomputeThreshold);
- `off`: bidirectional transfer is off.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

REASONS = ("hit", "extended", "first turn", "near expiry", "released under pressure",
           "released by the router", "none held", "dropped", "other", "off")
MISSES = tuple(r for r in REASONS if r not in ("hit", "extended", "first turn", "off"))
REUSED = ("hit", "extended")

_REFUSAL_REASON = {
    "near_expiry": "near expiry",
    "released_pressure": "released under pressure",
    "released_watermark": "released under pressure",
    "released_router": "released by the router",
    "released_owner_gone": "released by the router",
    "unknown": "none held",
}


@dataclass(frozen=True)
class Think:
    """Think time between a conversation's answer and its next turn."""
    min_s: float = 0.0
    max_s: float = 0.0
    pause_s: float = 0.0  # added before each turn in pause_turns
    pause_turns: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.min_s <= self.max_s:
            raise ValueError(f"think time {self.min_s}-{self.max_s} s: need 0 <= min <= max")
        if self.pause_s < 0:
            raise ValueError(f"pause {self.pause_s} s: must be >= 0")
        if any(t < 2 for t in self.pause_turns):
            raise ValueError(f"pause turns {list(self.pause_turns)}: a pause comes before a "
                             "later turn, so each must be >= 2")

    def before(self, seed: int, conversation: int, turn: int) -> float:
        """Seconds between the answer to turn-1 and turn `turn` of this conversation."""
        if turn <= 1:
            return 0.0
        pause = self.pause_s if turn in self.pause_turns else 0.0
        if self.max_s <= 0:
            return pause
        digest = hashlib.sha256(f"think/{seed}/{conversation}/{turn}".encode()).digest()
        rng = random.Random(int.from_bytes(digest[:8], "big"))
        return rng.uniform(self.min_s, self.max_s) + pause

    def describe(self) -> str:
        parts = [f"{self.min_s:g}-{self.max_s:g} s think time" if self.max_s > 0 else
                 "no think time"]
        if self.pause_s and self.pause_turns:
            parts.append(f"+{self.pause_s:g} s before turn "
                         + ", ".join(str(t) for t in self.pause_turns))
        return " ".join(parts)


def refusals_delta(before: Mapping | None, after: Mapping | None) -> dict[str, int]:
    """Refusals D counted between two of its residency reports, by reason."""
    if not isinstance(before, Mapping) or not isinstance(after, Mapping):
        return {}
    b, a = before.get("refusals") or {}, after.get("refusals") or {}
    return {k: int(v) - int(b.get(k, 0)) for k, v in a.items() if int(v) > int(b.get(k, 0))}


def reason(turn: int, router_outcome: str | None, reused_tokens: float | None,
           refusals: Mapping[str, int]) -> str:
    """Why this turn reused or not (see the module docstring)."""
    if router_outcome == "off":
        return "off"
    if router_outcome == "extended":
        return "extended"
    if reused_tokens:
        return "hit"
    if turn <= 1:
        return "first turn"
    for key in _REFUSAL_REASON:
        if refusals.get(key):
            return _REFUSAL_REASON[key]
    if router_outcome in ("miss", "expired"):
        return "released by the router"
    if router_outcome == "dropped":
        return "dropped"
    return "other"


def summary(records: list[Mapping], cap_s: float | None = None) -> dict:
    """Turns by reason, and how the turns that came back after a gap fared: those back
    within the retention cap (all of them without a cap) and those beyond it."""
    counts = Counter(rec.get("reason") or "other" for rec in records)
    later = [r for r in records if r.get("turn", 1) > 1 and r.get("gap_s") is not None]
    within = [r for r in later if cap_s is None or r["gap_s"] <= cap_s]
    return {
        # In REASONS order, then any reason this module does not know.
        "by_reason": {k: counts[k] for k in (*REASONS, *sorted(set(counts) - set(REASONS)))
                      if counts[k]},
        "max_gap_s": max((r["gap_s"] for r in later), default=None),
        "cap_s": cap_s,
        "returned_within_cap": len(within),
        "hits_within_cap": sum(1 for r in within if r.get("reason") in REUSED),
        "returned_beyond_cap": len(later) - len(within),
    }


def summary_text(label: str, s: Mapping) -> str:
    reasons = ", ".join(f"{k} {v}" for k, v in s["by_reason"].items()) or "no turns"
    gap = s.get("max_gap_s")
    cap = f"within the {s['cap_s']:g} s retention cap" if s.get("cap_s") else "in all"
    return (f"{label}: {reasons}; longest gap between a conversation's turns "
            f"{gap:.0f} s; {s['hits_within_cap']}/{s['returned_within_cap']} later turns "
            f"back {cap} reused" if gap is not None else f"{label}: {reasons}")
