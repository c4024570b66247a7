"""Prometheus text exposition -> samples, and the per-request deltas the benchmark reads.

The benchmark sends one request at a time, so the difference of a counter (or of a
histogram's _sum) between two scrapes is that one request's share.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Mapping

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = float(s.value)
    return out


def scrape(url: str | None, timeout: float = 5.0) -> Samples | None:
    """The samples at url (a /metrics endpoint); None when there is none or it fails."""
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return parse(resp.read().decode("utf-8", errors="replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def total(samples: Samples | None, name: str, **labels: str) -> float | None:
    """Sum of the samples named `name` whose labels include `labels`; None if none."""
    if samples is None:
        return None
    want = set(labels.items())
    values = [v for (n, lab), v in samples.items() if n == name and want <= lab]
    return sum(values) if values else None


def delta(before: Samples | None, after: Samples | None, name: str, **labels: str
          ) -> float | None:
    a, b = total(before, name, **labels), total(after, name, **labels)
    if b is None:
        return None
    return b - (a or 0.0)


def deltas(before: Samples | None, after: Samples | None,
           wanted: Mapping[str, tuple[str, dict[str, str]]]) -> dict[str, float | None]:
    """{key: delta} for {key: (sample name, label filter)}."""
    return {key: delta(before, after, name, **labels) for key, (name, labels) in wanted.items()}
