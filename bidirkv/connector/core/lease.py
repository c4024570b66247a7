"""The read grant on NIXL's side channel: a reader asks the issuer right before it reads.

Decode's side channel (a ZMQ ROUTER in its engine-core process, next to the scheduler
that owns the blocks) answers vLLM's handshake (`get_meta_msg`). It also answers one
message of ours:

    request  msgpack [LEASE_MSG, decode request id]                 (one frame)
    reply    msgpack ["granted" | "refused", reason, block ids]     (one frame)

The block ids are vLLM's, one list per KV group, of the blocks decode retained for that
request (empty when refused): decode's handle names only how many there are, so the
router carries and stores a handle that does not grow with the history (wire.py).
Prefill's handle does the same for the blocks it lends decode for a turn: decode asks
prefill with the same message, and prefill answers from `Lent` ("lent", its ids), which
changes nothing (vLLM's lease keeps those blocks until decode's read, as before).
Prefill reads only after "granted" with ids for every block it reads; anything else
(refused, no answer in time, a reply it cannot parse) makes it recompute, the outcome
that can never be wrong. The ask runs in
prefill's worker, one read after another, so it is bounded per peer (`PeerGate`): a
decode that did not answer within `CONFIRM_TIMEOUT_MS` is not asked again for
`QUIET_S`, and reads from it are recomputed at once meanwhile; one hung decode costs one
timeout per window, not one per read. All peers of
a pool run the plugin (one image): an unpatched listener would not understand LEASE_MSG.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from bidirkv.connector.core.handles import PLACEHOLDER_ID

LEASE_MSG = b"bidirkv_lease"
GRANTED = "granted"
# A healthy side channel answers in about a millisecond, from a thread of its own.
CONFIRM_TIMEOUT_MS = 1000
QUIET_S = 10.0
NO_ANSWER = "no answer"
_decode = msgspec.msgpack.Decoder()
_encode = msgspec.msgpack.Encoder()


def lease_request(req_id: str) -> bytes:
    return _encode.encode([LEASE_MSG, req_id])


Grant = tuple[bool, str, list[list[int]]]


def answer(msg: bytes, meta: dict[tuple[int, int], bytes],
           grant: Callable[[str], Grant] | None) -> tuple[bytes, ...]:
    """The reply frames for one side-channel message (never raises)."""
    try:
        parts = _decode.decode(msg)
    except Exception:  # noqa: BLE001 - garbage from the network
        parts = None
    if isinstance(parts, list) and parts:
        kind = parts[0]
        if kind == LEASE_MSG and len(parts) == 2 and isinstance(parts[1], str):
            ok, reason, ids = (grant(parts[1]) if grant is not None
                               else (False, "no_residency", []))
            return (_encode.encode([GRANTED if ok else "refused", reason, ids]),)
        if len(parts) == 3:
            payload = meta.get((parts[1], parts[2]))
            if payload is not None:
                # What vLLM's own listener replies: the agent metadata and decode's clock.
                return payload, _encode.encode(time.perf_counter())
    return (_encode.encode(["error", "unexpected side-channel message"]),)


def _id_lists(v: Any) -> list[list[int]] | None:
    if not isinstance(v, list) or not all(isinstance(g, list) for g in v):
        return None
    ok = all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < (1 << 31)
             for g in v for b in g)
    return v if ok else None


def parse_reply(frames: list[bytes]) -> Grant:
    try:
        status, reason, ids = _decode.decode(frames[0]) if len(frames) == 1 else (
            None, None, None)
    except Exception:  # noqa: BLE001
        return False, "unparsable reply", []
    lists = _id_lists(ids)
    if status == GRANTED and lists is None:
        return False, "granted without block ids", []
    return status == GRANTED, str(reason), lists or []


def confirm(host: str, port: int, req_id: str, timeout_ms: int = CONFIRM_TIMEOUT_MS,
            zmq_module: Any = None) -> Grant:
    """Ask decode at host:port for the grant to read `req_id`: (granted, reason, the
    retained blocks' ids per KV group)."""
    import zmq

    zmq = zmq_module or zmq
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
        sock.connect(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}")
        sock.send(lease_request(req_id))
        return parse_reply(sock.recv_multipart())
    except zmq.Again:
        return False, f"{NO_ANSWER} in {timeout_ms} ms", []
    except zmq.ZMQError as exc:
        return False, f"side channel error: {exc}", []
    finally:
        sock.close(0)


class PeerGate:
    """`confirm`, except towards a peer that lately gave no answer (see the module doc)."""

    def __init__(self, quiet_s: float = QUIET_S, ask: Callable[..., Grant] = confirm,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.quiet_s = quiet_s
        self._ask = ask
        self._clock = clock
        self._lock = threading.Lock()
        self._quiet_until: dict[tuple[str, int], float] = {}

    def confirm(self, host: str, port: int, req_id: str) -> Grant:
        peer = (host, port)
        with self._lock:
            until = self._quiet_until.get(peer)
            if until is not None and self._clock() < until:
                return (False, f"peer gave no answer lately; not asked for "
                        f"{self.quiet_s:g} s", [])
        ok, why, ids = self._ask(host, port, req_id)
        with self._lock:
            if why.startswith(NO_ANSWER):
                self._quiet_until[peer] = self._clock() + self.quiet_s
            else:
                self._quiet_until.pop(peer, None)
        return ok, why, ids


def ids_to_read(requested: Any, granted: list[list[int]]) -> list[list[int]] | None:
    """The block ids to read: per group, the handle's list (narrowed to the verified
    prefix, core/reuse.py) with its placeholders taken from decode's grant, which lists
    the group's retained blocks in order. None: the grant does not cover the read."""
    groups = list(requested)
    if len(granted) != len(groups):
        return None
    out = []
    for want, have in zip(groups, granted, strict=True):
        want = list(want)
        if want and want[0] == PLACEHOLDER_ID:
            if len(have) < len(want):
                return None
            want = have[: len(want)]
        out.append(want)
    return out


def has_placeholder(ids: Any) -> bool:
    return any(len(g) and g[0] == PLACEHOLDER_ID for g in ids)


class Lent:
    """Prefill's blocks lent to decode for a turn, whose handle names only their count:
    their ids by request, for decode's ask, until vLLM frees them (decode read them, or
    the lease ran out). Written by the engine thread, read by the side-channel thread
    (single dict operations)."""

    def __init__(self) -> None:
        self._ids: dict[str, list[list[int]]] = {}

    def lend(self, req_id: str, ids: list[list[int]]) -> None:
        self._ids[req_id] = ids

    def freed(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            self._ids.pop(rid, None)

    def answer(self, req_id: str) -> Grant | None:
        ids = self._ids.get(req_id)
        return None if ids is None else (True, "lent", ids)

    def __len__(self) -> int:
        return len(self._ids)
