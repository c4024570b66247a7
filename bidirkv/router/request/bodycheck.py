"""Hostile JSON the parser accepts but the router cannot carry, found before it does harm.

- Nesting: code that walks a parsed body recurses per level, so 10^5 `[` end as a
  RecursionError. With orjson (which stops past 1024 levels) the parsed body is walked
  without recursion (`depth_problem`); without it, `nesting_problem` scans the raw body
  first, in one regex pass that stops at the first bracket past MAX_DEPTH.
- Size in values: a body costs per JSON object or array (~12 us each, on the event
  loop), not per byte: 4 MiB of one-word messages stalls every request for a second.
  Bodies with more than `max_containers` are refused before parsing; only one with more
  brackets than that is scanned for those outside strings (`container_problem`).
- Lone surrogates: `"\\ud800"` is valid JSON but no UTF-8, and re-encoding the body for
  the legs would fail. With orjson (which refuses them) only a refused body is scanned,
  for the message that says where; without it, every body with such an escape is.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 64
# A string (skipped whole: brackets inside do not count) or one bracket. The string is
# matched as runs of plain bytes between escapes, which the regex engine walks in one
# tight loop (~7 ms per MiB), not as one alternation per byte (~60 ms per MiB).
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_OPEN = frozenset(b"[{")
_CLOSE = frozenset(b"]}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def nesting_problem(raw: bytes, max_depth: int = MAX_DEPTH) -> str | None:
    """Why the body is nested too deeply to parse (None: it is not). Only without orjson:
    orjson stops by itself, and the parsed body is checked by `depth_problem`."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return None  # not enough brackets to be deeper
    depth = 0
    for m in _TOKEN.finditer(raw):
        c = raw[m.start()]
        if c in _OPEN:
            depth += 1
            if depth > max_depth:
                return deep_message(max_depth)
        elif c in _CLOSE:
            if depth == 0:
                return None  # unbalanced: the parser says what is wrong
            depth -= 1
    return None


def deep_message(max_depth: int = MAX_DEPTH) -> str:
    return f"JSON nested deeper than {max_depth} levels is not accepted"


def container_problem(raw: bytes, max_containers: int) -> str | None:
    """Why the body holds too many objects and arrays (None: it does not). A scan of its
    tokens: parse_request calls it only for a body with more brackets than the bound
    (brackets inside strings count there, not here)."""
    containers = 0
    for m in _TOKEN.finditer(raw):
        if raw[m.start()] in _OPEN:
            containers += 1
            if containers > max_containers:
                return (f"request body has more than {max_containers} JSON objects and "
                        "arrays (maxJsonContainers)")
    return None


def depth_problem(body: Any, max_depth: int = MAX_DEPTH) -> str | None:
    """Why a parsed body is nested too deeply (None: it is not); no recursion. One level
    at a time: the depth is the level's, not carried with each value (a 200-message body
    walks in about half the time). The body is a parser's: its objects and arrays are
    dicts and lists exactly, so each value's type is compared, not isinstance'd, in one
    plain loop (no comprehension per object: half the time again on a long history)."""
    level = [body] if isinstance(body, dict | list) else []
    depth = 1
    while level:
        if depth > max_depth:
            return deep_message(max_depth)
        below: list[Any] = []
        add = below.append
        for value in level:
            for c in value.values() if type(value) is dict else value:
                if type(c) is dict or type(c) is list:
                    add(c)
        level = below
        depth += 1
    return None


def _path(parts: list[Any]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def _bad_string(value: Any, parts: list[Any]) -> str | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return _path(parts)
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if (found := _bad_string(k, [*parts, "<key>"])) or (
                    found := _bad_string(v, [*parts, k])):
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if found := _bad_string(v, [*parts, i]):
                return found
    return None


def surrogate_problem(raw: bytes) -> str | None:
    """Where a string of the body is not valid Unicode text (None: nowhere). Rare, so the
    body is parsed again here (by the standard library, which keeps lone surrogates where
    orjson refuses the whole body) only when it has a surrogate escape at all."""
    if not _SURROGATE_ESCAPE.search(raw):
        return None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None  # the main parser says what is wrong
    where = _bad_string(body, [])
    if where is None:
        return None
    return (f"{where}: contains a lone UTF-16 surrogate escape (\\ud800-\\udfff without "
            "its pair); not valid Unicode text")
