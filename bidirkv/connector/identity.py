"""Whether a residency call is for this engine: the target its signature names
(`X-Bidirkv-Target`, bidirkv/proof.py), checked against the engine as the call's
connection reaches it (pure). A captured call cannot then be replayed to the resource's
other engines (a drain would mark each of them leaving for good).

A target names this engine when its port is the one the connection came in on and its
host is the connection's own address (`localhost` on a loopback connection), or a DNS
name whose first label is this machine's host name (a pod's own DNS name,
operator/render/naming.py; the launcher's own host, connector/supervise.py). A Service
name in front of several engines names none of them, and is refused.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from bidirkv.proof import RESIDENCY_TARGET_HEADER


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(text.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    # An IPv4 connection to a dual-stack socket reads as ::ffff:a.b.c.d.
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped or ip


def first_label(name: str) -> str:
    return name.split(".", 1)[0].lower()


@dataclass(frozen=True)
class Here:
    """This engine as one connection reaches it."""

    hostname: str  # the machine's (in Kubernetes: the pod's name)
    address: str | None = None  # the connection's local address
    port: int | None = None  # and port

    @classmethod
    def of(cls, server: Any, hostname: str) -> Here:
        """From ASGI's `scope["server"]` (uvicorn: the accepted socket's own address)."""
        if isinstance(server, list | tuple) and len(server) >= 2 and isinstance(server[1], int):
            return cls(hostname, str(server[0]), server[1])
        return cls(hostname)

    def describe(self) -> str:
        at = f"{self.address}:{self.port}" if self.address else "an unknown address"
        return f"this engine is {first_label(self.hostname)!r} (its host name), at {at}"

    def target_problem(self, target: str) -> str | None:
        """Why `target` (a `host:port` of the checked form) does not name this engine
        (None: it does)."""
        host, _, port = target.rpartition(":")
        if self.port is None or int(port) != self.port:
            return f"{RESIDENCY_TARGET_HEADER} {target!r} names another engine: {self.describe()}"
        ip, mine = _ip(host), _ip(self.address or "")
        if ip is not None:
            if ip == mine:
                return None
        elif host == "localhost":
            if mine is not None and mine.is_loopback:
                return None
        elif first_label(host) == first_label(self.hostname):
            return None
        return f"{RESIDENCY_TARGET_HEADER} {target!r} names another engine: {self.describe()}"
