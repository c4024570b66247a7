"""One chat request, timed at the client: TTFT is the first chunk carrying content.

Plain http.client on purpose: one request at a time, no event loop between the socket
and the clock, nothing that buffers the first SSE chunk.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


class RequestFailed(RuntimeError):
    """The server answered with an error or broke the stream; the message says which."""


@dataclass
class Reply:
    ttft_s: float  # to the first content token (streamed), or the whole reply (not streamed)
    total_s: float
    text: str
    usage: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None
    streamed: bool = True
    # The answer's HTTP headers, names in lower case (a router's placement header).
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int | None:
        return self.usage.get("prompt_tokens")

    @property
    def completion_tokens(self) -> int | None:
        return self.usage.get("completion_tokens")


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return cls(parts.hostname or "127.0.0.1", parts.port, timeout=timeout), parts.path


def sse_events(lines: Any) -> Any:
    """JSON payloads of `data:` lines until `data: [DONE]` (iterator of bytes lines)."""
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        try:
            yield json.loads(data)
        except ValueError:
            raise RequestFailed(f"stream carried a line that is not JSON: {data[:200]!r}"
                                ) from None


def delta_text(event: dict[str, Any]) -> str:
    """Content of one chat (delta.content) or completions (text) chunk; '' if none."""
    for choice in event.get("choices") or []:
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if text:
            return text
    return ""


def chat(base_url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
         timeout: float = 600.0, path: str = "/v1/chat/completions") -> Reply:
    """POST a chat completion; streamed when body['stream'] is true."""
    conn, prefix = _connection(base_url, timeout)
    payload = json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    stream = bool(body.get("stream"))
    try:
        t0 = time.perf_counter()
        conn.request("POST", prefix.rstrip("/") + path, body=payload, headers=hdrs)
        resp = conn.getresponse()
        if resp.status != 200:
            detail = resp.read()[:500].decode("utf-8", errors="replace")
            raise RequestFailed(f"HTTP {resp.status} from {base_url}: {detail}")
        head = {k.lower(): v for k, v in resp.getheaders()}
        if not stream:
            data = json.loads(resp.read())
            t = time.perf_counter() - t0
            choice = (data.get("choices") or [{}])[0]
            text = (choice.get("message") or {}).get("content") or choice.get("text") or ""
            return Reply(t, t, text, data.get("usage") or {}, choice.get("finish_reason"),
                         streamed=False, headers=head)
        ttft: float | None = None
        parts: list[str] = []
        usage: dict[str, Any] = {}
        finish = None
        for event in sse_events(resp):
            if "error" in event:
                raise RequestFailed(f"stream error from {base_url}: {event['error']}")
            text = delta_text(event)
            if text:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(text)
            for choice in event.get("choices") or []:
                finish = choice.get("finish_reason") or finish
            if event.get("usage"):
                usage = event["usage"]
        total = time.perf_counter() - t0
        if ttft is None:
            raise RequestFailed(f"stream from {base_url} ended without any content")
        return Reply(ttft, total, "".join(parts), usage, finish, headers=head)
    except (OSError, http.client.HTTPException) as exc:
        raise RequestFailed(f"request to {base_url} failed: {exc}") from None
    finally:
        conn.close()


def first_model(base_url: str, timeout: float = 10.0) -> str:
    """The id of the first model /v1/models lists."""
    conn, prefix = _connection(base_url, timeout)
    try:
        conn.request("GET", prefix.rstrip("/") + "/v1/models")
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise RequestFailed(f"GET {base_url}/v1/models: HTTP {resp.status}")
        models = json.loads(body).get("data") or []
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise RequestFailed(f"GET {base_url}/v1/models failed: {exc}") from None
    finally:
        conn.close()
    if not models:
        raise RequestFailed(f"{base_url}/v1/models lists no model")
    return str(models[0]["id"])


def post_json(url: str | None, body: dict[str, Any], timeout: float = 5.0,
              sign: Callable[[bytes], Mapping[str, str]] | None = None
              ) -> dict[str, Any] | None:
    """POST a JSON body, the JSON object answered; None when there is no URL, or on any
    failure (an optional side read, such as decode's residency report). `sign`: headers
    that authenticate these exact bytes."""
    if not url:
        return None
    conn, path = _connection(url, timeout)
    raw = json.dumps(body).encode()
    try:
        conn.request("POST", path or "/", body=raw,
                     headers={"Content-Type": "application/json",
                              **(sign(raw) if sign else {})})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            return None
        out = json.loads(data)
        return out if isinstance(out, dict) else None
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()
