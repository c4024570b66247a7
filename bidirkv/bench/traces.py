"""The router's span file (`tracing.file`: one span a line, as
bidirkv/router/tracing/spanfile.py writes them), read back and shown as an indented tree:

    POST /v1/chat/completions  41.3 ms  HTTP 200, reuse hit, 9412 prompt tokens
      prefill  12.0 ms at +0.4 ms  127.0.0.1:8100, HTTP 200, KV offered 8400, reused 8384
      decode  28.6 ms at +12.6 ms  127.0.0.1:8200, HTTP 200, KV offered 9412

Pure functions over the span dicts, apart from `read_spans`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

Span = dict[str, Any]
SERVER = "SPAN_KIND_SERVER"
# Reuse outcomes (the request span's bidirkv.reuse) of a turn that came back to KV kept
# for its conversation.
RETURNING = ("hit", "verified-partial", "extended")


def read_spans(path: str | Path) -> list[Span]:
    """Every span in the file; a line that is not a span (cut short when the router was
    killed mid-write) is skipped."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                span = json.loads(line)
            except ValueError:
                continue
            if isinstance(span, dict) and span.get("traceId") and span.get("spanId"):
                out.append(span)
    return out


def by_trace(spans: Iterable[Span]) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = {}
    for s in spans:
        out.setdefault(s["traceId"], []).append(s)
    return out


def _start(span: Span) -> int:
    return int(span.get("startTimeUnixNano") or 0)


def _ms(nanos: int) -> float:
    return nanos / 1e6


def returning_turn(spans: Iterable[Span]) -> str | None:
    """The trace id of the latest request that reused its conversation's KV, else of
    the latest request; None without a request span."""
    requests = sorted((s for s in spans if s.get("kind") == SERVER), key=_start)
    back = [s for s in requests if (s.get("attributes") or {}).get("bidirkv.reuse")
            in RETURNING]
    chosen = back or requests
    return chosen[-1]["traceId"] if chosen else None


def tree(spans: list[Span]) -> list[tuple[int, Span]]:
    """(depth, span) depth first, children by start time. Roots are the spans whose
    parent is not in `spans` (a client's own span never is)."""
    ids = {s["spanId"] for s in spans}
    children: dict[str, list[Span]] = {}
    roots = []
    for s in sorted(spans, key=_start):
        parent = s.get("parentSpanId") or ""
        if parent and parent in ids and parent != s["spanId"]:
            children.setdefault(parent, []).append(s)
        else:
            roots.append(s)
    out: list[tuple[int, Span]] = []
    seen: set[str] = set()

    def walk(span: Span, depth: int) -> None:
        if span["spanId"] in seen:  # a malformed file must not loop
            return
        seen.add(span["spanId"])
        out.append((depth, span))
        for child in children.get(span["spanId"], []):
            walk(child, depth + 1)

    for root in roots:
        walk(root, 0)
    return out


def details(span: Span) -> str:
    """What a span says, in a few words: status, reuse, placement, KV tokens."""
    a = span.get("attributes") or {}
    parts = []
    if "server.address" in a:
        parts.append(f"{a['server.address']}:{a.get('server.port', '')}".rstrip(":"))
    if a.get("bidirkv.leg.attempt"):
        parts.append(f"retry {a['bidirkv.leg.attempt']}")
    if a.get("http.request.resend_count"):
        parts.append("resent on a new connection")
    if "http.response.status_code" in a:
        parts.append(f"HTTP {a['http.response.status_code']}")
    result = a.get("bidirkv.leg.result", a.get("bidirkv.outcome"))
    if result not in (None, "ok"):
        parts.append(str(result))
    if a.get("bidirkv.serving_mode"):
        parts.append(str(a["bidirkv.serving_mode"]))
    if "bidirkv.reuse" in a:
        parts.append(f"reuse {a['bidirkv.reuse']}")
    if "bidirkv.placement.decision" in a:
        parts.append(f"placed {a['bidirkv.placement.decision']} "
                     f"({a.get('bidirkv.placement.reason', '')})")
    if "bidirkv.kv.offered_tokens" in a:
        kv = f"KV offered {a['bidirkv.kv.offered_tokens']}"
        if "bidirkv.kv.reused_tokens" in a:
            kv += f", reused {a['bidirkv.kv.reused_tokens']}"
        parts.append(kv)
    if span.get("kind") == SERVER and "gen_ai.usage.input_tokens" in a:
        parts.append(f"{a['gen_ai.usage.input_tokens']} prompt tokens")
    return ", ".join(parts)


def format_trace(spans: list[Span]) -> str:
    """One trace as an indented tree: name, duration, start after the root's, details."""
    rows = tree(spans)
    if not rows:
        return ""
    t0 = _start(rows[0][1])
    lines = []
    for depth, s in rows:
        took = _ms(int(s.get("endTimeUnixNano") or 0) - _start(s))
        at = "" if depth == 0 else f" at +{_ms(_start(s) - t0):.1f} ms"
        info = details(s)
        lines.append(f"{'  ' * depth}{s.get('name', '?')}  {took:.1f} ms{at}"
                     + (f"  {info}" if info else ""))
    return "\n".join(lines)


def returning_turn_text(path: str | Path) -> str | None:
    """The tree of the latest returning turn in the file at `path`; None when the file
    is missing or holds no request span."""
    try:
        spans = read_spans(path)
    except OSError:
        return None
    trace_id = returning_turn(spans)
    if trace_id is None:
        return None
    return f"trace {trace_id}\n" + format_trace(by_trace(spans)[trace_id])
