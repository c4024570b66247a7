"""Where a turn runs, decided (placement.py decides, from what this router sees of its
replicas); flow.py runs it there.

The turn's modes are read here once, into its plan (modes.py's `Plan`): on P alone, whole
on one decode replica, or the two legs and the decode replicas they try, in order; its
handle kept or not. The plan, the decision and the turn's placement are written here
only: `turn.plan`, `turn.placed`, `turn.new_tokens` and `turn.reads_parent` have no other
writer.
"""

from __future__ import annotations

from bidirkv.router.config import Placement
from bidirkv.router.datapath.context import Context
from bidirkv.router.datapath.keeping import extends
from bidirkv.router.datapath.modes import Plan
from bidirkv.router.datapath.turn import Turn
from bidirkv.router.pool.backends import PREFILL as PREFILL_ROLE
from bidirkv.router.pool.backends import Backend
from bidirkv.router.pool.placement import (
    EXTEND,
    MOVE,
    ON_DECODE,
    PREFILL,
    READ_BACK,
    Decision,
    Inputs,
    new_tokens,
    place,
)
from bidirkv.router.pool.selection import Tries, holder_of, least_outstanding


class Placing:
    """A turn's plan: what it does and on which replicas."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def plan(self, turn: Turn) -> Plan:
        """What the turn does, from its modes (read here only): with no healthy prefill
        replica, nothing; with no healthy decode replica and prefillOnlyFallback, P serves
        it; else where it runs is decided. Under alwaysDisaggregate, or with bidirectional
        transfer off (plain P/D), nothing is decided: every turn takes the prefill leg."""
        ctx = self.ctx
        modes = turn.modes
        if not ctx.prefill.healthy():
            plan = Plan(False, None, keeps=False, keyed=False, unavailable=PREFILL_ROLE)
        else:
            on_prefill = modes.prefill_only_fallback and not ctx.decode.healthy()
            whole_on, busy = self._where(turn, modes.placement) \
                if modes.places and not on_prefill else (None, None)
            plan = Plan(on_prefill, whole_on, keeps=modes.bidirectional, keyed=modes.places,
                        decodes=Tries(ctx.decode, turn.holder_url, busy))
        turn.plan = plan
        return plan

    def _where(self, turn: Turn, policy: Placement) -> tuple[Backend | None, Backend | None]:
        """Decide where the turn runs: the decode replica that takes it whole, if one
        does; and the holder the two legs pass over first, when it is too busy."""
        ctx = self.ctx
        holder = None
        held: int | None = None
        held_chars = 0
        entry = turn.handle.held
        # A turn without a handle of its own may have a parent (parents.py) whose prefix
        # it knows the size of.
        parent = turn.parent if turn.parent is not None and turn.parent.chars else None
        url = entry.decode_url if entry is not None else parent.decode_url if parent else None
        if url is not None:
            found = holder_of(ctx.decode.backends, url, None)
            if found is not None and found.healthy and found.in_pool:
                holder = found
                held_chars = entry.chars if entry is not None else parent.chars
                held = entry.num_tokens if entry is not None else round(
                    held_chars / ctx.costs.chars_per_token)
        turn.new_tokens = new_tokens(turn.prompt_chars, held or 0, ctx.costs.chars_per_token,
                                     held_chars)
        # Read, not picked: the leg's own pick keeps its replicas' rotation.
        p_load = min((b.outstanding for b in ctx.prefill.healthy()), default=0)
        others = [b.outstanding for b in ctx.decode.backends
                  if b.healthy and b.in_pool and not b.draining and b is not holder]
        decision = place(Inputs(held, turn.new_tokens, p_load,
                                holder.outstanding if holder else 0,
                                extends_held=parent is not None or entry is not None
                                and extends(turn, entry, ctx.keys),
                                other_inflight=min(others, default=None),
                                sized=ctx.costs.sized,
                                holder_draining=holder is not None and holder.draining),
                         policy, ctx.costs.costs)
        turn.placed = decision
        # A child's two legs: P reads the parent's blocks shared (legs.py).
        turn.reads_parent = parent is not None and decision.path in (READ_BACK, MOVE)
        ctx.metrics.placed(decision.path, decision.reason)
        if decision.path == EXTEND:
            return holder, None
        if decision.path == ON_DECODE:
            return least_outstanding([b for b in ctx.decode.backends if b.in_pool],
                                     ctx.decode.next_start()), None
        if decision.path == MOVE:  # another replica decodes the turn (a retry may go back)
            return None, holder_of(ctx.decode.backends, turn.holder_url, None)
        return None, None

    @staticmethod
    def parent_read_failed(turn: Turn) -> None:
        """A prefill leg that read the parent's blocks shared failed: the retry does not."""
        turn.reads_parent = False

    @staticmethod
    def extend_failed(turn: Turn) -> None:
        """The whole turn on decode failed before a byte: it takes the two legs."""
        turn.placed = Decision(PREFILL, "extend_failed")
