"""Naming a request's tenant and conversation, taking its handle, storing the next one."""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from aiohttp import web

from bidirkv.returns import next_gap
from bidirkv.router.codec import dumps_kept
from bidirkv.router.datapath.bodies import handle_blocks, salt
from bidirkv.router.datapath.context import Context, quietly
from bidirkv.router.datapath.sse import MessageCollector
from bidirkv.router.datapath.turn import Turn
from bidirkv.router.pool.backends import Backend
from bidirkv.router.pool.placement import message_chars
from bidirkv.router.request.identity import Tenants, accounting_tenant
from bidirkv.router.request.validation import CHAT
from bidirkv.router.store.base import EXPIRED, HIT, MISS, Entry, Kept, StoreUnavailable
from bidirkv.wire import VERSION_KEY, version_problem

log = logging.getLogger("bidirkv.router")


class Conversations:
    """Naming a request's conversation, taking its handle, storing the next one."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.tenants = Tenants(ctx.keys)

    def tenant(self, request: web.Request) -> bytes:
        """The tenant a client request belongs to (identity.py's `Tenants`)."""
        cfg = self.ctx.cfg
        return self.tenants.of(request.headers, request.remote, cfg.tenant_header,
                               cfg.trusted_tenant_header, cfg.max_tenants_per_source,
                               cfg.conversation_ttl_seconds)

    async def identify(self, turn: Turn, conversation_id: str | None, looks_up: bool
                       ) -> None:
        """Salt the turn's body with its tenant's cache_salt; name the turn's conversation
        and, if it `looks_up` (bidirectional transfer on), take its handle from the store,
        if any. Otherwise only an explicit id names it (for the logs)."""
        ctx = self.ctx
        salt(turn.body, functools.partial(ctx.keys.cache_salt, turn.tenant))
        if not looks_up:
            if conversation_id is not None:
                turn.conv = ctx.keys.conversation_label(turn.tenant, conversation_id)
            return
        store = ctx.store
        body = turn.body
        key: bytes | None = None
        status, entry = MISS, None
        if conversation_id is not None:
            turn.conv = ctx.keys.conversation_label(turn.tenant, conversation_id)
            key = turn.store_key = ctx.keys.explicit_key(turn.tenant, conversation_id)
        elif turn.kind == CHAT:
            turn.history = ctx.keys.chat_history(turn.tenant, body["messages"])
            key = turn.history.lookup_key
            turn.conv = "auto:" + (key.hex()[:10] if key is not None else "new")
        elif isinstance(body.get("prompt"), str):
            turn.prompt = body["prompt"]
        try:
            if key is not None:
                status, entry = await store.lookup(key)
            elif turn.prompt is not None:
                # Lengths as stored (by the accounting tenant), keys of the turn's own.
                status, entry = await store.lookup_prefix(accounting_tenant(turn.tenant),
                                                          turn.prompt,
                                                          ctx.keys.prefix_keys(turn.tenant))
                turn.conv = "auto:" + (entry.key.hex()[:10] if entry is not None else "new")
        except StoreUnavailable:
            status, entry = MISS, None  # served without reuse (counted)
        turn.handle.took(entry, {HIT: "hit", MISS: "miss", EXPIRED: "expired"}[status])
        if entry is not None:
            turn.holder_url = entry.decode_url
            if entry.kept_at > 0:
                turn.gap = next_gap(entry.gap, time.time() - entry.kept_at)

    async def store_handle(self, turn: Turn, d: Backend, params: dict[str, Any],
                           collector: MessageCollector | None) -> None:
        """Keep decode's handle for the turn's conversation, or have D free its blocks."""
        ctx = self.ctx
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
        chars = self.held_chars(turn, collector)
        prompt_key = self.prompt_key(turn) if turn.plan.keyed else None
        try:
            limit = ctx.max_pinned(d.url)
            share = ctx.cfg.tenant_retention_share
            kept = Kept(
                key, dumps_kept(params), d.url, engine, n, tenant=accounting_tenant(turn.tenant),
                prefix_len=prefix_len, chars=chars, prompt_key=prompt_key, request_id=rid,
                blocks=handle_blocks(params), max_pinned=limit,
                gap=turn.gap, replaces=turn.handle.superseded,
                tenant_max_pinned=int(share * limit) if limit is not None and share < 1
                else None)
            await ctx.store.put(kept)
            ctx.residency.keep(kept, params)  # its note on decode, with the in-process store
        except StoreUnavailable:
            if rid is not None:  # not kept anywhere: D frees the blocks now
                ctx.residency.release_ids(d.url, [rid])

    @staticmethod
    def held_chars(turn: Turn, collector: MessageCollector | None) -> int:
        """The characters of the next prompt that this turn's handle holds, counted as the
        prompt is (placement.py's prompt_chars): the prompt, then the answer as the client
        sends it back (its text and tool calls, not the reasoning clients drop)."""
        if collector is None:  # an explicit id's turn: what it held of its own prompt
            return turn.prompt_chars
        if turn.kind == CHAT:
            return turn.prompt_chars + message_chars(collector.message())
        return turn.prompt_chars + len(collector.text)

    @staticmethod
    def _keyed_messages(turn: Turn) -> list[Any] | None:
        """An explicit-id chat turn's messages (asked for only when a placement that may
        extend weighs them: hashing costs a pass over the body)."""
        messages = turn.body.get("messages")
        if turn.store_key is None or not isinstance(messages, list):
            return None
        return messages

    def prompt_key(self, turn: Turn) -> bytes | None:
        """An explicit-id chat turn's messages as Entry.prompt_key (a 4-byte count, then
        their keyed hash), for a turn whose plan is keyed: what `extends` hashed
        already, else one pass now."""
        messages = self._keyed_messages(turn)
        if messages is None:
            return None
        if turn.prompt_key is not None:
            return turn.prompt_key
        return len(messages).to_bytes(4, "big") + self.ctx.keys.messages_key(
            turn.tenant, messages, len(messages))

    def extends(self, turn: Turn, entry: Entry) -> bool:
        """The turn's prompt extends what the entry's holder keeps (asked by a placement that
        may keep the turn on decode, the only one that weighs it): named by
        its history or its prompt prefix, or by an explicit id whose stored prompt is the
        first messages of this one. The explicit id's pass over the messages also gives
        the turn its own prompt key."""
        key = entry.prompt_key
        if key is None or len(key) < 5:
            return entry.chars > 0 and turn.prompt_chars >= entry.chars
        n = int.from_bytes(key[:4], "big")
        messages = self._keyed_messages(turn)
        if messages is None or len(messages) <= n:
            return False
        first, whole = self.ctx.keys.messages_keys(turn.tenant, messages, n)
        turn.prompt_key = len(messages).to_bytes(4, "big") + whole
        return n.to_bytes(4, "big") + first == key

    async def end_conversation(self, tenant: bytes, conversation_id: str) -> bool:
        """DELETE /v1/conversations/{id}: drop the handle, D frees its blocks now."""
        return await self.ctx.store.end(self.ctx.keys.explicit_key(tenant, conversation_id))
