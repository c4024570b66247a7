"""One client request's state across its legs: `Turn`."""

from __future__ import annotations

from typing import Any

from bidirkv.router.datapath.tracing import UNTRACED, Trace
from bidirkv.router.pool.placement import ON_DECODE, Decision
from bidirkv.router.request.identity import ChatHistory
from bidirkv.router.store.base import Entry


class Turn:
    """One client request's state across its legs."""

    __slots__ = (
        "kind", "stream", "body", "rid", "auth", "tenant", "conv", "entry", "reuse",
        "holder_url", "store_key", "history", "prompt", "t0", "asked_prefill", "placed",
        "new_tokens", "prompt_chars", "prompt_tokens", "trace", "gap", "reuse_counted",
    )

    def __init__(self, kind: str, stream: bool, body: dict[str, Any], rid: str,
                 auth: str | None, tenant: bytes, t0: float, trace: Trace = UNTRACED) -> None:
        self.kind = kind
        self.stream = stream
        self.body = body
        self.rid = rid
        self.auth = auth
        self.tenant = tenant
        self.conv = "-"
        self.entry: Entry | None = None
        self.reuse = "off"
        self.holder_url: str | None = None
        # How to name this conversation when D returns its handle (one of three).
        self.store_key: bytes | None = None
        self.history: ChatHistory | None = None
        self.prompt: str | None = None
        self.t0 = t0
        # Reuse outcomes are counted only for turns that reached P or ran whole on
        # decode, once.
        self.asked_prefill = False
        self.reuse_counted = False
        # Where the turn runs and why (placement.py), and the new tokens it estimated.
        self.placed: Decision | None = None
        self.new_tokens = 0
        self.prompt_chars = 0
        # The prompt's tokens, once prefill reported them (usage.prompt_tokens).
        self.prompt_tokens: int | None = None
        # Its spans (tracing.py): the request's, under which each leg starts its own.
        self.trace = trace
        # The conversation's moving-average idle time with this turn's (returns.py),
        # once a stored handle said when its last answer was kept.
        self.gap: float | None = None

    @property
    def collects(self) -> bool:
        return self.history is not None or self.prompt is not None



def count_reuse(metrics: Any, turn: Turn) -> None:
    """The turn's reuse outcome, once: at its decode leg's first byte (a client that
    reads the counter after its answer finds it there), else when the request ends."""
    if not turn.reuse_counted and (turn.asked_prefill or turn.reuse == "extended"
                                   or turn.placed is not None
                                   and turn.placed.path == ON_DECODE):
        metrics.reuse_outcome(turn.reuse)
        turn.reuse_counted = True



def trace_attributes(turn: Turn) -> dict[str, Any]:
    """What the request became, for its span: its reuse outcome, placement, prompt size."""
    attrs: dict[str, Any] = {
        "bidirkv.stream": turn.stream, "bidirkv.request_id": turn.rid,
        "bidirkv.conversation": turn.conv, "bidirkv.reuse": turn.reuse}
    if turn.placed is not None:
        attrs["bidirkv.placement.decision"] = turn.placed.path
        attrs["bidirkv.placement.reason"] = turn.placed.reason
    if turn.prompt_tokens is not None:
        attrs["gen_ai.usage.input_tokens"] = turn.prompt_tokens
    model = turn.body.get("model")
    if isinstance(model, str):
        attrs["gen_ai.request.model"] = model
    return attrs
