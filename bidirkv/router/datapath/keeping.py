"""The next handle kept (`store_handle`): what decode hands back at the end of a turn's
answer, stored for its conversation's next turn (or released on decode when nobody will
send it); what that handle holds of the prompt, and whether a new prompt extends it
(placing.py asks)."""

from __future__ import annotations

import logging
from typing import Any

from bidirkv.router.codec import dumps_kept
from bidirkv.router.datapath.context import Context
from bidirkv.router.datapath.turn import Turn
from bidirkv.router.engine.bodies import handle_blocks, shared_blocks
from bidirkv.router.engine.sse import MessageCollector
from bidirkv.router.pool.backends import Backend
from bidirkv.router.pool.placement import message_chars
from bidirkv.router.request.identity import LookupKeys, accounting_tenant
from bidirkv.router.request.validation import CHAT
from bidirkv.router.store.base import Entry, Kept, StoreUnavailable, quietly
from bidirkv.wire import VERSION_KEY, version_problem

log = logging.getLogger("bidirkv.router")


async def store_handle(ctx: Context, turn: Turn, d: Backend, params: dict[str, Any],
                       collector: MessageCollector | None) -> None:
    """Keep decode's handle for the turn's conversation, or have D free its blocks."""
    engine = params.get("remote_engine_id")
    if not isinstance(engine, str):
        engine = None
    if engine is not None and d.engine_id != engine:
        if d.engine_id is not None:
            log.warning("decode engine id changed (restart) url=%s", d.url)
            ctx.spawn(quietly(ctx.store.drop_replica(
                d.url, "engine_changed", keep_engine_id=engine)))
        d.engine_id = engine
    rid = params.get("remote_request_id")
    rid = rid if isinstance(rid, str) else None
    key, prefix_len = None, 0
    if not turn.plan.keeps or not d.in_pool or not d.healthy:
        pass
    elif turn.history is not None and collector is not None:
        key = turn.history.store_key(collector.message())
    elif turn.prompt is not None and collector is not None:
        text = turn.prompt + collector.text
        key = ctx.keys.completion_key(turn.tenant, text)
        prefix_len = len(text)
    elif turn.store_key is not None:
        key = turn.store_key
    if key is not None and (problem := version_problem(params.get(VERSION_KEY),
                                                        "decode's handle")):
        # No engine of this release would admit it: not worth a store entry.
        log.warning("%s; not stored url=%s", problem, d.url)
        ctx.metrics.evicted("wire_version", 1)
        key = None
    if key is None:
        # D retained the blocks for a handle nobody will ever send: free them now.
        if rid is not None and d.in_pool:
            ctx.residency.release_ids(d.url, [rid])
        return
    n = params.get("remote_num_tokens")
    n = n if isinstance(n, int) and not isinstance(n, bool) else 0
    total = handle_blocks(params)
    blocks = counted_blocks(total, shared_blocks(params, total), turn.handle.superseded)
    chars = held_chars(turn, collector)
    prompt_key = _prompt_key(turn, ctx.keys) if turn.plan.keyed else None
    try:
        limit = ctx.max_pinned(d.url)
        share = ctx.cfg.tenant_retention_share
        kept = Kept(
            key, dumps_kept(params), d.url, engine, n, tenant=accounting_tenant(turn.tenant),
            prefix_len=prefix_len, chars=chars, prompt_key=prompt_key, request_id=rid,
            blocks=blocks, max_pinned=limit,
            gap=turn.gap, replaces=turn.handle.superseded,
            tenant_max_pinned=int(share * limit) if limit is not None and share < 1
            else None)
        await ctx.store.put(kept)
        ctx.residency.keep(kept, params)  # its note on decode, with the in-process store
        if turn.kind == CHAT and turn.plan.keyed:  # a placement that may run a child here
            ctx.parents.note(turn.tenant, turn.body, key, d.url, chars, prompt_key, turn.conv)
    except StoreUnavailable:
        if rid is not None:  # not kept anywhere: D frees the blocks now
            ctx.residency.release_ids(d.url, [rid])


def counted_blocks(total: int, shared: int, replaced: Entry | None) -> int:
    """The blocks a handle adds to its replica in the router's block bounds. Decode pins
    a block once, however many kept requests share it (a fork's prefix with its parent,
    an extend's history with the turn it extends), and says how many of this handle's
    blocks were pinned already (`shared`). The handle an extend replaces leaves now:
    what only that one pinned (its own count) is this handle's from now on."""
    own = total - shared + (replaced.blocks if replaced is not None else 0)
    return max(0, min(total, own))


def held_chars(turn: Turn, collector: MessageCollector | None) -> int:
    """The characters of the next prompt that this turn's handle holds, counted as the
    prompt is (placement.py's prompt_chars): the prompt, then the answer as the client
    sends it back (its text and tool calls, not the reasoning clients drop)."""
    if collector is None:  # an explicit id's turn: what it held of its own prompt
        return turn.prompt_chars
    if turn.kind == CHAT:
        return turn.prompt_chars + message_chars(collector.message())
    return turn.prompt_chars + len(collector.text)


def _keyed_messages(turn: Turn) -> list[Any] | None:
    """An explicit-id chat turn's messages (asked for only when a placement that may
    extend weighs them: hashing costs a pass over the body)."""
    messages = turn.body.get("messages")
    if turn.store_key is None or not isinstance(messages, list):
        return None
    return messages


def _prompt_key(turn: Turn, keys: LookupKeys) -> bytes | None:
    """An explicit-id chat turn's messages as Entry.prompt_key (a 4-byte count, then
    their keyed hash), for a turn whose plan is keyed: what `extends` hashed already,
    else one pass now."""
    messages = _keyed_messages(turn)
    if messages is None:
        return None
    if turn.prompt_key is not None:
        return turn.prompt_key
    return len(messages).to_bytes(4, "big") + keys.messages_key(turn.tenant, messages,
                                                                len(messages))


def extends(turn: Turn, entry: Entry, keys: LookupKeys) -> bool:
    """The turn's prompt extends what the entry's holder keeps (asked by a placement that
    may keep the turn on decode, the only one that weighs it): named by its history or
    its prompt prefix, or by an explicit id whose stored prompt is the first messages of
    this one. The explicit id's pass over the messages also gives the turn its own
    prompt key."""
    key = entry.prompt_key
    if key is None or len(key) < 5:
        return entry.chars > 0 and turn.prompt_chars >= entry.chars
    n = int.from_bytes(key[:4], "big")
    messages = _keyed_messages(turn)
    if messages is None or len(messages) <= n:
        return False
    first, whole = keys.messages_keys(turn.tenant, messages, n)
    turn.prompt_key = len(messages).to_bytes(4, "big") + whole
    return n.to_bytes(4, "big") + first == key
