"""Backend engines (prefill or decode replicas) and the pools the router picks from."""

from __future__ import annotations

from urllib.parse import urlsplit

PREFILL = "prefill"
DECODE = "decode"


class Backend:
    """One engine. `outstanding` counts legs in flight; `healthy` is the router's view;
    `draining`: the engine said it is leaving (bidirkv/router/pool/drain.py)."""

    __slots__ = ("url", "role", "host", "healthy", "outstanding", "engine_id", "in_pool",
                 "draining")

    def __init__(self, url: str, role: str) -> None:
        self.url = url
        self.role = role
        # The host the router reaches the engine at; it replaces the engine's own idea of
        # its address in params, as vLLM's example proxy does (a bind address like
        # 0.0.0.0 in an engine's reply would be useless to its peer).
        self.host = urlsplit(url).hostname or ""
        # Optimistic until the first health check (which runs at start): a router must
        # not refuse traffic for the seconds it takes to probe its backends.
        self.healthy = True
        self.outstanding = 0
        # remote_engine_id D last reported; a change means the engine restarted.
        self.engine_id: str | None = None
        self.in_pool = True
        # Healthy and serving what it holds, but given no new work: no first turn, no
        # extend, no decode leg while a replica that is not leaving can take it.
        self.draining = False

    def __repr__(self) -> str:
        state = ("draining" if self.draining else "up") if self.healthy else "down"
        return f"Backend({self.role} {self.url} {state} out={self.outstanding})"


class Pool:
    """The replicas of one role, in configuration order."""

    def __init__(self, role: str, urls: list[str]) -> None:
        self.role = role
        self.backends: list[Backend] = [Backend(u, role) for u in urls]
        self._turn = 0

    def next_start(self) -> int:
        """Rotating scan start for tie-breaking; one counter per pool, so the prefill and
        decode picks of one request do not move in lockstep."""
        self._turn += 1
        return self._turn

    def reconcile(self, urls: list[str]) -> tuple[list[Backend], list[Backend]]:
        """Adopt a new URL list; (added, removed). Kept replicas keep their state, and
        requests in flight hold their Backend object, so nothing in flight is disturbed."""
        current = {b.url: b for b in self.backends}
        new = [current.get(u) or Backend(u, self.role) for u in urls]
        kept = {b.url for b in new}
        removed = [b for b in self.backends if b.url not in kept]
        added = [b for b in new if b.url not in current]
        for b in removed:
            b.in_pool = False
        self.backends = new
        return added, removed

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def get(self, url: str) -> Backend | None:
        for b in self.backends:
            if b.url == url:
                return b
        return None
