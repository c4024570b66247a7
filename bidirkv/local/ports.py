"""Ports of a local stack: every server shares 127.0.0.1, so each needs its own."""

from __future__ import annotations

import os
import pathlib
import random
import socket
from collections.abc import Iterable, Mapping

from bidirkv.local.engines import LOOPBACK


class PortInUse(RuntimeError):
    """A port the stack needs is taken; the message names the port and its use."""


def port_free(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # Without SO_REUSEADDR, a port in TIME_WAIT from the previous stack would look taken
        # although a server (which sets it) can bind it.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for port-0 binds (Linux; the IANA range elsewhere)."""
    try:
        lo, hi = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 49152, 65535


def free_ports(n: int, host: str = LOOPBACK, rng: random.Random | None = None) -> list[int]:
    """n distinct ports free now, below the ephemeral range: vLLM binds port 0 for its
    internal sockets, and a port of ours taken from that range could be handed to one of
    them between this check and our server's bind."""
    lo, _ = ephemeral_range()
    first, last = 20000, max(20000 + 4 * n, lo - 1)
    rng = rng or random.Random()
    # A random start: two stacks started at once rarely probe the same ports.
    start = rng.randrange(first, last - n)
    out: list[int] = []
    for port in [*range(start, last), *range(first, start)]:
        if port_free(port, host):
            out.append(port)
            if len(out) == n:
                return out
    raise PortInUse(f"no {n} free ports between {first} and {last} on {host}")


def sequential_ports(base: int, n: int) -> list[int]:
    if not 1024 <= base <= 65535 - n:
        raise ValueError(f"--port-base {base}: must be 1024-{65535 - n} ({n} ports follow it)")
    return list(range(base, base + n))


def check_ports(named: Mapping[str, int], host: str = LOOPBACK) -> None:
    """Raise PortInUse for the first taken port, naming what it was meant for and, where
    /proc shows it, the process holding it."""
    for what, port in named.items():
        if not port_free(port, host):
            holders = ", ".join(f"pid {pid} ({_comm(pid)})" for pid in port_holders(port))
            by = f" by {holders}" if holders else ""
            raise PortInUse(f"port {port} ({what}) is in use on {host}{by}: stop what holds "
                            "it or choose other ports (--port-base)")


def port_holders(port: int) -> list[int]:
    """Pids with a TCP socket on this local port (any address), as far as /proc shows:
    only this user's processes, on Linux; for the message, never to signal them."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = pathlib.Path("/proc/net", table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            fields = line.split()
            if len(fields) > 9 and fields[9] != "0" and fields[1].endswith(f":{port:04X}"):
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return []
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in inodes:
                    pids.append(int(entry.name))
                    break
            except OSError:
                continue
    return sorted(pids)


def _comm(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "exited"


def duplicates(ports: Iterable[int]) -> set[int]:
    seen: set[int] = set()
    dup: set[int] = set()
    for p in ports:
        (dup if p in seen else seen).add(p)
    return dup
