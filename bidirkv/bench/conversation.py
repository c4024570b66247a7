"""Conversations of the benchmark and the requests they send (pure).

Each turn adds a fixed number of new user words and asks for a fixed number of output
tokens (min_tokens = max_tokens, ignore_eos); the model's real answer goes back into the
history, as in the upstream multi-turn benchmark. With the tiny model's word vocabulary
a word is one token; with a real tokenizer it is one to three.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from bidirkv.local.model import random_text

ID_MODES = ("body", "header", "none")


def user_text(seed: int, conversation: int, turn: int, words: int) -> str:
    # Distinct per (run seed, conversation, turn): no two turns share a prefix by chance.
    mixed = int.from_bytes(hashlib.sha256(f"{seed}/{conversation}/{turn}".encode()).digest()[:8],
                           "big")
    return random_text(words, mixed)


@dataclass(frozen=True)
class Appends:
    """How many new user words each turn adds: a seeded size in [min, max] per (seed,
    conversation, turn), and every `tool_every`-th turn a tool output of `tool_words`
    instead (an agent reading a file or a page). 0 turns off the tool outputs."""

    min_words: int
    max_words: int
    tool_every: int = 0
    tool_words: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_words <= self.max_words:
            raise ValueError(f"appends {self.min_words}-{self.max_words}: need 1 <= min <= max")
        if self.tool_every < 0 or (self.tool_every and self.tool_words < 1):
            raise ValueError(f"tool outputs every {self.tool_every} turns of "
                             f"{self.tool_words} words: need every >= 0 and words >= 1")

    def words(self, seed: int, conversation: int, turn: int) -> int:
        if self.tool_every and turn > 1 and turn % self.tool_every == 0:
            return self.tool_words
        digest = hashlib.sha256(f"append/{seed}/{conversation}/{turn}".encode()).digest()
        span = self.max_words - self.min_words + 1
        return self.min_words + int.from_bytes(digest[:8], "big") % span

    def describe(self) -> str:
        tool = (f", a {self.tool_words}-word tool output every {self.tool_every} turns"
                if self.tool_every else "")
        return f"appends of {self.min_words}-{self.max_words} words (seeded){tool}"


def chat_body(model: str, messages: list[dict[str, str]], output_tokens: int, stream: bool
              ) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [dict(m) for m in messages],
        "max_tokens": output_tokens,
        "min_tokens": output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        # With ignore_eos the model may emit </s>; skipped in the text, it would be missing
        # from the history sent back while D's KV holds it (reused KV of other tokens).
        "skip_special_tokens": False,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def with_conversation_id(body: dict[str, Any], conversation_id: str, mode: str
                         ) -> tuple[dict[str, Any], dict[str, str]]:
    """(body, headers) carrying the id as the router expects it: a top-level
    `conversation_id` field, an X-Conversation-Id header, or not at all."""
    if mode not in ID_MODES:
        raise ValueError(f"conversation id mode {mode!r}: must be one of {', '.join(ID_MODES)}")
    if mode == "body":
        return {**body, "conversation_id": conversation_id}, {}
    if mode == "header":
        return body, {"X-Conversation-Id": conversation_id}
    return body, {}


@dataclass
class Conversation:
    index: int
    cid: str
    messages: list[dict[str, str]] = field(default_factory=list)

    @property
    def turns_done(self) -> int:
        return sum(1 for m in self.messages if m["role"] == "assistant")

    def ask(self, text: str) -> list[dict[str, str]]:
        self.messages.append({"role": "user", "content": text})
        return self.messages

    def answer(self, text: str) -> None:
        if not self.messages or self.messages[-1]["role"] != "user":
            raise ValueError("answer without a pending user message")
        self.messages.append({"role": "assistant", "content": text})
