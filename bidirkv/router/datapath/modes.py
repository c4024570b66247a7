"""A turn's modes: how it may run, resolved from the config once per turn (and once
per round by the loops that depend on them: health's serving mode, upkeep's renewals).
No other data-path module reads these settings from the config."""

from __future__ import annotations

from dataclasses import dataclass

from bidirkv.router.config import Placement, RouterConfig
from bidirkv.router.pool.placement import ALWAYS_DISAGGREGATE


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
