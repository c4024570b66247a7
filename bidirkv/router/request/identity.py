"""Who is talking (tenant) and which conversation a request continues (lookup keys).

Every key is a keyed BLAKE2b digest that includes the tenant, so a conversation id
guessed or replayed by another tenant can never reach another tenant's handle. The hash
key (`LookupKeys`) is derived from the resource's handle key: every router replica, and
a restarted one, computes the same keys, and nobody without that Secret can compute them
offline. Without a handle key (tests, benchmarks) it is random per process. The same key
makes each tenant's `cache_salt` and the conversation label of logs and spans.

A conversation is named explicitly (validation.ID_SOURCES), by its chat history (the
messages up to the last assistant one), or by its completion prompt's longest stored
prefix. `Tenants` says whose a request is (docs/router.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from functools import lru_cache
from typing import Any

from bidirkv.router.codec import canonical

_SEP = b"\x1e"
# Domain separation: the lookup-key hash key is never the handle key itself, which also
# signs handles (a digest here can never double as a handle's MAC).
_DERIVE_PERSON = b"bidirkv-lookup1"


log = logging.getLogger("bidirkv.router")

# 128 bits: nobody guesses another tenant's salt.
SALT_HEX_LEN = 32
ANONYMOUS = b"anonymous"
# A tenant is 16 bytes (or ANONYMOUS). One past its source's cap is its overflow group's
# 16 bytes, then its own: the group is what caps, eviction and decode's tenant label
# (wire.TENANT_LABEL_LEN hex characters, the group's) count, its own what keys and salts
# are made of, so tenants pooled for fairness still share no handle and no cache.
TENANT_LEN = 16
_OVERFLOW_LEN = 2 * TENANT_LEN
# Tenants remembered across every source, at most (the oldest sources forgotten first).
MAX_TRACKED_TENANTS = 100_000
MAX_WARNED_SOURCES = 1024
# Salts, labels and explicit keys kept per router (a few hundred bytes each).
KEYED_CACHE = 4096


def accounting_tenant(tenant: bytes) -> bytes:
    """Who a tenant's handles count against: its overflow group, else itself."""
    return tenant[:TENANT_LEN] if len(tenant) == _OVERFLOW_LEN else tenant


def isolation_tenant(tenant: bytes) -> bytes:
    """What a tenant's keys and salt are made of: its own identity, pooled or not."""
    return tenant[TENANT_LEN:] if len(tenant) == _OVERFLOW_LEN else tenant


# Without a handle key: random, shared by the routers of this process only.
_PROCESS_HASH_KEY = os.urandom(32)


def derive_hash_key(handle_key: bytes) -> bytes:
    """The lookup-key hash key of every router that holds this handle key."""
    return hashlib.blake2b(handle_key, digest_size=32, person=_DERIVE_PERSON).digest()


# -- chat history ---------------------------------------------------------------------
def _content(content: Any) -> Any:
    if content is None:
        return ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        # vLLM's default ("string") content format joins text parts with newlines, so a
        # text-parts message and the equivalent string render to the same tokens.
        return "\n".join(p["text"] for p in content)
    return content


def _tool_calls(calls: Any) -> Any:
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for call in calls:
        if not isinstance(call, dict):
            out.append(call)
            continue
        fn = call.get("function") or {}
        if not isinstance(fn, dict):
            fn = {}
        out.append([call.get("id"), call.get("type") or "function", fn.get("name"),
                    fn.get("arguments")])
    return out


def canonical_message(message: Mapping[str, Any]) -> bytes:
    """The parts of a message that reach the prompt, in one byte form.

    Dropped on purpose: key order, null-valued fields, and reasoning fields
    (`reasoning_content`, `reasoning`), which clients commonly do not send back; the
    tokens D computed for them are the connector's concern (verified reuse), not the
    router's.
    """
    # Plain text and no tool calls (most messages) skip the helpers' calls.
    content = message.get("content")
    calls = message.get("tool_calls")
    return canonical(
        [
            message.get("role"),
            content if type(content) is str else _content(content),
            message.get("name"),
            message.get("tool_call_id"),
            None if calls is None else _tool_calls(calls),
        ]
    )


def _hashed_form(messages: list[Any]) -> bytes:
    """The bytes a prefix hash takes of `messages`: each one's canonical form, then the
    separator (fed at once, as fed one by one: the digest is the same)."""
    if not messages:
        return b""
    return _SEP.join([canonical_message(m) if isinstance(m, dict) else canonical(m)
                      for m in messages]) + _SEP


class ChatHistory:
    """Hash state of one request's messages: its lookup key and the seed of its store key."""

    __slots__ = ("lookup_key", "_state")

    def __init__(self, lookup_key: bytes | None, state: Any) -> None:
        self.lookup_key = lookup_key
        self._state = state

    def store_key(self, assistant_message: Mapping[str, Any]) -> bytes:
        h = self._state.copy()
        h.update(canonical_message(assistant_message))
        h.update(_SEP)
        return h.digest()


