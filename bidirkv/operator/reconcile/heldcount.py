"""How many conversations a draining decode pod still holds: its engine's own gauge,
`vllm:bidirkv_retained_requests` on /metrics (connector/core/workingset.py), read once
per pass for the status and the DrainTimedOut Event. A read that fails leaves the count
unknown; it is never an error of the pass.

Whoever can set a resource's image runs what answers there, so the answer is not
trusted: the read is the event loop's own I/O (never a thread of the executor every
Kubernetes call needs), ends at READ_DEADLINE_S, reads a pod once at a time, follows no
redirect, and the count is clamped to MAX_HELD. All is pure but `fetch` and `HeldReads`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import http.client
import io
import ipaddress
import logging
import math
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

from bidirkv.operator.reconcile.drainwatch import leaving

log = logging.getLogger("bidirkv.operator")

# The engine's gauge (connector/core/workingset.py holds the same name; a test ties them).
RETAINED_REQUESTS_METRIC = "vllm:bidirkv_retained_requests"
# The engine container's HTTP port, by the name the operator renders it under.
PORT_NAME = "http"
# The whole of one read (connect, request, the answer to its last byte): the pass waits
# for it, and an answer that trickles is cut here.
READ_DEADLINE_S = 1.0
# The most of an answer's body that is read: vLLM's whole /metrics is a few hundred KiB,
# and the query below asks for the one gauge (prometheus_client's `name[]` filter). Its
# status line and headers may add _HEAD_BYTES.
MAX_BYTES = 4 << 20
_HEAD_BYTES = 64 << 10
# The most conversations one pod's reading counts (its samples summed, then clamped): a
# decode engine holds at most one per KV block it has, far below this; an engine that
# says more (or a gauge out of int64) would otherwise put it in the status.
MAX_HELD = 1_000_000
# Pods whose redirect was logged: once each; forgotten past this many.
_LOGGED_MAX = 1024
_QUERY = urllib.parse.urlencode({"name[]": RETAINED_REQUESTS_METRIC})


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
    per engine of the server) and clamped to MAX_HELD; None when it has none, or one
    that is not a count (a malformed line, NaN, a negative or fractional value): unknown,
    never a wrong count."""
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
        total = min(MAX_HELD, total + min(MAX_HELD, int(value)))
        seen = True
    return total if seen else None


def metrics_url(pod: Mapping[str, Any]) -> str | None:
    """Where the pod's engine serves /metrics: its IP (status.podIP, an IP address: no
    name is looked up) and the port its engine container names `http`; None when the
    pod says neither."""
    ip = (pod.get("status") or {}).get("podIP")
    try:
        address = ipaddress.ip_address(ip) if isinstance(ip, str) else None
    except ValueError:
        return None
    if address is None:
        return None
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            number = port.get("containerPort")
            if (port.get("name") == PORT_NAME and isinstance(number, int)
                    and not isinstance(number, bool) and 0 < number < 65536):
                host = f"[{address}]" if address.version == 6 else str(address)
                return f"http://{host}:{number}/metrics?{_QUERY}"
    return None


def pod_key(pod: Mapping[str, Any]) -> str:
    """The pod, as one read at a time is kept to: its uid (its name where it has none)."""
    meta = pod.get("metadata") or {}
    return str(meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}")


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


class _Received:
    """A whole answer as http.client parses it off a socket (chunked or not)."""

    def __init__(self, raw: bytes):
        self._raw = raw

    def makefile(self, mode: str) -> io.BytesIO:
        return io.BytesIO(self._raw)


def answer(raw: bytes) -> tuple[int, bytes] | None:
    """(status, body) of a whole HTTP/1.x answer; None when it is not one, or its body is
    over MAX_BYTES."""
    response = http.client.HTTPResponse(_Received(raw))
    try:
        response.begin()
        body = response.read(MAX_BYTES + 1)
    except (http.client.HTTPException, OSError, ValueError):
        return None
    return (response.status, body) if len(body) <= MAX_BYTES else None


async def fetch(url: str, deadline: float = READ_DEADLINE_S) -> tuple[int, bytes] | None:
    """GET `url` (an IP address and port: see metrics_url) on the event loop itself,
    connect, request and answer all within `deadline` seconds; None on any failure. The
    answer is read until the engine closes (the request says `Connection: close`), and
    whatever it says is only parsed: a redirect is an answer like another."""
    parts = urllib.parse.urlsplit(url)
    request = (f"GET {parts.path}?{parts.query} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
               "Accept: text/plain\r\nAccept-Encoding: identity\r\n"
               "Connection: close\r\n\r\n").encode("ascii")
    writer = None
    raw = bytearray()
    try:
        async with asyncio.timeout(deadline):
            # A numeric host: asyncio resolves it without getaddrinfo (a thread).
            reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
            writer.write(request)
            while chunk := await reader.read(1 << 16):
                raw += chunk
                if len(raw) > MAX_BYTES + _HEAD_BYTES:
                    return None
    except (OSError, TimeoutError, ValueError):
        return None
    finally:
        if writer is not None:
            writer.transport.abort()
    return answer(bytes(raw))


async def fetch_retained(url: str, deadline: float = READ_DEADLINE_S) -> int | None:
    """One read of the engine's gauge; None on any failure, a redirect included."""
    got = await fetch(url, deadline)
    if got is None or got[0] != 200:
        return None
    return retained_in(got[1].decode("utf-8", errors="replace"))


class HeldReads:
    """The operator's reads of draining decode pods' gauges, one outstanding per pod."""

    def __init__(self, deadline: float = READ_DEADLINE_S):
        self.deadline = deadline
        self._reading: set[str] = set()
        self._redirects_logged: set[str] = set()

    async def read(self, pods: Sequence[Mapping[str, Any]], now: dt.datetime
                   ) -> dict[str, int]:
        """Pod name -> conversations held, for each draining decode pod whose engine
        answered (all read at once; the pass waits at most about the deadline). A pod
        still read by another pass is left out (unknown here, its status keeps the
        last reading)."""
        urls = to_read(pods, now)
        keys = {(p.get("metadata") or {}).get("name"): pod_key(p) for p in pods}
        mine = {name: url for name, url in urls.items() if keys[name] not in self._reading}
        self._reading.update(keys[name] for name in mine)
        try:
            got = await asyncio.gather(*(self._one(keys[name], name, url)
                                         for name, url in mine.items()))
        finally:
            self._reading.difference_update(keys[name] for name in mine)
        return {name: n for name, n in zip(mine, got, strict=True) if n is not None}

    async def _one(self, key: str, name: str, url: str) -> int | None:
        got = await fetch(url, self.deadline)
        if got is None:
            return None
        status, body = got
        if 300 <= status < 400:
            self._redirected(key, name, status)
        if status != 200:
            return None
        return retained_in(body.decode("utf-8", errors="replace"))

    def _redirected(self, key: str, name: str, status: int) -> None:
        if key in self._redirects_logged:
            return
        if len(self._redirects_logged) >= _LOGGED_MAX:
            self._redirects_logged.clear()
        self._redirects_logged.add(key)
        log.warning("decode pod %s answered its /metrics with a redirect (%d), which is "
                    "not followed: its count of conversations stays unknown", name, status)
