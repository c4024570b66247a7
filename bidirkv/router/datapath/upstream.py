"""What the router sends upstream and how it reads failures: the two legs' bodies, the
upstream failure kinds, JSON responses, and one request's state (`Turn`).
"""

from __future__ import annotations

import errno
import math
from typing import Any

import aiohttp
from aiohttp import web

from bidirkv.router.datapath.sse import PARAMS
from bidirkv.router.datapath.tracing import UNTRACED, Trace
from bidirkv.router.pool.backends import Backend
from bidirkv.router.pool.placement import ON_DECODE, Decision
from bidirkv.router.request.identity import ChatHistory
from bidirkv.router.request.validation import CHAT, error_body
from bidirkv.router.store.handles import Entry
from bidirkv.wire import (
    OWNER_KEY,
    PROOF_KEY,
    RETURN_KEY,
    TENANT_KEY,
    TENANT_LABEL_LEN,
    VERSION,
    VERSION_KEY,
)

PATHS = {CHAT: "/v1/chat/completions", "completions": "/v1/completions"}
PARAMS_MARKER = b'"kv_transfer_params"'
JSON_TYPE = "application/json"
_MISS_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Fields a one-token prefill must not carry (they would change or fail a max_tokens=1 run).
_PREFILL_DROP = ("max_completion_tokens", "min_tokens", "stream_options")
HANDLE_KEY_ENV = "BIDIRKV_HANDLE_KEY"


def prefill_body(body: dict[str, Any], handle: dict[str, Any] | None,
                 proof: str | None = None) -> dict[str, Any]:
    """The prefill leg's body: one token, not streamed, asking P to keep its blocks for D;
    with a handle, also telling P where D holds this conversation's earlier blocks. The
    router's proof: without it P keeps nothing for D and hands out no handle, so nobody
    but the router can obtain one of P's (and replay it after P reused the blocks)."""
    out = dict(body)
    out["stream"] = False
    out["max_tokens"] = 1
    for key in _PREFILL_DROP:
        out.pop(key, None)
    if handle is not None:
        kv = dict(handle)
        kv["do_remote_decode"] = True
        kv["do_remote_prefill"] = False
    else:
        kv = dict(_MISS_PARAMS)
    if proof is not None:
        kv[PROOF_KEY] = proof
    kv[VERSION_KEY] = VERSION
    out[PARAMS] = kv
    return out


def decode_body(body: dict[str, Any], p_params: Any, owner: str | None = None,
                proof: str | None = None, tenant: bytes | None = None,
                gap: float | None = None) -> dict[str, Any]:
    """The client's body plus P's params as P signed them (host included), the router that
    will own D's handle (D keeps the blocks while that owner renews), the tenant's label,
    the conversation's gap (when it is expected back: what D releases by), and the
    router's proof, without which D keeps nothing and hands out no handle."""
    out = dict(body)
    if isinstance(p_params, dict):
        kv = dict(p_params)
        if owner is not None:
            kv[OWNER_KEY] = owner
        if tenant is not None:
            kv[TENANT_KEY] = tenant.hex()[:TENANT_LABEL_LEN]
        if gap is not None:
            kv[RETURN_KEY] = round(gap, 3)
        if proof is not None:
            kv[PROOF_KEY] = proof
        kv[VERSION_KEY] = VERSION
        out[PARAMS] = kv
    return out


# The decode leg of a turn extended on its holder: no P params, both flags false. D
# prefills the prompt on top of its own KV and, with the router's proof, keeps the blocks
# and hands out the next handle, as after any decode leg.
LOCAL_PARAMS = {"do_remote_prefill": False, "do_remote_decode": False}
PLACEMENT_HEADER = "X-Bidirkv-Placement"


def count_reuse(metrics: Any, turn: Turn) -> None:
    """The turn's reuse outcome, once: at its decode leg's first byte (a client that
    reads the counter after its answer finds it there), else when the request ends."""
    if not turn.reuse_counted and (turn.asked_prefill or turn.reuse == "extended"
                                   or turn.placed is not None
                                   and turn.placed.path == ON_DECODE):
        metrics.reuse_outcome(turn.reuse)
        turn.reuse_counted = True


def placement_header(turn: Turn) -> dict[str, str]:
    """`decision; reason=...` for the client (benchmarks read it), when one was made."""
    d = turn.placed
    return {PLACEMENT_HEADER: f"{d.path}; reason={d.reason}"} if d is not None else {}


def model_len(models: Any, name: str | None) -> int | None:
    """`max_model_len` of the model named `name` (else the first) in a /v1/models reply."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        return None
    cards = [m for m in data if isinstance(m, dict)]
    chosen = next((m for m in cards if m.get("id") == name), cards[0] if cards else None)
    n = chosen.get("max_model_len") if chosen else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def handle_blocks(params: dict[str, Any]) -> int:
    """Blocks a D handle pins on its replica (all KV groups)."""
    ids = params.get("remote_block_ids")
    if not isinstance(ids, list):
        return 0
    return sum(len(g) for g in ids if isinstance(g, list))


class UpstreamFailure(Exception):
    """A leg that did not deliver. kind: connect | status | timeout | protocol."""

    def __init__(self, leg: str, backend: Backend, kind: str, status: int | None = None,
                 body: bytes = b"", detail: str = "") -> None:
        super().__init__(f"{leg} {backend.url}: {kind} {status or ''} {detail}".strip())
        self.leg = leg
        self.backend = backend
        self.kind = kind
        self.status = status
        self.body = body
        self.detail = detail

    @property
    def client_error(self) -> bool:
        return self.kind == "status" and self.status is not None and 400 <= self.status < 500

    @property
    def result(self) -> str:
        """The leg's result as its span records it."""
        return "upstream_client_error" if self.client_error else self.kind

    @property
    def backend_down(self) -> bool:
        return self.kind == "connect" or (
            self.kind == "status" and self.status is not None and self.status >= 500
        )


