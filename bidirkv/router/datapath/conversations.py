"""Naming a request's tenant and conversation, and taking its handle from the store (the
next one is kept by keeping.py)."""

from __future__ import annotations

import functools
import time

from aiohttp import web

from bidirkv.returns import next_gap
from bidirkv.router.datapath.context import Context
from bidirkv.router.datapath.turn import Turn
from bidirkv.router.engine.bodies import salt
from bidirkv.router.request.identity import Tenants, accounting_tenant
from bidirkv.router.request.validation import CHAT
from bidirkv.router.store.base import MISS, StoreUnavailable


class Conversations:
    """Naming a request's tenant and conversation, taking its handle."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.tenants = Tenants(ctx.keys)

    def tenant(self, request: web.Request) -> bytes:
        """The tenant a client request belongs to (identity.py's `Tenants`)."""
        cfg = self.ctx.cfg
        return self.tenants.of(request.headers, request.remote, cfg.tenant_header,
                               cfg.trusted_tenant_header, cfg.max_tenants_per_source,
                               cfg.conversation_ttl_seconds)

    async def identify(self, turn: Turn, request: web.Request, conversation_id: str | None,
                       parent_id: str | None = None) -> None:
        """Name the turn's tenant and salt its body with the tenant's cache_salt; name the
        turn's conversation and, with bidirectional transfer on (its modes), take its
        handle from the store, if any; without one, find where its parent's prefix lives
        (parents.py) when placement may run it there. Otherwise only an explicit id names
        it (for the logs)."""
        ctx = self.ctx
        turn.tenant = self.tenant(request)
        salt(turn.body, functools.partial(ctx.keys.cache_salt, turn.tenant))
        if not turn.modes.bidirectional:
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
        turn.handle.took(entry, status)
        if entry is not None:
            turn.holder_url = entry.decode_url
            if entry.kept_at > 0:
                turn.gap = next_gap(entry.gap, time.time() - entry.kept_at)
        elif turn.modes.places and turn.kind == CHAT:
            turn.parent = await ctx.parents.find(turn.tenant, body, parent_id,
                                                 by_history=turn.history is None)
            if turn.parent is not None:
                turn.holder_url = turn.parent.decode_url

    async def end_conversation(self, tenant: bytes, conversation_id: str) -> bool:
        """DELETE /v1/conversations/{id}: drop the handle, D frees its blocks now."""
        return await self.ctx.store.end(self.ctx.keys.explicit_key(tenant, conversation_id))
