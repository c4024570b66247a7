"""Hostile JSON the parser accepts but the router cannot carry, found before it does harm.

- Nesting: Python's JSON parser and everything after it (identity hashing, re-encoding
  for the legs) recurse per level, so a body of 10^5 `[` ends as a RecursionError.
  Bodies nested deeper than MAX_DEPTH are refused before parsing, by peeling matched
  bracket pairs off the body's bracket skeleton (string contents removed first), one
  level per pass, all in C: linear in the body per level, at most MAX_DEPTH passes.
- Lone surrogates: `"\\ud800"` is valid JSON but no UTF-8; the router re-encodes the
  body for both legs and would fail there. Only bodies with such an escape are walked.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 64
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")
_PAIR = re.compile(rb"\[\]|\{\}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def nesting_problem(raw: bytes, max_depth: int = MAX_DEPTH) -> str | None:
    """Why the body is nested too deeply to parse (None: it is not)."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return None  # not enough brackets to be deeper
    skeleton = _NOT_BRACKET.sub(b"", _STRING.sub(b"", raw))
    for _ in range(max_depth):
        if not skeleton:
            return None
        peeled = _PAIR.sub(b"", skeleton)
        if peeled == skeleton:
            return None  # unbalanced: the parser says what is wrong
        skeleton = peeled
    if skeleton:
        return f"JSON nested deeper than {max_depth} levels is not accepted"
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
