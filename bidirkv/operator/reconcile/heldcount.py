"""How many conversations a draining decode pod still holds: its engine's own gauge.

A decode engine exports `vllm:bidirkv_retained_requests` on vLLM's /metrics (engine
port): the requests it retains for a later turn that no read or release acts on yet, one
per conversation whose next turn has not come back (connector/core/workingset.py). While
a decode pod drains, the operator reads it there once per pass, so the status can say how
many conversations each draining pod still holds and the DrainTimedOut Event how many
recompute. A read that fails (no pod IP yet, the engine already stopped, a NetworkPolicy
that does not let the operator in, a slow answer) leaves the count unknown; it is never
an error of the pass.

Everything here is pure but `fetch_retained`, the one HTTP read, and `read_held`, which
runs those reads side by side in threads (the kopf event loop never blocks).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from bidirkv.operator.reconcile.drainwatch import leaving

# The engine's gauge (connector/core/workingset.py holds the same name; a test ties them).
RETAINED_REQUESTS_METRIC = "vllm:bidirkv_retained_requests"
# The engine container's HTTP port, by the name the operator renders it under.
PORT_NAME = "http"
# One read may take this long: the pass waits for it.
READ_TIMEOUT_S = 1.0
# The most of an answer that is read: vLLM's whole /metrics is a few hundred KiB, and the
# query below asks for the one gauge (prometheus_client's `name[]` filter).
MAX_BYTES = 4 << 20
_QUERY = urllib.parse.urlencode({"name[]": RETAINED_REQUESTS_METRIC})
# Pod IPs are reached directly, never through a proxy the environment names.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _labels_end(rest: str) -> int | None:
    """Index just past the `}` closing the label set `rest` starts with (label values are
    quoted and may hold `}`, `,` and escaped quotes); None: it never closes."""
    quoted = escaped = False
    for i, ch in enumerate(rest):
        if escaped:
            escaped = False
        elif quoted:
            if ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch == "}":
            return i + 1
    return None


def retained_in(text: str, name: str = RETAINED_REQUESTS_METRIC) -> int | None:
    """The gauge's value in a Prometheus text exposition, summed over its samples (one
    per engine of the server); None when it has none, or one that is not a count (a
    malformed line, NaN, a negative or fractional value): unknown, never a wrong count."""
    total, seen = 0, False
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name):]
        if rest.startswith("{"):
            end = _labels_end(rest)
            if end is None:
                return None
            rest = rest[end:]
        elif rest[:1] not in (" ", "\t"):
            continue  # another metric whose name starts with this one
        fields = rest.split()
        if not fields:
            return None
        try:
            value = float(fields[0])
        except ValueError:
            return None
        if not (math.isfinite(value) and value >= 0 and value == int(value)):
            return None
        total += int(value)
        seen = True
    return total if seen else None


def metrics_url(pod: Mapping[str, Any]) -> str | None:
    """Where the pod's engine serves /metrics: its IP (status.podIP) and the port its
    engine container names `http`; None when the pod says neither."""
    ip = (pod.get("status") or {}).get("podIP")
    if not isinstance(ip, str) or not ip:
        return None
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            number = port.get("containerPort")
            if (port.get("name") == PORT_NAME and isinstance(number, int)
                    and not isinstance(number, bool) and 0 < number < 65536):
                host = f"[{ip}]" if ":" in ip else ip
                return f"http://{host}:{number}/metrics?{_QUERY}"
    return None


def to_read(pods: Sequence[Mapping[str, Any]], now: dt.datetime) -> dict[str, str]:
    """Pod name -> metrics URL of each pod that drains and whose deadline has not passed
    (past it, its launcher stopped the engine; the status keeps the last reading)."""
    out = {}
    for pod in pods:
        drain = leaving(pod)
        if drain is None or now >= drain.deadline:
            continue
        if (url := metrics_url(pod)) is not None:
            out[drain.name] = url
    return out


def fetch_retained(url: str, timeout: float = READ_TIMEOUT_S) -> int | None:
    """One read of the engine's gauge (blocking); None on any failure."""
    try:
        with _OPENER.open(url, timeout=timeout) as response:
            if response.status != 200:
                return None
            body = response.read(MAX_BYTES + 1)
    except (OSError, ValueError):  # URLError, HTTPError, timeouts, a refused connection
        return None
    if len(body) > MAX_BYTES:
        return None
    return retained_in(body.decode("utf-8", errors="replace"))


async def read_held(pods: Sequence[Mapping[str, Any]], now: dt.datetime,
                    timeout: float = READ_TIMEOUT_S) -> dict[str, int]:
    """Pod name -> conversations held, for each draining decode pod whose engine
    answered (all read at once; the pass waits at most about `timeout`)."""
    urls = to_read(pods, now)

    async def one(url: str) -> int | None:
        try:
            # The socket timeout bounds each step of a read, not its whole: a trickling
            # answer is cut here (its thread ends at its own next timeout).
            return await asyncio.wait_for(asyncio.to_thread(fetch_retained, url, timeout),
                                          timeout + 0.5)
        except TimeoutError:
            return None

    got = await asyncio.gather(*(one(url) for url in urls.values()))
    return {name: n for name, n in zip(urls, got, strict=True) if n is not None}
