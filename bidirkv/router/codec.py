"""JSON encode/decode for the hot path: orjson when installed, the standard library if not.

orjson is a dependency of the router (measured faster on the hot path: the router
benchmark, docs/benchmarks.md#router-overhead); the fallback keeps a source checkout
without it working. Both paths produce compact UTF-8 bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

loads: Callable[[bytes | str], Any]
dumps: Callable[[Any], bytes]

try:  # pragma: no cover - depends on the environment
    import orjson

    loads = orjson.loads
    dumps = orjson.dumps  # orjson's own function: no wrapper call per body
    HAVE_ORJSON = True
except ImportError:  # pragma: no cover - depends on the environment
    _encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
    loads = json.loads

    def dumps(obj: Any) -> bytes:
        return _encoder.encode(obj).encode()

    HAVE_ORJSON = False

def dumps_kept(obj: Any) -> bytes:
    """`dumps` for bytes held for long (stored handles). orjson returns its result in its
    working buffer, which stays allocated whole (16 KiB measured with 3.13, for a
    500-byte handle): 100k stored handles took 905 MB instead of ~170. The copy is the
    length of the text."""
    return bytes(memoryview(dumps(obj)))


# Canonical form for hashing: stable key order, no whitespace. Every router replica of a
# resource runs the same image, so they all produce the same bytes, which is all a
# lookup key needs.
if HAVE_ORJSON:  # pragma: no cover - depends on the environment

    def canonical(obj: Any) -> bytes:
        return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)
else:  # pragma: no cover - depends on the environment
    _canonical = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True)

    def canonical(obj: Any) -> bytes:
        return _canonical.encode(obj).encode()
