"""One client request's state across its legs: `Turn`.

Each field has one writer, so a reader looking for where a value comes from finds one
place:
- the request as admitted (admission.py, `Intake`, when the turn is built): kind, stream,
  body, rid, auth, t0, trace, modes (modes.py's `modes_of`, once per turn), prompt_chars;
- its conversation (conversations.py, `identify`): tenant, conv, store_key, history,
  prompt, holder_url, gap, parent; `handle` is built with the turn, and only reservation.py
  changes what it holds (the entry, its end, the reuse outcome); prompt_key (keeping.py's
  `extends`, when placement has it hash the messages);
- where it runs (placing.py): plan (what it does, made of its modes: the only part of
  them that the modules after placement read), placed, new_tokens, reads_parent;
- what its legs learnt (legs.py): asked_prefill, prompt_tokens, read_parent.
"""

from __future__ import annotations

from typing import Any

from bidirkv.router.datapath.modes import UNPLANNED, Modes
from bidirkv.router.datapath.parents import Parent
from bidirkv.router.datapath.reservation import Reservation
from bidirkv.router.pool.placement import Decision
from bidirkv.router.request.identity import ChatHistory
from bidirkv.router.tracing.spans import UNTRACED, Trace


class Turn:
    """One client request's state across its legs (see the module docstring for who
    writes what)."""

    __slots__ = (
        "kind", "stream", "body", "rid", "auth", "tenant", "t0", "trace", "modes",
        "prompt_chars", "conv", "store_key", "history", "prompt", "holder_url", "gap",
        "prompt_key", "parent",
        "handle", "plan", "placed", "new_tokens", "reads_parent", "read_parent",
        "asked_prefill", "prompt_tokens",
    )

    def __init__(self, kind: str, stream: bool, body: dict[str, Any], rid: str,
                 auth: str | None, t0: float, modes: Modes,
                 handle: Reservation, trace: Trace = UNTRACED, prompt_chars: int = 0) -> None:
        self.kind = kind
        self.stream = stream
        self.body = body
        self.rid = rid
        self.auth = auth
        self.tenant = b""
        self.t0 = t0
        # Its spans (tracing/spans.py): the request's, under which each leg starts its own.
        self.trace = trace
        self.modes = modes
        # The prompt's length, when a placement will weigh it (a pass over the body).
        self.prompt_chars = prompt_chars
        self.conv = "-"
        # How to name this conversation when D returns its handle (one of three).
        self.store_key: bytes | None = None
        self.history: ChatHistory | None = None
        self.prompt: str | None = None
        self.holder_url: str | None = None
        # An explicit id's turn: its messages' Entry.prompt_key, once placement hashed
        # them (the next handle is stored under it without a second pass).
        self.prompt_key: bytes | None = None
        # The conversation's moving-average idle time with this turn's (returns.py),
        # once a stored handle said when its last answer was kept.
        self.gap: float | None = None
        # Without a handle of its own: where its parent's prefix lives (parents.py).
        self.parent: Parent | None = None
        # The handle taken from the store, if any, and how it ended (reservation.py).
        self.handle = handle
        # What the turn does (modes.py's `Plan`), once placement made it.
        self.plan = UNPLANNED
        # Where the turn runs and why (placement.py), and the new tokens it estimated.
        self.placed: Decision | None = None
        self.new_tokens = 0
        # A child on the two legs: P reads its parent's blocks shared (legs.py), until a
        # prefill leg with them failed; and whether P reported reading any.
        self.reads_parent = False
        self.read_parent = False
        # Reuse outcomes are counted only for turns that reached P or ran whole on
        # decode, once.
        self.asked_prefill = False
        # The prompt's tokens, once prefill reported them (usage.prompt_tokens).
        self.prompt_tokens: int | None = None


def trace_attributes(turn: Turn) -> dict[str, Any]:
    """What the request became, for its span: its reuse outcome, placement, prompt size."""
    attrs: dict[str, Any] = {
        "bidirkv.stream": turn.stream, "bidirkv.request_id": turn.rid,
        "bidirkv.conversation": turn.conv, "bidirkv.reuse": turn.handle.reuse}
    if turn.placed is not None:
        attrs["bidirkv.placement.decision"] = turn.placed.path
        attrs["bidirkv.placement.reason"] = turn.placed.reason
    if turn.prompt_tokens is not None:
        attrs["gen_ai.usage.input_tokens"] = turn.prompt_tokens
    model = turn.body.get("model")
    if isinstance(model, str):
        attrs["gen_ai.request.model"] = model
    return attrs