def classify(exc: BaseException) -> tuple[str, str]:
    """(kind, detail) of an aiohttp/asyncio failure."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "connect", "connect timeout"
    if isinstance(exc, TimeoutError):
        return "timeout", "timed out"
    return "connect", type(exc).__name__


UPSTREAM_FAILURES = (aiohttp.ClientError, TimeoutError, OSError)
_RESET = (errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED)


def stale_connection(exc: BaseException) -> bool:
    """True for how a request fails on a kept-alive connection the engine had already
    closed: a disconnect or a reset. A failed connect is never one (that is a new
    connection, and the engine is not listening)."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return False
    if isinstance(exc, aiohttp.ServerDisconnectedError | ConnectionResetError
                  | BrokenPipeError | ConnectionAbortedError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and exc.errno in _RESET


def json_response(status: int, body: bytes, headers: dict[str, str] | None = None
                  ) -> web.Response:
    return web.Response(status=status, body=body, content_type=JSON_TYPE, headers=headers)


def json_error(status: int, message: str, type_: str = "invalid_request_error",
               param: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    return json_response(status, error_body(message, type_, param, status), headers)


def upstream_headers(rid: str, auth: str | None,
                     trace: dict[str, str] | None = None) -> dict[str, str]:
    """An upstream request's headers; `trace`: its traceparent (and tracestate)."""
    h = {"Content-Type": JSON_TYPE, "X-Request-Id": rid}
    if auth:
        h["Authorization"] = auth
    if trace:
        h.update(trace)
    return h


def unavailable(role: str, health_interval_s: float) -> web.Response:
    """503 for a pool with no healthy engine, retried after one health round."""
    retry = str(max(1, math.ceil(health_interval_s)))
    return json_error(503, f"no healthy {role} engine; retry later", "service_unavailable",
                      headers={"Retry-After": retry})


def failure_response(f: UpstreamFailure, rid: str) -> web.Response:
    if f.kind == "timeout":
        return json_error(504, f"{f.leg} engine timed out (request {rid})", "upstream_timeout")
    what = f"HTTP {f.status}" if f.kind == "status" else f.kind
    return json_error(502, f"{f.leg} engine failed: {what} (request {rid})", "upstream_error")


def outcome_of(f: UpstreamFailure) -> str:
    return "timeout" if f.kind == "timeout" else "upstream_error"


def rejected(f: UpstreamFailure) -> web.Response:
    """An engine's 4xx, returned to the client as it came."""
    return json_response(f.status or 400, f.body or error_body(
        f"{f.leg} engine rejected the request: HTTP {f.status}", "invalid_request_error"))


class Turn:
    """One client request's state across its legs."""

    __slots__ = (
        "kind", "stream", "body", "rid", "auth", "tenant", "conv", "entry", "reuse",
        "holder_url", "store_key", "history", "prompt", "t0", "asked_prefill", "placed",
        "new_tokens", "prompt_chars", "prompt_tokens", "trace", "gap", "reuse_counted",
    )

    def __init__(self, kind: str, stream: bool, body: dict[str, Any], rid: str,
                 auth: str | None, tenant: bytes, t0: float, trace: Trace = UNTRACED) -> None:
        self.kind = kind
        self.stream = stream
        self.body = body
        self.rid = rid
        self.auth = auth
        self.tenant = tenant
        self.conv = "-"
        self.entry: Entry | None = None
        self.reuse = "off"
        self.holder_url: str | None = None
        # How to name this conversation when D returns its handle (one of three).
        self.store_key: bytes | None = None
        self.history: ChatHistory | None = None
        self.prompt: str | None = None
        self.t0 = t0
        # Reuse outcomes are counted only for turns that reached P or ran whole on
        # decode, once.
        self.asked_prefill = False
        self.reuse_counted = False
        # Where the turn runs and why (placement.py), and the new tokens it estimated.
        self.placed: Decision | None = None
        self.new_tokens = 0
        self.prompt_chars = 0
        # The prompt's tokens, once prefill reported them (usage.prompt_tokens).
        self.prompt_tokens: int | None = None
        # Its spans (tracing.py): the request's, under which each leg starts its own.
        self.trace = trace
        # The conversation's moving-average idle time with this turn's (returns.py),
        # once a stored handle said when its last answer was kept.
        self.gap: float | None = None

    @property
    def collects(self) -> bool:
        return self.history is not None or self.prompt is not None


class Unavailable(Exception):
    def __init__(self, role: str) -> None:
        super().__init__(role)
        self.role = role
