"""Which engine replicas are leaving, from their residency reports.

A pod that got SIGTERM says `"draining": true` in its residency answer
(bidirkv/connector/drain.py), and gets no new work while another replica can take it
(selection.py, placement.py): decode's conversations move on their next turns, and a
prefill pod's legs in flight end. Decode's report comes with the lease renewal
(residency.py); prefill holds no lease, so it is asked for the report alone
(`PrefillReports`: a signed call with neither owner nor lease, which changes nothing).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import aiohttp

from bidirkv.router.codec import loads
from bidirkv.router.pool.backends import Backend
from bidirkv.wire import RESIDENCY_PATH, RESIDENCY_VERSION_FIELD, VERSION

log = logging.getLogger("bidirkv.router")

# (session, url, body) -> (status, raw body): a signed POST of the residency route
# (ResidencyClient.post).
Post = Callable[[aiohttp.ClientSession, str, dict[str, Any]], Awaitable[tuple[int, bytes]]]


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


def report_only() -> dict[str, Any]:
    """A residency call's body that asks for the report and nothing else: without an
    owner and a lease the engine renews, releases and keeps nothing
    (bidirkv/connector/endpoint.py)."""
    return {RESIDENCY_VERSION_FIELD: VERSION}


class PrefillReports:
    """Each prefill replica's last residency report, asked for once per health round."""

    def __init__(self, post: Post) -> None:
        self.post = post
        self.last: dict[str, dict[str, Any]] = {}
        # Replicas without the route (the bidir-kv plugin not loaded): not asked again.
        self.unsupported: set[str] = set()
        # The last refusal per replica (401: another handle key, 409: another wire
        # version): said once, not every round.
        self.refused: dict[str, int] = {}

    def keep_only(self, urls: Iterable[str]) -> None:
        """Forget replicas no longer configured: a URL configured again starts afresh,
        not with what its predecessor said."""
        keep = set(urls)
        for known in (self.last, self.refused):
            for url in [u for u in known if u not in keep]:
                del known[url]
        self.unsupported &= keep

    async def ask(self, session: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
        """The replica's report, kept as its last; None when it gave none (what it said
        before stands: a failed call says nothing about a drain)."""
        if url in self.unsupported:
            return None
        try:
            status, raw = await self.post(session, url, report_only())
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.debug("prefill residency report failed url=%s: %s", url, type(exc).__name__)
            return None
        if status == 404:
            self.unsupported.add(url)
            log.warning("prefill %s has no %s (bidir-kv plugin not loaded?): the router "
                        "cannot tell when it drains", url, RESIDENCY_PATH)
            return None
        if status != 200:
            if self.refused.get(url) != status:
                log.warning("prefill %s refused the residency report (%d): %s", url, status,
                            raw[:200])
            self.refused[url] = status
            return None
        self.refused.pop(url, None)
        try:
            report = loads(raw)
        except ValueError:
            return None
        if not isinstance(report, dict):
            return None
        self.last[url] = report
        return report
