"""Chat histories of a given length in tokens, shaped as long agent contexts are (pure,
seeded): what a turn of a 64k-200k-token conversation sends the router.

A token is CHARS_PER_TOKEN characters of English text (the usual rule of thumb for
BPE tokenizers on English). Two shapes:
- prose: a system prompt, then user and assistant messages of 30-300 tokens;
- with tool calls (`tool_every` = k): every k-th message is an assistant's tool call
  (a short thought, one call whose arguments are a JSON string) answered by the tool's
  output (code-like lines: quotes and line breaks, which JSON escapes), the others prose;
  the body also carries the tool definitions (`tools`), and user messages come as
  content parts (`[{"type": "text", "text": ...}]`), as agent frameworks send them.
Sizes are drawn per message from `seed`, so a length gives the same body every run.
"""

from __future__ import annotations

import json
import random
from typing import Any

CHARS_PER_TOKEN = 4
_WORDS = ("the", "router", "keeps", "a", "handle", "for", "each", "conversation", "and",
          "decode", "holds", "its", "blocks", "while", "prefill", "reads", "them", "back",
          "when", "next", "turn", "arrives", "with", "longer", "history", "of", "tokens",
          "agent", "calls", "tool", "output", "file", "function", "returns", "value", "test")
_CODE = ('    return self.cache.get(key, None)', 'def load(path: str) -> dict:',
         '        raise ValueError(f"bad value {v!r}")', '# keep the lock while writing',
         'for i, item in enumerate(items):', '    if not item.get("ok"):',
         'src/router/handles.py:42:    "remote_block_ids": ids,', '}', 'import json')
_TOOLS = ("read_file", "write_file", "grep", "list_dir", "run_tests", "run_shell", "edit",
          "search_web", "open_url", "git_diff", "git_commit", "ask_user")


def _prose(rng: random.Random, tokens: int) -> str:
    n = max(1, tokens) * CHARS_PER_TOKEN
    out, size = [], 0
    while size < n:
        w = rng.choice(_WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def _code(rng: random.Random, tokens: int) -> str:
    n = max(1, tokens) * CHARS_PER_TOKEN
    out, size = [], 0
    while size < n:
        line = rng.choice(_CODE)
        out.append(line)
        size += len(line) + 1
    return "\n".join(out)[:n]


def tool_definitions() -> list[dict[str, Any]]:
    """The `tools` an agent's body carries: one function each, two string parameters."""
    return [{"type": "function", "function": {
        "name": name, "description": f"{name.replace('_', ' ')} in the workspace",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "a path in the workspace"},
            "query": {"type": "string", "description": "what to look for"}},
            "required": ["path"]}}} for name in _TOOLS]


def _chars(obj: Any) -> int:
    return len(json.dumps(obj, ensure_ascii=False))


def history(tokens: int, tool_every: int = 0, seed: int = 0) -> dict[str, Any]:
    """`{"messages": [...]}` (and `tools` with tool calls) of about `tokens` tokens of
    text, counted as CHARS_PER_TOKEN characters of each message's text (its role, keys
    and JSON punctuation are not counted); the last message is the user's."""
    rng = random.Random(f"history/{tokens}/{tool_every}/{seed}")
    out: dict[str, Any] = {}
    budget = tokens * CHARS_PER_TOKEN
    if tool_every:
        out["tools"] = tool_definitions()
        budget -= _chars(out["tools"])
    system = min(1000, max(1, tokens // 10))
    messages: list[dict[str, Any]] = [{"role": "system", "content": _prose(rng, system)}]
    budget -= system * CHARS_PER_TOKEN
    calls = 0
    while budget > 0:
        k = len(messages)
        if tool_every and k % tool_every == 0:
            calls += 1
            cid = f"call_{calls:08d}"
            args = json.dumps({"path": f"src/pkg/module_{rng.randrange(500)}.py",
                               "query": _prose(rng, rng.randint(3, 15))})
            thought = _prose(rng, rng.randint(10, 60))
            output = _code(rng, rng.randint(20, 400))
            messages.append({"role": "assistant", "content": thought, "tool_calls": [
                {"id": cid, "type": "function",
                 "function": {"name": rng.choice(_TOOLS), "arguments": args}}]})
            messages.append({"role": "tool", "tool_call_id": cid, "content": output})
            budget -= len(thought) + len(args) + len(output)
            continue
        role = "assistant" if messages[-1]["role"] == "user" else "user"
        text = _prose(rng, min(rng.randint(30, 300), budget // CHARS_PER_TOKEN + 1))
        content: Any = [{"type": "text", "text": text}] if tool_every and role == "user" \
            else text
        messages.append({"role": role, "content": content})
        budget -= len(text)
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": "go on"})
    out["messages"] = messages
    return out


def containers(obj: Any) -> int:
    """JSON objects and arrays in `obj` (what maxJsonContainers counts)."""
    if isinstance(obj, dict):
        return 1 + sum(containers(v) for v in obj.values())
    if isinstance(obj, list):
        return 1 + sum(containers(v) for v in obj)
    return 0
