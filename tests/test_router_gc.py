"""The router process's collector, settled once it listens (app.settle_gc)."""

from __future__ import annotations

import gc

from bidirkv.router.server.app import GC_YOUNG_THRESHOLD, settle_gc


def test_what_the_router_holds_at_start_is_frozen_and_young_passes_are_spaced():
    before = gc.get_threshold()
    try:
        settle_gc()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *before[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
