"""What a router with the in-process store leaves on decode to survive its own restart:
a stable owner id, and a note per kept handle (pure; the sending is residency.py's, the
recall recall.py's).

The owner is derived from the resource's handle key, so a restarted router renews its
predecessor's lease and decode frees nothing (a shared store's own owner replaces it).
A note is the stored `Kept` record less what the recall knows anyway (request id,
replica) and what grows with the history (wire.NOTE_LEAVES_OUT, given back beside it):
`2.<mac>.<JSON>`, the MAC an HMAC-SHA256 (cut to 16 bytes) over the request id and the
JSON under a key derived from the handle key. One that does not check, names another
request or breaks a bound is dropped on recall. A note names only a handle, which decode
and prefill verify when it is used: a stale one is a miss, never a wrong read.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import hashlib
import hmac
import math
from collections.abc import Callable, Iterable
from typing import Any

from bidirkv.proof import keyed_sha256
from bidirkv.router.codec import dumps, dumps_kept, loads
from bidirkv.router.store.base import Entry, Kept
from bidirkv.wire import MAX_NOTE_LEN, NOTE_LEAVES_OUT, VERSION_KEY, version_problem

# 2: the handle without NOTE_LEAVES_OUT, which decode gives back on a recall.
FORMAT = "2"
MAC_LEN = 16
_OWNER_PERSON = b"bidirkv-owner"
_NOTE_PERSON = b"bidirkv-note"


def stable_owner(handle_key: bytes) -> str:
    """The owner id every router process of the resource holding `handle_key` shares."""
    return "router-" + hashlib.blake2b(handle_key, digest_size=8,
                                       person=_OWNER_PERSON).hexdigest()


def note_key(handle_key: bytes) -> bytes:
    """The key notes are signed with (not the handle key itself: a note is no handle)."""
    return hashlib.blake2b(handle_key, digest_size=32, person=_NOTE_PERSON).digest()


def _b64(b: bytes | None) -> str | None:
    # base64.b64encode's own call, less its checks for an alphabet a note never uses.
    return None if b is None else binascii.b2a_base64(b, newline=False).decode()


# A tenant is one of a few and the same turn after turn: encoded once, not per note.
_tenant_b64 = functools.lru_cache(maxsize=4096)(_b64)
_URLSAFE = bytes.maketrans(b"+/", b"-_")
# The MAC's base64 without its padding: 16 bytes are 22 characters.
_MAC_B64_LEN = -(-MAC_LEN * 4 // 3)


def _unb64(s: Any) -> bytes | None:
    if s is None:
        return None
    if not isinstance(s, str):
        raise ValueError("not base64 text")
    return base64.b64decode(s, validate=True)


def _mac(key: bytes, request_id: str, payload: bytes) -> str:
    h = keyed_sha256(key)
    h.update(request_id.encode() + b"\0" + payload)
    # urlsafe_b64encode's alphabet, unpadded, without its Python-level steps.
    return binascii.b2a_base64(h.digest()[:MAC_LEN], newline=False)[:_MAC_B64_LEN].translate(
        _URLSAFE).decode()


def encode(key: bytes, kept: Kept, kept_at: float, params: dict[str, Any]) -> str | None:
    """The note of a kept handle, whose params are `params` (None: it has no request id,
    or the note would be longer than decode keeps one)."""
    if kept.request_id is None:
        return None
    slim = {k: v for k, v in params.items() if k not in NOTE_LEAVES_OUT}
    payload = dumps([_b64(kept.key), dumps(slim).decode(), kept.engine_id, kept.num_tokens,
                     _tenant_b64(kept.tenant), kept.prefix_len, kept.blocks, kept.chars,
                     _b64(kept.prompt_key),
                     kept_at if kept.kept_at is None else kept.kept_at, kept.gap])
    note = f"{FORMAT}.{_mac(key, kept.request_id, payload)}.{payload.decode()}"
    return note if len(note) <= MAX_NOTE_LEN else None


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{v!r} is not a count")
    return v


def _time(v: Any, optional: bool = False) -> float | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{v!r} is not a time")
    return float(v)


def decode(key: bytes, request_id: str, note: Any, url: str, bulk: Any) -> Kept | None:
    """The `Kept` record of a recalled note, its handle completed with what decode gave
    back beside it (`bulk`: the handle's NOTE_LEAVES_OUT as decode issued it). None: not
    one this router signed for this request, not a handle this release can use, or
    nothing given back to complete it. What decode gives back is checked where it is
    used (the handle's MAC covers it): a wrong one is a miss, never a wrong read."""
    if not isinstance(bulk, dict):
        return None
    if not isinstance(note, str) or len(note) > MAX_NOTE_LEN:
        return None
    fmt, _, rest = note.partition(".")
    mac, _, payload = rest.partition(".")
    try:
        # Inside the try: a MAC that is not ASCII (compare_digest's TypeError) or text
        # with a lone surrogate (encode's ValueError) is a note that does not check,
        # not a failure of the whole recalled page.
        if fmt != FORMAT or not hmac.compare_digest(
                mac, _mac(key, request_id, payload.encode())):
            return None
        (k, params, engine_id, num_tokens, tenant, prefix_len, blocks, chars, prompt_key,
         kept_at, gap) = loads(payload)
        kv = loads(params) if isinstance(params, str) else None
        if not isinstance(kv, dict) or version_problem(kv.get(VERSION_KEY), "a note"):
            return None
        kv.update((k, bulk[k]) for k in NOTE_LEAVES_OUT if k in bulk)
        if engine_id is not None and not isinstance(engine_id, str):
            return None
        return Kept(_unb64(k) or b"", dumps_kept(kv), url, engine_id, _int(num_tokens),
                    tenant=_unb64(tenant), prefix_len=_int(prefix_len),
                    request_id=request_id, blocks=_int(blocks), chars=_int(chars),
                    prompt_key=_unb64(prompt_key), kept_at=_time(kept_at),
                    gap=_time(gap, optional=True))
    except (ValueError, TypeError):
        return None


def merge(recalled: Iterable[Kept], held: Callable[[bytes], Entry | None], now: float,
          ttl: float) -> tuple[list[Kept], list[str]]:
    """What of a recall goes into the store, and the request ids of notes past the
    store's TTL (theirs to release on decode: the store would have by now). Into the
    store: per conversation the newest live note, unless the store holds that handle
    already, one kept later, or one a turn is using now. A note's time ahead of `now`
    (its router's clock ahead of this one's) counts as `now`: a handle lives the TTL from
    when it was kept (`Kept.time_left`), never longer."""
    newest: dict[bytes, Kept] = {}
    expired: list[str] = []
    for k in recalled:
        if not k.key:
            continue
        if k.kept_at is not None and k.kept_at > now:
            k = dataclasses.replace(k, kept_at=now)
        if k.time_left(ttl, now) <= 0:
            e = held(k.key)
            if k.request_id and (e is None or e.request_id != k.request_id):
                expired.append(k.request_id)
            continue
        old = newest.get(k.key)
        if old is None or (k.kept_at or 0.0) > (old.kept_at or 0.0):
            newest[k.key] = k
    out = []
    for k in newest.values():
        e = held(k.key)
        if e is not None and (e.reserved or e.request_id == k.request_id
                              or e.kept_at >= (k.kept_at or 0.0)):
            continue
        out.append(k)
    return out, expired
