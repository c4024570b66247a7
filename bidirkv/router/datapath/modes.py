"""A turn's modes: how it may run, resolved from the config once per turn (and once
per round by the loops that depend on them: health's serving mode, upkeep's renewals).
No other data-path module reads these settings from the config.

Of a turn's modes, admission.py reads what it needs to build the turn (whether its prompt
is measured) and conversations.py whether its conversation is looked up; placing.py turns
them into the turn's `Plan`, which is all that the modules after placement read."""

from __future__ import annotations

from dataclasses import dataclass

from bidirkv.router.config import Placement, RouterConfig
from bidirkv.router.pool.backends import Backend
from bidirkv.router.pool.placement import ALWAYS_DISAGGREGATE
from bidirkv.router.pool.selection import Tries


@dataclass(frozen=True)
class Modes:
    """How one turn may run, read from the config once when the turn starts (a reload
    mid-turn changes nothing of it): bidirectional transfer on or off, the placement
    settings, and whether P serves whole requests while no decode replica is healthy."""

    bidirectional: bool
    placement: Placement
    prefill_only_fallback: bool
    # A decision is made per turn: bidirectional transfer on, a policy that may keep a
    # turn on decode. Otherwise every turn takes the prefill leg (plain P/D).
    places: bool


def modes_of(cfg: RouterConfig) -> Modes:
    return Modes(cfg.bidirectional, cfg.placement, cfg.prefill_only_fallback,
                 cfg.bidirectional and cfg.placement.policy != ALWAYS_DISAGGREGATE)


@dataclass(frozen=True)
class Plan:
    """What one turn does and where, made of its modes once, at placement (placing.py)."""

    # No healthy decode replica and prefillOnlyFallback on: P serves the whole turn.
    on_prefill: bool
    # The decode replica that runs the whole turn (its holder extending, or another), if
    # one does; else the two legs.
    whole_on: Backend | None
    # Bidirectional transfer: the decode leg names the owner, the proof and the tenant,
    # and decode's handle is kept for the conversation.
    keeps: bool
    # A placement that may keep a turn on decode: an explicit id's next handle is stored
    # under its messages' prompt key, which the next placement compares.
    keyed: bool
    # The two legs' decode replicas, in the order they are tried.
    decodes: Tries | None = None
    # The role with no healthy replica, when the turn cannot run at all.
    unavailable: str | None = None


# A turn not placed yet: nothing it answers is kept.
UNPLANNED = Plan(on_prefill=False, whole_on=None, keeps=False, keyed=False)