class LookupKeys:
    """Every lookup key of one router: tenants, explicit ids, chat histories, prompts."""

    __slots__ = ("_key", "_prefix", "_salt_state", "_tenant_salt", "conversation_label",
                 "explicit_key")

    def __init__(self, handle_key: bytes | None = None) -> None:
        self._key = derive_hash_key(handle_key) if handle_key else _PROCESS_HASH_KEY
        # Pure in their arguments and asked for on every turn of a conversation: the
        # conversations in use hash once, not per turn (bounded: a bot's fresh ids only
        # push older ones out, and validation holds an id to MAX_CONVERSATION_ID).
        # Salts are cached by tenant alone (cache_salt): a client's own salt is never kept.
        self._salt_state = lru_cache(KEYED_CACHE)(self._salt_start)
        self._tenant_salt = lru_cache(KEYED_CACHE)(self._salt_of_tenant)
        self.conversation_label = lru_cache(KEYED_CACHE)(self._conversation_label)
        self.explicit_key = lru_cache(KEYED_CACHE)(self._explicit_key)
        # The keyed state every prefix hash of a tenant starts from (copied, never fed).
        self._prefix = lru_cache(KEYED_CACHE)(self._prefix_state)

    def _hasher(self, *parts: bytes) -> Any:
        h = hashlib.blake2b(digest_size=16, key=self._key)
        for part in parts:
            h.update(part)
            h.update(_SEP)
        return h

    def tenant_of(self, value: str | None) -> bytes:
        """The tenant a credential (or the configured header's value) stands for."""
        if not value:
            return ANONYMOUS
        return self._hasher(b"tenant", value.encode("utf-8", "surrogatepass")).digest()

    def overflow_tenant(self, source: str, tenant: bytes) -> bytes:
        """`tenant` pooled with every other of `source`'s past its cap (see TENANT_LEN)."""
        group = self._hasher(b"overflow", source.encode("utf-8", "surrogatepass")).digest()
        return group + isolation_tenant(tenant)

    def _conversation_label(self, tenant: bytes, conversation_id: str) -> str:
        """For logs and spans: correlates one conversation's lines without its id. Keyed
        and per tenant, so a guessed id cannot be tested against it and one id of two
        tenants reads as two; the same on every replica that holds the handle key."""
        return self._hasher(b"label", isolation_tenant(tenant),
                            conversation_id.encode("utf-8", "surrogatepass")).hexdigest()[:10]

    def cache_salt(self, tenant: bytes, client_salt: str | None = None) -> str:
        """The tenant's `cache_salt`, the same turn after turn: vLLM's prefix cache (and
        the connector's digests) match only requests of one salt, so no tenant's timing
        tells whether another's prompt is cached. A client's own salt is folded into its
        tenant's, fed to a copy of the tenant's keyed state and never kept: distinct
        salts, however many or long, grow nothing."""
        if client_salt is None:
            return self._tenant_salt(tenant)
        h = self._salt_state(tenant).copy()
        h.update(client_salt.encode("utf-8", "surrogatepass"))
        return h.hexdigest()[:SALT_HEX_LEN]

    def _salt_start(self, tenant: bytes) -> Any:
        return self._hasher(b"salt", isolation_tenant(tenant))

    def _salt_of_tenant(self, tenant: bytes) -> str:
        return self._salt_start(tenant).hexdigest()[:SALT_HEX_LEN]

    def _explicit_key(self, tenant: bytes, conversation_id: str) -> bytes:
        return self._hasher(b"id", isolation_tenant(tenant),
                            conversation_id.encode("utf-8", "surrogatepass")).digest()

    def chat_history(self, tenant: bytes, messages: list[Any]) -> ChatHistory:
        """Each message is encoded once and fed to one running hash; the lookup key is a
        snapshot at the last assistant message, the store key continues from the end."""
        last_assistant = -1
        for i in range(len(messages) - 1, -1, -1):
            m = messages[i]
            if isinstance(m, dict) and m.get("role") == "assistant":
                last_assistant = i
                break
        h = self._hasher(b"chat", isolation_tenant(tenant))
        lookup: bytes | None = None
        for i, m in enumerate(messages):
            h.update(canonical_message(m) if isinstance(m, dict) else canonical(m))
            h.update(_SEP)
            if i == last_assistant:
                lookup = h.copy().digest()
        return ChatHistory(lookup, h)

    def _prefix_state(self, tenant: bytes) -> Any:
        return self._hasher(b"prefix", isolation_tenant(tenant))

    def messages_key(self, tenant: bytes, messages: list[Any], n: int) -> bytes:
        """Of the first `n` messages: what a turn named by an explicit id stores, so that
        its next turn can show its prompt extends that one (placement)."""
        h = self._prefix(tenant).copy()
        h.update(_hashed_form(messages if n >= len(messages) else messages[:max(n, 0)]))
        return h.digest()

    def messages_keys(self, tenant: bytes, messages: list[Any], n: int
                      ) -> tuple[bytes, bytes]:
        """`messages_key` of the first `n` messages and of all of them, in one pass: the
        turn that shows its prompt extends a stored one (the first) stores the second."""
        if n >= len(messages):
            whole = self.messages_key(tenant, messages, n)
            return whole, whole
        h = self._prefix(tenant).copy()
        if n > 0:
            h.update(_hashed_form(messages[:n]))
        first = h.copy().digest()
        h.update(_hashed_form(messages[max(n, 0):]))
        return first, h.digest()

    # -- completions prompt prefixes ---------------------------------------------------
    def completion_key(self, tenant: bytes, text: str) -> bytes:
        h = self._hasher(b"completion", isolation_tenant(tenant))
        h.update(text.encode("utf-8", "surrogatepass"))
        return h.digest()

    def prefix_keys(self, tenant: bytes):
        """`key_of(text, lengths)` for Store.lookup_prefix: (length, key), longest
        first. One incremental pass over the text: cost O(len(text) + len(lengths))."""

        def key_of(text: str, lengths: list[int]) -> Iterator[tuple[int, bytes]]:
            h = self._hasher(b"completion", isolation_tenant(tenant))
            pos = 0
            keys: list[tuple[int, bytes]] = []
            for n in lengths:
                h.update(text[pos:n].encode("utf-8", "surrogatepass"))
                pos = n
                keys.append((n, h.copy().digest()))
            return reversed(keys)

        return key_of


