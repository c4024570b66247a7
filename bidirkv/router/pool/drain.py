"""Which decode replicas are leaving, from their residency reports.

A decode pod that got SIGTERM says `"draining": true` in its answer to the router's
residency call (its launcher asked it to drain: bidirkv/connector/drain.py). Such a
replica gets no new work (bidirkv/router/pool/selection.py, placement.py); a turn whose
history it holds reads the blocks back through prefill and decodes elsewhere, so each of
its conversations moves on its next turn, and the pod exits once none is left.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from bidirkv.router.pool.backends import Backend


def says_draining(report: Mapping[str, Any] | None) -> bool | None:
    """The report's word on draining; None: it says nothing (no answer yet, or an engine
    that predates the field), so the router keeps what it knew."""
    if not report:
        return None
    value = report.get("draining")
    return value if isinstance(value, bool) else None


def mark_draining(backends: Iterable[Backend],
                  report_of: Callable[[str], Mapping[str, Any] | None]) -> list[Backend]:
    """Set each replica's `draining` from its last report; the replicas that changed."""
    changed = []
    for b in backends:
        said = says_draining(report_of(b.url))
        if said is not None and said != b.draining:
            b.draining = said
            changed.append(b)
    return changed
