"""Where a first turn's prefix already lives: the parent of a sub-agent or a fork.

A conversation's handle is single use: only its own next turn takes it. A child (a
sub-agent started from the same system prompt and tools, or a fork of the whole
history) starts a conversation of its own, and its first turn finds no handle. What it
finds here is the decode replica that holds its parent's prefix, and how much of its
prompt that is, without taking the parent's handle: the turn then runs there whole
(decode's prefix cache reads the shared blocks, token-exact and per tenant salt), or P reads
them shared: decode keeps them retained for the parent (connector/core/residency.py,
`share`). Either way the parent's next turn still reuses. In order:

    child   a parent header (`parentHeaders`) names a conversation of the same tenant
            that has a handle;
    fork    the prompt is a stored conversation's prompt and answer, then one message
            (by the explicit id's prompt key, or a history-named conversation's key);
    prefix  the prompt starts with the tools and system message of a stored
            conversation.

The last two come from `Prefixes`, this router's bounded memory of the prefix keys of
the handles it stored; each is believed only while the handle it came from is still
stored on the same replica (`Store.look`). Keys are the tenant's keyed hashes, so a
parent of another tenant is never found, and an unknown one costs what a known one
does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from bidirkv.router.metrics import CHILD, FORK, PREFIX, RETURNING, ReuseOutcome
from bidirkv.router.pool.placement import EXTEND, Decision, json_chars, message_chars
from bidirkv.router.request.identity import LookupKeys
from bidirkv.router.store.base import Entry, Store, StoreUnavailable

# Prefix keys remembered, ~370 bytes each (6 MB in all): two per conversation at the
# default maxConversations would not fit a small pod, and children come soon after the
# turn they fork from, so the most recently noted or used are the ones worth keeping.
MAX_PREFIXES = 16384
HEAD_ROLES = ("system", "developer")


@dataclass(frozen=True, slots=True)
class Parent:
    """A first turn's prefix: `chars` of its prompt (as placement counts them) held on
    `decode_url` for the conversation labelled `label`, found as `kind`; `params`, the
    parent's handle, which P may read shared (leaving it the parent's)."""

    kind: str
    decode_url: str
    chars: int
    label: str
    params: bytes = b""


@dataclass(frozen=True, slots=True)
class Noted:
    source: bytes  # the store key of the handle the prefix was noted from
    decode_url: str
    chars: int
    label: str


class Prefixes:
    """Prefix key -> where it was last kept; least recently noted or used goes first."""

    def __init__(self, max_entries: int = MAX_PREFIXES) -> None:
        self.max_entries = max_entries
        self._noted: OrderedDict[bytes, Noted] = OrderedDict()

    def __len__(self) -> int:
        return len(self._noted)

    def note(self, key: bytes, noted: Noted) -> None:
        self._noted[key] = noted
        self._noted.move_to_end(key)
        while len(self._noted) > self.max_entries:
            self._noted.popitem(last=False)

    def get(self, key: bytes) -> Noted | None:
        noted = self._noted.get(key)
        if noted is not None:
            self._noted.move_to_end(key)
        return noted


def head(body: dict[str, Any]) -> tuple[list[Any], int] | None:
    """What sub-agents of one agent share at the start of a chat prompt: its tools and
    its first message when that is a system (or developer) message, and their characters;
    None without either."""
    messages = body.get("messages")
    first = messages[0] if isinstance(messages, list) and messages else None
    if not (isinstance(first, dict) and first.get("role") in HEAD_ROLES):
        first = None
    tools = body.get("tools")
    if first is None and not tools:
        return None
    return [tools, first], json_chars(tools) + message_chars(first)


def head_key(keys: LookupKeys, tenant: bytes, body: dict[str, Any]) -> tuple[bytes, int] | None:
    found = head(body)
    if found is None:
        return None
    parts, chars = found
    return b"head" + keys.messages_key(tenant, parts, len(parts)), chars


def fork_key(keys: LookupKeys, tenant: bytes, messages: list[Any]) -> bytes | None:
    """The prompt key (keeping.py's) of a fork's parent: all but the last two messages
    (the parent's answer and the fork's own message)."""
    n = len(messages) - 2
    if n < 1:
        return None
    return n.to_bytes(4, "big") + keys.messages_key(tenant, messages, n)


class Parents:
    """Finding a first turn's parent (module docstring) and noting kept prefixes."""

    def __init__(self, keys: LookupKeys, store: Store, prefixes: Prefixes) -> None:
        self.keys = keys
        self.store = store
        self.prefixes = prefixes

    def tenant_salted(self, tenant: bytes, body: dict[str, Any]) -> bool:
        """The body carries its tenant's own `cache_salt`, not one the client split it
        with: only then does decode's prefix cache match it with the tenant's other
        conversations (a client's salt is not kept, so nothing is known to match it)."""
        return body.get("cache_salt") == self.keys.cache_salt(tenant)

    async def find(self, tenant: bytes, body: dict[str, Any], parent_id: str | None,
                   by_history: bool) -> Parent | None:
        """The prefix this first turn shares with a held conversation, or None.
        `by_history`: a fork may be found under the key a history-named conversation that
        this prompt extends is stored under (not for a turn named by its history: that key
        was its own lookup); hashed only when nothing before it found the parent."""
        if not self.tenant_salted(tenant, body):
            return None
        try:
            return await self._find(tenant, body, parent_id, by_history)
        except StoreUnavailable:
            return None

    async def _find(self, tenant: bytes, body: dict[str, Any], parent_id: str | None,
                    by_history: bool) -> Parent | None:
        keys = self.keys
        messages = body.get("messages")
        messages = messages if isinstance(messages, list) else None
        headed = head_key(keys, tenant, body) if messages is not None else None
        if parent_id is not None:
            source = keys.explicit_key(tenant, parent_id)
            entry = await self.store.look(source)
            if entry is not None:
                label = keys.conversation_label(tenant, parent_id)
                return Parent(CHILD, entry.decode_url,
                              self._shared(entry, messages, tenant, headed), label,
                              entry.params)
        if messages is not None:
            found = await self._fork(tenant, messages, by_history)
            if found is not None:
                return found
        if headed is not None:
            noted = self.prefixes.get(headed[0])
            entry = await self._believed(noted)
            if noted is not None and entry is not None:
                return Parent(PREFIX, noted.decode_url, min(noted.chars, headed[1]),
                              noted.label, entry.params)
        return None

    def _shared(self, entry: Entry, messages: list[Any] | None, tenant: bytes,
                headed: tuple[bytes, int] | None) -> int:
        """Of a header-named parent: its whole prompt and answer when this prompt extends
        them (a fork), else the head they share (a sub-agent), else nothing known."""
        key = entry.prompt_key
        if messages is not None and key is not None and len(key) > 4:
            n = int.from_bytes(key[:4], "big")
            if len(messages) > n and n.to_bytes(4, "big") + self.keys.messages_key(
                    tenant, messages, n) == key:
                return entry.chars
        if headed is not None:
            noted = self.prefixes.get(headed[0])
            if noted is not None and noted.decode_url == entry.decode_url:
                return min(noted.chars, headed[1])
        return 0

    async def _fork(self, tenant: bytes, messages: list[Any], by_history: bool
                    ) -> Parent | None:
        key = fork_key(self.keys, tenant, messages)
        noted = self.prefixes.get(key) if key is not None else None
        entry = await self._believed(noted)
        if noted is not None and entry is not None:
            return Parent(FORK, noted.decode_url, noted.chars, noted.label, entry.params)
        history_key = self.keys.chat_history(tenant, messages).lookup_key if by_history \
            else None
        if history_key is not None:
            entry = await self.store.look(history_key)
            if entry is not None:
                return Parent(FORK, entry.decode_url, entry.chars,
                              "auto:" + history_key.hex()[:10], entry.params)
        return None

    async def _believed(self, noted: Noted | None) -> Entry | None:
        """The handle `noted` came from, while it is stored on the same replica."""
        if noted is None:
            return None
        entry = await self.store.look(noted.source)
        return entry if entry is not None and entry.decode_url == noted.decode_url else None

    def note(self, tenant: bytes, body: dict[str, Any], source: bytes, decode_url: str,
             chars: int, prompt_key: bytes | None, label: str) -> None:
        """A handle was stored under `source`: its children may find it by its prompt
        key (forks of an explicit id's conversation) and by its head (sub-agents)."""
        if not self.tenant_salted(tenant, body):
            return
        if prompt_key is not None:
            self.prefixes.note(prompt_key, Noted(source, decode_url, chars, label))
        headed = head_key(self.keys, tenant, body)
        if headed is not None:
            self.prefixes.note(headed[0], Noted(source, decode_url, headed[1], label))


def reuse_kind(reuse: ReuseOutcome, consumed: bool, placed: Decision | None,
               parent: Parent | None, read_parent: bool = False) -> str | None:
    """Whose KV an answered turn started from (metrics' reuse_kind), if any: its own
    handle's (P took it, or its holder extended it), else its parent's when it ran whole
    on the parent's holder or P read the parent's blocks (`read_parent`)."""
    if reuse in (ReuseOutcome.EXTENDED, ReuseOutcome.VERIFIED_PARTIAL) or (
            reuse is ReuseOutcome.HIT and consumed):
        return RETURNING
    if parent is not None and (read_parent or placed is not None and placed.path == EXTEND):
        return parent.kind
    return None