class Tenants:
    """The tenant of each request. A header the gateway sets after checking the caller
    (`trusted_header`) names it when configured: without that header a request is the
    anonymous tenant. Else the credential header does, whose values a client chooses: one
    rotating them would become many small tenants, and every real tenant "the heaviest"
    that the bounds evict first. So one source (the client's address) names at most `cap`
    tenants of its own at a time (one unseen for `idle_s` frees its place); past it, its
    new tenants are pooled into one overflow group for the bounds, each keeping its own
    keys and salt (isolation_tenant)."""

    def __init__(self, keys: LookupKeys, clock: Callable[[], float] = time.monotonic,
                 max_tracked: int = MAX_TRACKED_TENANTS) -> None:
        self._keys = keys
        self._clock = clock
        self._max_tracked = max_tracked
        # source -> its own tenants, least recently seen first, with when they were seen
        self._sources: OrderedDict[str, OrderedDict[bytes, float]] = OrderedDict()
        self._tracked = 0
        self._pooling: OrderedDict[str, None] = OrderedDict()  # sources warned of

    def of(self, headers: Mapping[str, str], source: str | None, header: str,
           trusted_header: str | None, cap: int | None, idle_s: float) -> bytes:
        if trusted_header is not None:
            return self._keys.tenant_of(headers.get(trusted_header))
        tenant = self._keys.tenant_of(headers.get(header))
        if cap is None or tenant == ANONYMOUS:
            return tenant
        return tenant if self._admit(source or "", tenant, cap, idle_s) else (
            self._keys.overflow_tenant(source or "", tenant))

    def _admit(self, source: str, tenant: bytes, cap: int, idle_s: float) -> bool:
        """Whether `tenant` is one of `source`'s own (it is now, if there was room)."""
        now = self._clock()
        known = self._sources.get(source)
        if known is None:
            known = self._sources[source] = OrderedDict()
        self._sources.move_to_end(source)
        while known:
            oldest, seen = next(iter(known.items()))
            if now - seen <= idle_s:
                break
            del known[oldest]
            self._tracked -= 1
        if tenant in known:
            known[tenant] = now
            known.move_to_end(tenant)
            return True
        if len(known) >= cap:
            if source not in self._pooling:
                # Once per source while it pools: behind a proxy, every client is pooled.
                log.warning("client address %s names more than %d tenants "
                            "(maxTenantsPerSource): its new ones are pooled into one for "
                            "the caps and eviction; behind a gateway, set "
                            "trustedTenantHeader", source, cap)
            self._pooling[source] = None
            self._pooling.move_to_end(source)
            if len(self._pooling) > MAX_WARNED_SOURCES:
                self._pooling.popitem(last=False)
            return False
        self._pooling.pop(source, None)
        known[tenant] = now
        self._tracked += 1
        while (len(self._sources) > 1 and max(self._tracked, len(self._sources))
               > self._max_tracked):
            _, dropped = self._sources.popitem(last=False)
            self._tracked -= len(dropped)
        return True


# This process's keys, for code that runs without a router's handle key.
_PROCESS = LookupKeys()
tenant_of = _PROCESS.tenant_of
explicit_key = _PROCESS.explicit_key
chat_history = _PROCESS.chat_history
completion_key = _PROCESS.completion_key
prefix_keys = _PROCESS.prefix_keys
