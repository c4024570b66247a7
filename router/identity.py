"""Who is talking (tenant) and which conversation a request continues (lookup keys).

Every key is a keyed BLAKE2b digest that includes the tenant, so a conversation id
guessed or replayed by another tenant names a different key: it can never reach another
tenant's handle (P would reuse KV computed for someone else's tokens). The hash key is
random per process: keys never leave the process, and they are not guessable offline.

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

from .codec import canonical

_KEY = os.urandom(32)
_SEP = b"\x1e"


def _hasher(*parts: bytes) -> Any:
    h = hashlib.blake2b(digest_size=16, key=_KEY)
    for part in parts:
        h.update(part)
        h.update(_SEP)
    return h


def tenant_of(value: str | None) -> bytes:
    """The tenant a credential (or the configured header's value) stands for."""
    if not value:
        return b"anonymous"
    return _hasher(b"tenant", value.encode("utf-8", "surrogatepass")).digest()


def short_hash(value: str) -> str:
    """For logs: correlates lines of one conversation without printing its id.

    Unkeyed, so the same id reads the same on every router replica.
    """
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:10]


def explicit_key(tenant: bytes, conversation_id: str) -> bytes:
    return _hasher(b"id", tenant, conversation_id.encode("utf-8", "surrogatepass")).digest()


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


def chat_history(tenant: bytes, messages: list[Any]) -> ChatHistory:
    """Each message is encoded once and fed to one running hash; the lookup key is a
    snapshot at the last assistant message, the store key continues from the end."""
    last_assistant = -1
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if isinstance(m, dict) and m.get("role") == "assistant":
            last_assistant = i
            break
    h = _hasher(b"chat", tenant)
    lookup: bytes | None = None
    for i, m in enumerate(messages):
        h.update(canonical_message(m) if isinstance(m, dict) else canonical(m))
        h.update(_SEP)
        if i == last_assistant:
            lookup = h.copy().digest()
    return ChatHistory(lookup, h)


# -- completions prompt prefixes ----------------------------------------------------------
def completion_key(tenant: bytes, text: str) -> bytes:
    h = _hasher(b"completion", tenant)
    h.update(text.encode("utf-8", "surrogatepass"))
    return h.digest()


def prefix_keys(tenant: bytes):
    """`key_of(text, lengths)` for HandleStore.lookup_prefix: (length, key), longest first.

    One incremental pass over the text: cost O(len(text) + len(lengths)).
    """

    def key_of(text: str, lengths: list[int]) -> Iterator[tuple[int, bytes]]:
        h = _hasher(b"completion", tenant)
        pos = 0
        keys: list[tuple[int, bytes]] = []
        for n in lengths:
            h.update(text[pos:n].encode("utf-8", "surrogatepass"))
            pos = n
            keys.append((n, h.copy().digest()))
        return reversed(keys)

    return key_of
