"""Server-sent events from D: pass bytes through, take out D's `kv_transfer_params`.

The params (internal hosts, block ids) arrive in the last data chunk, either alone
(`{"choices": [], "kv_transfer_params": {...}}`, bidir-kv's stream patch on vLLM 0.32:
dropped entirely) or on a chunk that carries more (vLLM 0.33's finishing chunk: only the
key is removed; its other chunks carry the key as `null`, removed too). Everything else
is forwarded as received: a chunk is only JSON-decoded when it contains the key's bytes,
or when the caller collects the generated message (needed to name the conversation by
its history).
"""

from __future__ import annotations

from typing import Any

from bidirkv.router.codec import dumps, loads

PARAMS = "kv_transfer_params"
_MARKER = b'"kv_transfer_params"'
# vLLM 0.33 writes the key on every chunk, `null` but on the finishing one (compact JSON,
# after the chunk's first key). Taken out as bytes: no decoding of every chunk. Inside a
# JSON string these bytes cannot occur (its quotes would be escaped).
_NULL = b',"kv_transfer_params":null'
DONE = b"data: [DONE]\n\n"


def error_event(message: str, type_: str = "upstream_error", code: int | None = 502) -> bytes:
    """An OpenAI-style error as an SSE data event (clients parse data lines only)."""
    return b"data: " + dumps({"error": {"message": message, "type": type_, "param": None,
                                        "code": code}}) + b"\n\n"


def event_boundary(data: bytes, end: int | None = None) -> int:
    """Index just past the last complete event in `data[:end]` (0 if none)."""
    lf = data.rfind(b"\n\n", 0, end)
    crlf = data.rfind(b"\r\n\r\n", 0, end)
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def split_events(data: bytes) -> list[bytes]:
    """Complete events (without their blank-line terminator)."""
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n")
    return [e for e in data.split(b"\n\n") if e]


def event_data(event: bytes) -> bytes | None:
    """The data of one event (multi-line data joined with newlines), None if it has none."""
    if event.startswith(b"data:") and b"\n" not in event:
        return event[5:].lstrip(b" ")
    lines = [ln[5:].lstrip(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def is_params_only(chunk: dict[str, Any]) -> bool:
    """True when nothing but the params (and chunk metadata) would reach the client."""
    return not chunk.get("choices") and chunk.get("usage") is None and "error" not in chunk


def strip_params(chunk: dict[str, Any]) -> dict[str, Any] | None:
    """Pops the params off a decoded chunk; the chunk to forward, or None to drop it."""
    chunk.pop(PARAMS, None)
    return None if is_params_only(chunk) else chunk


class MessageCollector:
    """Rebuilds choice 0 of a generation from stream deltas or a whole response."""

    __slots__ = ("chat", "parts", "tool_calls")

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.parts: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}

    def feed_chunk(self, chunk: dict[str, Any]) -> None:
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            if not self.chat:
                text = choice.get("text")
                if isinstance(text, str):
                    self.parts.append(text)
                continue
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                continue
            content = delta.get("content")
            if isinstance(content, str):
                self.parts.append(content)
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    self._feed_tool_call(call)

    def _feed_tool_call(self, call: dict[str, Any]) -> None:
        slot = self.tool_calls.setdefault(
            call.get("index", len(self.tool_calls)),
            {"id": None, "type": "function", "name": None, "arguments": []},
        )
        if call.get("id"):
            slot["id"] = call["id"]
        if call.get("type"):
            slot["type"] = call["type"]
        fn = call.get("function")
        if isinstance(fn, dict):
            if fn.get("name"):
                slot["name"] = fn["name"]
            if isinstance(fn.get("arguments"), str):
                slot["arguments"].append(fn["arguments"])

    def feed_response(self, body: dict[str, Any]) -> None:
        choices = body.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            if not self.chat:
                if isinstance(choice.get("text"), str):
                    self.parts.append(choice["text"])
                continue
            msg = choice.get("message")
            if isinstance(msg, dict):
                if isinstance(msg.get("content"), str):
                    self.parts.append(msg["content"])
                for i, call in enumerate(msg.get("tool_calls") or ()):
                    if isinstance(call, dict):
                        self._feed_tool_call({**call, "index": i})

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def message(self) -> dict[str, Any]:
        """The assistant message as a client would send it back."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c["id"], "type": c["type"],
                 "function": {"name": c["name"], "arguments": "".join(c["arguments"])}}
                for _, c in sorted(self.tool_calls.items())
            ]
        return msg


class SSEFilter:
    """Incremental: feed D's bytes, forward what it returns; `params` holds D's handle."""

    __slots__ = ("_buf", "params", "collector")

    def __init__(self, collector: MessageCollector | None = None) -> None:
        self._buf = b""
        self.params: dict[str, Any] | None = None
        self.collector = collector

    def feed(self, chunk: bytes) -> bytes:
        data = self._buf + chunk if self._buf else chunk
        cut = event_boundary(data)
        if cut == 0:
            self._buf = data
            return b""
        if cut == len(data):
            ready, self._buf = data, b""
        else:
            ready, self._buf = data[:cut], data[cut:]
        if self.collector is not None:
            return self._process(ready)
        at = ready.find(_MARKER)
        if at >= 0 and _NULL in ready:
            ready = ready.replace(_NULL, b"")
            at = ready.find(_MARKER)
        if at < 0:
            return ready
        # Events before the one holding the params pass through as they are.
        start = event_boundary(ready, at)
        return ready[:start] + self._process(ready[start:])

    @property
    def holding(self) -> bool:
        """Bytes of an event not yet complete are held (`finish` would return them)."""
        return bool(self._buf)

    def finish(self) -> bytes:
        """Whatever is left at the end of the stream (an unterminated last event)."""
        rest, self._buf = self._buf, b""
        if not rest.strip():
            return rest
        return self._process(rest + b"\n\n")

    def _process(self, ready: bytes) -> bytes:
        out: list[bytes] = []
        for event in split_events(ready):
            data = event_data(event)
            if data is None or data == b"[DONE]" or (
                self.collector is None and _MARKER not in data
            ):
                out.append(event + b"\n\n")
                continue
            try:
                chunk = loads(data)
            except ValueError:
                out.append(event + b"\n\n")
                continue
            if not isinstance(chunk, dict):
                out.append(event + b"\n\n")
                continue
            if self.collector is not None:
                self.collector.feed_chunk(chunk)
            if PARAMS not in chunk:
                out.append(event + b"\n\n")
                continue
            params = chunk.get(PARAMS)
            if isinstance(params, dict):
                self.params = params
            kept = strip_params(chunk)
            if kept is not None:
                out.append(b"data: " + dumps(kept) + b"\n\n")
        return b"".join(out)
