"""Label and field selectors, as the apiserver parses ``labelSelector``/``fieldSelector``."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

_KEY = r"[A-Za-z0-9][-A-Za-z0-9_./]*"
_VALUE = r"[-A-Za-z0-9_.]*"
_EXISTS_RE = re.compile(rf"^(!?)\s*({_KEY})$")
_SET_RE = re.compile(rf"^({_KEY})\s+(in|notin)\s*\(([^)]*)\)$")
_EQ_RE = re.compile(rf"^({_KEY})\s*(==|=|!=)\s*({_VALUE})$")
_CMP_RE = re.compile(rf"^({_KEY})\s*(<|>)\s*(-?\d+)$")


def _split_terms(text: str) -> list[str]:
    """Split on commas that are not inside ``in (...)`` parentheses."""
    terms, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            terms.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    terms.append("".join(cur))
    return [t.strip() for t in terms if t.strip()]


Requirement = Callable[[dict], bool]


@dataclass(frozen=True)
class LabelSelector:
    text: str
    requirements: tuple[Requirement, ...]

    @classmethod
    def parse(cls, text: str | None) -> LabelSelector:
        """Raises ValueError on syntax errors (the apiserver answers 400 BadRequest)."""
        reqs: list[Requirement] = []
        for term in _split_terms(text or ""):
            reqs.append(_parse_label_term(term))
        return cls(text or "", tuple(reqs))

    def matches(self, labels: dict | None) -> bool:
        labels = labels or {}
        return all(req(labels) for req in self.requirements)

    def __bool__(self) -> bool:
        return bool(self.requirements)


def _parse_label_term(term: str) -> Requirement:
    if m := _SET_RE.match(term):
        key, op = m.group(1), m.group(2)
        values = {v.strip() for v in m.group(3).split(",") if v.strip()}
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if m := _EQ_RE.match(term):
        key, op, value = m.groups()
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    if m := _CMP_RE.match(term):
        key, op, num = m.group(1), m.group(2), int(m.group(3))

        def compare(labels: dict) -> bool:
            try:
                have = int(labels[key])
            except (KeyError, ValueError):
                return False
            return have > num if op == ">" else have < num

        return compare
    if m := _EXISTS_RE.match(term):
        negate, key = m.group(1) == "!", m.group(2)
        return lambda labels: (key in labels) != negate
    raise ValueError(f"unable to parse requirement: {term!r}")


def _dotted(obj: dict, path: str):
    cur = obj
    for part in path.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def _field_str(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass(frozen=True)
class FieldSelector:
    text: str
    terms: tuple[tuple[str, bool, str], ...]  # (path, equal?, value)

    @classmethod
    def parse(cls, text: str | None, allowed: tuple[str, ...] = ()) -> FieldSelector:
        """Only ``metadata.name``, ``metadata.namespace`` and ``allowed`` paths are selectable;
        anything else is a 400 like on a real apiserver ("field label not supported")."""
        terms = []
        for term in _split_terms(text or ""):
            m = re.match(r"^([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*)$", term)
            if not m:
                raise ValueError(f"invalid selector: {term!r}")
            path, op, value = m.groups()
            if path not in ("metadata.name", "metadata.namespace") and path not in allowed:
                raise ValueError(f"field label not supported: {path}")
            terms.append((path, op != "!=", value.strip()))
        return cls(text or "", tuple(terms))

    def matches(self, obj: dict) -> bool:
        return all((_field_str(_dotted(obj, p)) == v) == eq for p, eq, v in self.terms)

    def __bool__(self) -> bool:
        return bool(self.terms)


def selector_to_string(selector: dict | None) -> str:
    """Render a ``metav1.LabelSelector`` (matchLabels/matchExpressions) in query syntax,
    as the ``/scale`` subresource reports it in ``status.selector``."""
    if not selector:
        return ""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if op == "In":
            parts.append(f"{key} in ({','.join(sorted(values))})")
        elif op == "NotIn":
            parts.append(f"{key} notin ({','.join(sorted(values))})")
        elif op == "Exists":
            parts.append(key)
        elif op == "DoesNotExist":
            parts.append(f"!{key}")
    return ",".join(parts)
