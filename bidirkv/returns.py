"""When a kept conversation is expected back: the router's estimate, and the order decode
releases retained KV in. Shared by both sides of the wire (the router sends the estimate
as `RETURN_KEY`, decode ranks by it) and by the benchmark that replays a run.

Least recently kept first is the worst order for agents taken in turn: the conversation
kept longest ago is about to come back. Here Belady's rule (release the one coming back
last) runs on a prediction: a conversation is expected back one gap after its last
answer (a moving average of its own idle times; without one, the others' typical gap, so
the newest goes first), and one idle well past its gap is overdue, likely finished:
overdue ones go first, longest overdue first. Pure functions of times and gaps.
"""

from __future__ import annotations

import math

# Weight of the newest gap in a conversation's moving average.
GAP_WEIGHT = 0.5
# Overdue: idle for more than this many of its gaps, plus a floor that keeps a burst of
# fast turns from marking every short pause overdue.
OVERDUE_GAPS = 3.0
OVERDUE_FLOOR_S = 10.0
# The largest gap the wire carries (a day); decode clamps what it receives to it.
MAX_GAP_S = 86_400.0


def next_gap(gap: float | None, idle_s: float) -> float:
    """The moving average after one more observed idle time (None: the first)."""
    idle_s = min(max(idle_s, 0.0), MAX_GAP_S)
    return idle_s if gap is None else GAP_WEIGHT * idle_s + (1 - GAP_WEIGHT) * gap


def gap_of(value: object) -> float | None:
    """A gap as it came over the wire: a finite number of seconds in [0, MAX_GAP_S]
    (anything else: no estimate)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        gap = float(value)  # an int past float's range raises
    except OverflowError:
        return None
    if not math.isfinite(gap) or gap < 0:
        return None
    return min(gap, MAX_GAP_S)


def expected_at(kept_at: float, gap: float) -> float:
    """When a conversation kept at `kept_at` is expected back."""
    return kept_at + gap


def overdue_at(kept_at: float, gap: float, expires: float = math.inf) -> float:
    """From when it counts as overdue (most likely finished): past 3 gaps and the floor,
    or past its expiry, whichever comes first (an expired one is worth nothing)."""
    return min(kept_at + OVERDUE_GAPS * gap + OVERDUE_FLOOR_S, expires)


def release_key(now: float, kept_at: float, gap: float,
                expires: float = math.inf) -> tuple[int, float]:
    """Sort key of a kept conversation: the largest is released first. Overdue ones
    first, the longest overdue first; then the one expected back last. Both orders are
    fixed once the entry is kept, so a store can index them (two sorted sets)."""
    due = overdue_at(kept_at, gap, expires)
    if now > due:
        return (1, -due)
    return (0, expected_at(kept_at, gap))
