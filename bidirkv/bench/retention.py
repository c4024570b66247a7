"""The yardsticks for decode's retention choices under KV pressure: on the trace a
concurrent run recorded, how many returning turns would have found their KV still
kept by a decode of the same capacity that releases least recently kept first (LRU),
that follows decode's own rule from the past alone (`value`: bidirkv/returns.py, with
the gaps the router would have measured), or that knows the future and releases the
conversation coming back last (Belady's rule, the usual offline bound; with blocks of
different sizes it is near, not at, the best).

Pure: the run's records in, counts out. The model is decode's: a request holds its
blocks from its start to its end; a finished one is kept for its conversation's next
turn, which reuses it (a hit) if it is still kept when that turn starts; when held and
kept blocks exceed the capacity, kept conversations are released until they fit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from bidirkv.returns import next_gap, release_key

POLICIES = ("lru", "value", "oracle")


@dataclass(frozen=True)
class Request:
    conversation: int
    turn: int
    start: float
    end: float
    blocks: int  # what it holds while it runs, and what is kept after


@dataclass(frozen=True)
class Outcome:
    policy: str
    hits: int
    returning: int  # turns after a conversation's first: the most that could hit
    releases: int


def requests_of(records: Iterable[Mapping[str, Any]], block_tokens: int,
                output_tokens: int) -> list[Request]:
    """The run's successful requests with the blocks their prompt and reply take."""
    out = []
    for r in records:
        if r.get("error") is not None or r.get("total_s") is None or not r.get(
                "context_tokens"):
            continue
        blocks = math.ceil((r["context_tokens"] + output_tokens) / block_tokens)
        out.append(Request(r["conversation"], r["turn"], r["start_s"],
                           r["start_s"] + r["total_s"], blocks))
    return out


def simulate(requests: list[Request], capacity_blocks: int, policy: str) -> Outcome:
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: must be one of {', '.join(POLICIES)}")
    # Ends before starts at the same instant: a turn sent as the last answer ends sees it.
    events = sorted([(r.start, 1, i) for i, r in enumerate(requests)]
                    + [(r.end, 0, i) for i, r in enumerate(requests)])
    starts_of: dict[int, list[float]] = {}
    for r in requests:
        starts_of.setdefault(r.conversation, []).append(r.start)
    kept: dict[int, tuple[int, float]] = {}  # conversation -> (blocks, kept since)
    held = hits = releases = 0
    # What the router knows (each conversation's last answer and gap) and decode's prior
    # for a conversation without one: only the past, as in a real run.
    last_end: dict[int, float] = {}
    gaps: dict[int, float] = {}
    prior: float | None = None

    def next_start(conv: int, now: float) -> float:
        return min((s for s in starts_of[conv] if s > now), default=math.inf)

    def make_room(now: float) -> None:
        nonlocal releases
        while kept and held + sum(b for b, _ in kept.values()) > capacity_blocks:
            if policy == "lru":
                victim = min(kept, key=lambda c: kept[c][1])
            elif policy == "value":
                victim = max(kept, key=lambda c: release_key(
                    now, kept[c][1], gaps.get(c, prior or 0.0)))
            else:
                victim = max(kept, key=lambda c: (next_start(c, now), kept[c][0]))
            del kept[victim]
            releases += 1

    for now, is_start, i in events:
        r = requests[i]
        if is_start:
            if r.conversation in last_end:
                gaps[r.conversation] = next_gap(gaps.get(r.conversation),
                                                now - last_end[r.conversation])
            if r.conversation in kept:
                hits += 1
                del kept[r.conversation]  # its blocks now belong to the running request
            held += r.blocks
            make_room(now)
        else:
            held -= r.blocks
            last_end[r.conversation] = now
            if r.conversation in gaps:
                prior = next_gap(prior, gaps[r.conversation])
            kept[r.conversation] = (r.blocks, now)
            make_room(now)
    returning = sum(1 for r in requests if r.turn > 1)
    return Outcome(policy, hits, returning, releases)


def yardsticks(records: Iterable[Mapping[str, Any]], capacity_blocks: int, block_tokens: int,
               output_tokens: int) -> dict[str, Outcome]:
    reqs = requests_of(records, block_tokens, output_tokens)
    return {p: simulate(reqs, capacity_blocks, p) for p in POLICIES}
