"""Who is talking (tenant) and which conversation a request continues (lookup keys).

Every key is a keyed BLAKE2b digest that includes the tenant, so a conversation id
guessed or replayed by another tenant names a different key: it can never reach another
tenant's handle (P would reuse KV computed for someone else's tokens). The hash key
(`LookupKeys`) is derived from the resource's handle key, so every router replica of one
resource, and a restarted one, computes the same keys in a shared store, while nobody
without that Secret can compute them offline; rotating the handle key rotates them (each
conversation then misses once). Without a handle key (a router for tests or benchmarks)
the hash key is random per process, and the keys are this process's alone.

Three ways to name a conversation:
- explicit: `conversation_id` in the body or the `X-Conversation-Id` header;
- chat history: after a turn, the handle is stored under (tenant, messages sent +
  the assistant message produced); the next turn looks up (tenant, its messages up to
  and including its last assistant message);
- prompt prefix (/v1/completions): stored under (tenant, prompt + completion text); a
  new prompt matches the longest stored text it starts with.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

from bidirkv.router.codec import canonical

_SEP = b"\x1e"
# Domain separation: the lookup-key hash key is never the handle key itself, which also
# signs handles (a digest here can never double as a handle's MAC).
_DERIVE_PERSON = b"bidirkv-lookup1"


# Without a handle key: random, shared by the routers of this process only.
_PROCESS_HASH_KEY = os.urandom(32)


def derive_hash_key(handle_key: bytes) -> bytes:
    """The lookup-key hash key of every router that holds this handle key."""
    return hashlib.blake2b(handle_key, digest_size=32, person=_DERIVE_PERSON).digest()


def short_hash(value: str) -> str:
    """For logs: correlates lines of one conversation without printing its id.

    Unkeyed, so the same id reads the same on every router replica.
    """
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:10]


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
    return canonical(
        [
            message.get("role"),
            _content(message.get("content")),
            message.get("name"),
            message.get("tool_call_id"),
            _tool_calls(message.get("tool_calls")),
        ]
    )


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

    __slots__ = ("_key",)

    def __init__(self, handle_key: bytes | None = None) -> None:
        self._key = derive_hash_key(handle_key) if handle_key else _PROCESS_HASH_KEY

    def _hasher(self, *parts: bytes) -> Any:
        h = hashlib.blake2b(digest_size=16, key=self._key)
        for part in parts:
            h.update(part)
            h.update(_SEP)
        return h

    def tenant_of(self, value: str | None) -> bytes:
        """The tenant a credential (or the configured header's value) stands for."""
        if not value:
            return b"anonymous"
        return self._hasher(b"tenant", value.encode("utf-8", "surrogatepass")).digest()

    def explicit_key(self, tenant: bytes, conversation_id: str) -> bytes:
        return self._hasher(b"id", tenant,
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
        h = self._hasher(b"chat", tenant)
        lookup: bytes | None = None
        for i, m in enumerate(messages):
            h.update(canonical_message(m) if isinstance(m, dict) else canonical(m))
            h.update(_SEP)
            if i == last_assistant:
                lookup = h.copy().digest()
        return ChatHistory(lookup, h)

    def messages_key(self, tenant: bytes, messages: list[Any], n: int) -> bytes:
        """Of the first `n` messages: what a turn named by an explicit id stores, so that
        its next turn can show its prompt extends that one (placement)."""
        h = self._hasher(b"prefix", tenant)
        for m in messages[:n]:
            h.update(canonical_message(m) if isinstance(m, dict) else canonical(m))
            h.update(_SEP)
        return h.digest()

    # -- completions prompt prefixes ---------------------------------------------------
    def completion_key(self, tenant: bytes, text: str) -> bytes:
        h = self._hasher(b"completion", tenant)
        h.update(text.encode("utf-8", "surrogatepass"))
        return h.digest()

    def prefix_keys(self, tenant: bytes):
        """`key_of(text, lengths)` for Store.lookup_prefix: (length, key), longest
        first. One incremental pass over the text: cost O(len(text) + len(lengths))."""

        def key_of(text: str, lengths: list[int]) -> Iterator[tuple[int, bytes]]:
            h = self._hasher(b"completion", tenant)
            pos = 0
            keys: list[tuple[int, bytes]] = []
            for n in lengths:
                h.update(text[pos:n].encode("utf-8", "surrogatepass"))
                pos = n
                keys.append((n, h.copy().digest()))
            return reversed(keys)

        return key_of


# This process's keys, for code that runs without a router's handle key.
_PROCESS = LookupKeys()
tenant_of = _PROCESS.tenant_of
explicit_key = _PROCESS.explicit_key
chat_history = _PROCESS.chat_history
completion_key = _PROCESS.completion_key
prefix_keys = _PROCESS.prefix_keys
