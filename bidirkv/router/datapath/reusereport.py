"""What P says about a reuse turn: the hook where reuse accounting reads P's reply.
(P's side of a reuse turn, which writes this report, is bidirkv/connector/core/reuse.py.)

P's answer may carry a report, written by the connector plugin into P's
`kv_transfer_params` (or at the top level of P's body) as
    "bidirkv": {"reused_tokens": int, "offered_tokens": int, "verified": bool}
`reused_tokens` is how many tokens P read from D instead of recomputing, and
`offered_tokens` how many the handle offered; fewer reused than offered means P checked the
tokens and reused only the part that matched ("verified-partial"). Without a report the
only number available is usage.prompt_tokens_details.cached_tokens, which also counts P's
own prefix-cache hits, so it is exported under its own label.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class ReuseReport(NamedTuple):
    reused_tokens: int | None
    source: str
    partial: bool


def _count(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def reuse_report(prefill_body: dict[str, Any]) -> ReuseReport | None:
    kv = prefill_body.get("kv_transfer_params")
    info = kv.get("bidirkv") if isinstance(kv, dict) else None
    if not isinstance(info, dict):
        info = prefill_body.get("bidirkv")
    if isinstance(info, dict):
        reused = _count(info.get("reused_tokens"))
        offered = _count(info.get("offered_tokens"))
        partial = reused is not None and offered is not None and reused < offered
        return ReuseReport(reused, "bidirkv", partial)
    usage = prefill_body.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    if cached is not None:
        return ReuseReport(cached, "usage_cached", False)
    return None


class PrefillWork(NamedTuple):
    prompt_tokens: int
    computed: int  # tokens P prefilled
    read: int  # tokens P read from decode instead


def prefill_work(prefill_body: dict[str, Any]) -> PrefillWork | None:
    """What P's leg did, for the placement's cost model (None: P did not say)."""
    usage = prefill_body.get("usage")
    prompt = _count(usage.get("prompt_tokens")) if isinstance(usage, dict) else None
    if not prompt:
        return None
    kv = prefill_body.get("kv_transfer_params")
    info = kv.get("bidirkv") if isinstance(kv, dict) else None
    if isinstance(info, dict):
        read = _count(info.get("reused_tokens")) or 0
        computed = _count(info.get("recomputed_tokens"))
        return PrefillWork(prompt, computed if computed is not None else prompt - read, read)
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return PrefillWork(prompt, prompt - (cached or 0), 0)
