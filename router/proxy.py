"""The data path: one client request = a prefill leg on P, then a decode leg on D.

See docs/protocol.md (sections 1, 2 and 4). Decisions where the protocol is silent:
- A handle is reserved at lookup and spent only when P answered (single use). If P fails
  with a handle, the handle is discarded, not put back: P may have read (and so freed)
  D's blocks before failing, and a handle that made P fail would make the next turn fail
  too. The turn is retried once without it; its own decode leg stores a fresh handle.
- D failing before the client got a byte is retried once on another decode replica with
  a fresh prefill leg (no handle: the first one is spent). P's blocks from the first
  prefill are not reused: the failed D may have read (so freed) them or not, and the
  router cannot tell. A retry uses `<request id>-retry1` on both its legs, so it never
  collides with the first attempt's request id inside an engine.
- A 4xx from an engine is the client's problem and is returned as is. Connection errors
  and 5xx take the backend out until its next good health check, except a 5xx from P on
  a reuse turn (the handle, not P, is the likely cause).
- Upstream `Authorization` is the client's own header, so engines started with --api-key
  check the same credential.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from bidirkv.proof import make_proof

from .backends import DECODE, PREFILL, Backend, Pool
from .codec import dumps, loads
from .config import RouterConfig
from .handlestore import Store, StoreUnavailable, make_store
from .identity import (
    ChatHistory,
    chat_history,
    completion_key,
    explicit_key,
    prefix_keys,
    short_hash,
    tenant_of,
)
from .metrics import Metrics
from .residency import Residency
from .reuse import reuse_report
from .selection import least_outstanding, pick_decode
from .sse import DONE, PARAMS, MessageCollector, SSEFilter, error_event
from .store import EXPIRED, HIT, MISS, Entry
from .validation import CHAT, ClientError, error_body, parse_request

log = logging.getLogger("bidirkv.router")

PATHS = {CHAT: "/v1/chat/completions", "completions": "/v1/completions"}
_MARKER = b'"kv_transfer_params"'
_JSON = "application/json"
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
OWNER_KEY = "bidirkv_owner"
PROOF_KEY = "bidirkv_proof"
HANDLE_KEY_ENV = "BIDIRKV_HANDLE_KEY"


def prefill_body(body: dict[str, Any], handle: dict[str, Any] | None) -> dict[str, Any]:
    """The prefill leg's body: one token, not streamed, asking P to keep its blocks for D;
    with a handle, also telling P where D holds this conversation's earlier blocks."""
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
    out[PARAMS] = kv
    return out


def decode_body(body: dict[str, Any], p_params: Any, owner: str | None = None,
                proof: str | None = None) -> dict[str, Any]:
    """The client's body plus P's params as P signed them (host included), the router that
    will own D's handle (D keeps the blocks while that owner renews), and the router's
    proof, without which D keeps nothing and hands out no handle."""
    out = dict(body)
    if isinstance(p_params, dict):
        kv = dict(p_params)
        if owner is not None:
            kv[OWNER_KEY] = owner
        if proof is not None:
            kv[PROOF_KEY] = proof
        out[PARAMS] = kv
    return out


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


_FAILURES = (aiohttp.ClientError, TimeoutError, OSError)


def json_response(status: int, body: bytes, headers: dict[str, str] | None = None
                  ) -> web.Response:
    return web.Response(status=status, body=body, content_type=_JSON, headers=headers)


def json_error(status: int, message: str, type_: str = "invalid_request_error",
               param: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    return json_response(status, error_body(message, type_, param, status), headers)


class Turn:
    """One client request's state across its legs."""

    __slots__ = (
        "kind", "stream", "body", "rid", "auth", "tenant", "conv", "entry", "reuse",
        "holder_url", "store_key", "history", "prompt", "t0", "asked_prefill",
    )

    def __init__(self, kind: str, stream: bool, body: dict[str, Any], rid: str,
                 auth: str | None, tenant: bytes, t0: float) -> None:
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
        # Reuse outcomes are counted only for turns that reached P.
        self.asked_prefill = False

    @property
    def collects(self) -> bool:
        return self.history is not None or self.prompt is not None


class Unavailable(Exception):
    def __init__(self, role: str) -> None:
        super().__init__(role)
        self.role = role


class Router:
    def __init__(self, cfg: RouterConfig, metrics: Metrics | None = None,
                 handle_key: bytes | None = None, store_password: str | None = None) -> None:
        self.cfg = cfg
        # The resource's handle key: signs the proof that a decode leg comes from here.
        self.handle_key = handle_key
        # The served model's context length, from prefill's /v1/models: a max_tokens
        # above it is refused before any engine works on the request.
        self.max_model_len: int | None = None
        self.metrics = metrics or Metrics()
        self.store: Store = make_store(cfg, store_password, self._on_evict,
                                       self._on_store_error)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.prefill = Pool(PREFILL, cfg.prefill)
        self.decode = Pool(DECODE, cfg.decode)
        self.session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._set_timeouts()
        self.residency = Residency(cfg.owner_lease_seconds, self._t_probe,
                                   on_result=self._on_residency_call)
        for b in self.backends():
            self._export_health(b)

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=4096, limit_per_host=0, ttl_dns_cache=10, keepalive_timeout=60,
        )
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        await self._start_store()
        self._health_task = asyncio.create_task(self._health_loop(), name="router-health")
        self.residency.start(self.session)

    async def _start_store(self) -> None:
        """A shared store names the owner decode keeps KV for (the same for every router
        of the store, so a restarted replica keeps the conversations)."""
        start = getattr(self.store, "start", None)
        if start is None or self.store.owner is not None:
            return
        try:
            await start()
        except StoreUnavailable as exc:
            log.warning("%s; serving without reuse until it answers", exc)
            return
        self.residency.owner = self.store.owner

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _quietly(self, coro: Any) -> Any:
        """A store call whose failure costs only reuse (counted by _on_store_error)."""
        try:
            return await coro
        except StoreUnavailable:
            return None

    async def close(self) -> None:
        await self.residency.close()
        for task in list(self._tasks):
            task.cancel()
        await self.store.close()
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.session is not None:
            await self.session.close()

    def backends(self) -> list[Backend]:
        return self.prefill.backends + self.decode.backends

    def _set_timeouts(self) -> None:
        t = self.cfg.timeouts
        self._t_prefill = aiohttp.ClientTimeout(total=t.prefill_seconds,
                                                sock_connect=t.connect_seconds)
        self._t_decode = aiohttp.ClientTimeout(total=None, sock_connect=t.connect_seconds,
                                               sock_read=t.decode_seconds)
        probe = max(1.0, min(5.0, self.cfg.health_check_interval_seconds))
        self._t_probe = aiohttp.ClientTimeout(total=probe, sock_connect=t.connect_seconds)

    def apply_config(self, cfg: RouterConfig) -> None:
        """Swap in a validated config. Requests in flight keep the Backend objects and
        timeouts they started with, so a reload never fails them."""
        if cfg.model != self.cfg.model:
            self.max_model_len = None  # learned again for the new model
        self.cfg = cfg
        self.store.configure(cfg.handle_ttl_seconds, cfg.max_conversations)
        self._set_timeouts()
        self.residency.lease_seconds = cfg.owner_lease_seconds
        self.residency.timeout = self._t_probe
        changed = False
        for pool, urls in ((self.prefill, cfg.prefill), (self.decode, cfg.decode)):
            added, removed = pool.reconcile(urls)
            for b in removed:
                with contextlib.suppress(KeyError):
                    self.metrics.backend_healthy.remove(b.role, b.url)
                    self.metrics.backend_outstanding.remove(b.role, b.url)
                if b.role == DECODE:
                    self._background(self._quietly(
                        self.store.drop_replica(b.url, "replica_removed")))
                    self.residency.forget(b.url)
                log.info("backend removed role=%s url=%s", b.role, b.url)
            for b in added:
                self._export_health(b)
                log.info("backend added role=%s url=%s", b.role, b.url)
            changed = changed or bool(added)
        if changed:
            self._wake.set()

    # -- health --------------------------------------------------------------------
    def _on_evict(self, reason: str, entries: list[Entry]) -> None:
        self.metrics.evictions.labels(reason).inc(len(entries))
        self.residency.release(reason, entries)

    def _on_store_error(self, op: str) -> None:
        self.metrics.store_errors.labels(op).inc()

    def _on_residency_call(self, url: str, result: str, released: int) -> None:
        self.metrics.residency_calls.labels(result).inc()
        if released:
            self.metrics.releases_sent.labels(result).inc(released)

    def max_pinned(self, url: str) -> int | None:
        """Blocks this router's handles may pin on a replica (None: capacity unknown)."""
        total = self.residency.capacity(url)
        return None if total is None else int(self.cfg.retention_watermark * total)

    async def keep_under_watermark(self, url: str) -> None:
        """Drop the replica's oldest handles while they pin more than the watermark."""
        limit = self.max_pinned(url)
        if limit is not None:
            await self._quietly(self.store.trim_replica(url, limit))

    def _export_health(self, b: Backend) -> None:
        self.metrics.backend_healthy.labels(b.role, b.url).set(1 if b.healthy else 0)

    def set_health(self, b: Backend, ok: bool, why: str) -> None:
        if b.healthy == ok or not b.in_pool:
            return
        b.healthy = ok
        self._export_health(b)
        if ok:
            log.info("backend healthy role=%s url=%s", b.role, b.url)
            return
        if b.role == DECODE:
            # Its blocks may be gone (restart) or unreachable: handing them to P would
            # only buy a failed read and a retry.
            self._background(self._quietly(
                self.store.drop_replica(b.url, "replica_unhealthy")))
        log.warning("backend unhealthy role=%s url=%s why=%s", b.role, b.url, why)

    async def _probe(self, b: Backend) -> None:
        assert self.session is not None
        try:
            async with self.session.get(b.url + "/health", timeout=self._t_probe) as r:
                await r.read()
                ok, why = r.status == 200, f"health status {r.status}"
        except _FAILURES as exc:
            ok, why = False, f"health check {classify(exc)[1]}"
        self.set_health(b, ok, why)

    async def check_health(self) -> None:
        await asyncio.gather(*(self._probe(b) for b in self.backends()))
        for b in self.backends():
            self.metrics.backend_outstanding.labels(b.role, b.url).set(b.outstanding)

    async def learn_model_len(self) -> None:
        """Once per router (and after a reload): the model's max_model_len from P."""
        if self.max_model_len is not None:
            return
        assert self.session is not None
        for b in self.prefill.healthy():
            try:
                async with self.session.get(b.url + "/v1/models", timeout=self._t_probe) as r:
                    data = loads(await r.read()) if r.status == 200 else None
            except (*_FAILURES, ValueError):
                continue
            self.max_model_len = model_len(data, self.cfg.model)
            if self.max_model_len is not None:
                return

    async def renew_residency(self) -> None:
        """Renew this router's lease on every healthy decode; learn their capacity."""
        if not self.cfg.bidirectional:
            return
        assert self.session is not None
        healthy = self.decode.healthy()
        await asyncio.gather(*(self.residency.call(self.session, b.url) for b in healthy))
        for b in healthy:
            await self.keep_under_watermark(b.url)
            pinned = await self._quietly(self.store.pinned(b.url))
            self.metrics.export_residency(b.url, self.residency.replica(b.url), pinned)

    async def _health_loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.check_health()
                await self.learn_model_len()
                await self._start_store()
                await self.renew_residency()
                await self._quietly(self.store.sweep())
                count = await self._quietly(self.store.count())
                if count is not None:
                    self.metrics.handles.set(count)
                self.metrics.store_up.set(1 if self.store.available else 0)
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad round
                log.exception("health check round failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(),
                                       self.cfg.health_check_interval_seconds)

    def ready(self) -> bool:
        return bool(self.prefill.healthy()) and bool(self.decode.healthy())

    # -- responses -----------------------------------------------------------------
    def _unavailable(self, role: str) -> web.Response:
        retry = str(max(1, math.ceil(self.cfg.health_check_interval_seconds)))
        return json_error(503, f"no healthy {role} engine; retry later", "service_unavailable",
                          headers={"Retry-After": retry})

    def _failure(self, f: UpstreamFailure, rid: str) -> web.Response:
        if f.kind == "timeout":
            return json_error(504, f"{f.leg} engine timed out (request {rid})", "upstream_timeout")
        what = f"HTTP {f.status}" if f.kind == "status" else f.kind
        return json_error(502, f"{f.leg} engine failed: {what} (request {rid})", "upstream_error")

    def _outcome_of(self, f: UpstreamFailure) -> str:
        return "timeout" if f.kind == "timeout" else "upstream_error"

    def _headers(self, rid: str, auth: str | None) -> dict[str, str]:
        h = {"Content-Type": _JSON, "X-Request-Id": rid}
        if auth:
            h["Authorization"] = auth
        return h

    # -- client requests -------------------------------------------------------------
    async def read_body(self, request: web.Request, limit: int) -> bytes:
        n = request.content_length
        if n is not None and n > limit:
            raise ClientError(413, f"request body of {n} bytes is over the limit of {limit} "
                              "bytes (maxBodyBytes)", type_="request_too_large")
        if n is not None:
            return await request.read()
        parts, size = [], 0
        while chunk := await request.content.read(65536):
            size += len(chunk)
            if size > limit:
                raise ClientError(413, f"request body is over the limit of {limit} bytes "
                                  "(maxBodyBytes)", type_="request_too_large")
            parts.append(chunk)
        return b"".join(parts)

    async def handle_generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        cfg = self.cfg
        try:
            raw = await self.read_body(request, cfg.max_body_bytes)
            req = parse_request(raw, kind, request.headers.get("X-Conversation-Id"),
                                self.max_model_len)
        except ClientError as e:
            self.metrics.request(kind, "client_error")
            return json_error(e.status, e.message, e.type, e.param)
        if cfg.model is not None and "model" not in req.body:
            req.body["model"] = cfg.model
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        turn = Turn(kind, req.stream, req.body, rid, request.headers.get("Authorization"),
                    tenant_of(request.headers.get(cfg.tenant_header)), t0)
        if cfg.bidirectional:
            await self._identify(turn, req.conversation_id)
        elif req.conversation_id is not None:
            turn.conv = short_hash(req.conversation_id)
        try:
            resp, outcome = await self._run(request, turn)
        except asyncio.CancelledError:
            self.metrics.request(kind, "cancelled")
            log.debug("request cancelled rid=%s conv=%s", rid, turn.conv)
            raise
        finally:
            if turn.entry is not None:
                entry, turn.entry = turn.entry, None
                try:
                    await self.store.release(entry)
                except StoreUnavailable:  # it cannot go back: D frees its blocks now
                    self._on_evict("store_unavailable", [entry])
            if turn.asked_prefill:
                self.metrics.reuse_outcome(turn.reuse)
        self.metrics.request(kind, outcome)
        log.debug("request rid=%s conv=%s kind=%s stream=%s reuse=%s outcome=%s ms=%.2f",
                  rid, turn.conv, kind, turn.stream, turn.reuse, outcome,
                  (time.perf_counter() - t0) * 1000)
        return resp

    async def _identify(self, turn: Turn, conversation_id: str | None) -> None:
        store = self.store
        body = turn.body
        key: bytes | None = None
        status, entry = MISS, None
        if conversation_id is not None:
            turn.conv = short_hash(conversation_id)
            key = turn.store_key = explicit_key(turn.tenant, conversation_id)
        elif turn.kind == CHAT:
            turn.history = chat_history(turn.tenant, body["messages"])
            key = turn.history.lookup_key
            turn.conv = "auto:" + (key.hex()[:10] if key is not None else "new")
        elif isinstance(body.get("prompt"), str):
            turn.prompt = body["prompt"]
        try:
            if key is not None:
                status, entry = await store.lookup(key)
            elif turn.prompt is not None:
                status, entry = await store.lookup_prefix(turn.tenant, turn.prompt,
                                                          prefix_keys(turn.tenant))
                turn.conv = "auto:" + (entry.key.hex()[:10] if entry is not None else "new")
        except StoreUnavailable:
            status, entry = MISS, None  # served without reuse (counted)
        turn.reuse = {HIT: "hit", MISS: "miss", EXPIRED: "expired"}[status]
        if entry is not None:
            turn.entry = entry
            turn.holder_url = entry.decode_url

    async def _run(self, request: web.Request, turn: Turn) -> tuple[web.StreamResponse, str]:
        if not self.prefill.healthy():
            return self._unavailable(PREFILL), "unavailable"
        tried_decode: list[Backend] = []
        last: UpstreamFailure | None = None
        for attempt in range(2):
            rid = turn.rid if attempt == 0 else f"{turn.rid}-retry{attempt}"
            # D is chosen first: no prefill is spent on a turn that has nowhere to decode.
            d = pick_decode(self.decode.backends, self.decode.next_start(), tried_decode,
                            turn.holder_url)
            if d is None:
                if last is not None:
                    return self._failure(last, turn.rid), self._outcome_of(last)
                return self._unavailable(DECODE), "unavailable"
            if attempt:
                self.metrics.retries.labels("decode_before_first_byte").inc()
                log.warning("decode failed before first byte (%s); retrying on %s rid=%s "
                            "conv=%s", last.detail if last else "", d.url, turn.rid, turn.conv)
            try:
                p, p_body = await self._prefill_leg(turn, rid)
            except Unavailable as u:
                return self._unavailable(u.role), "unavailable"
            except UpstreamFailure as f:
                if f.client_error:
                    return json_response(f.status or 400, f.body or error_body(
                        f"prefill engine rejected the request: HTTP {f.status}",
                        "invalid_request_error")), "upstream_client_error"
                return self._failure(f, rid), self._outcome_of(f)
            try:
                return await self._decode_leg(request, turn, p, p_body, d, rid)
            except UpstreamFailure as f:
                tried_decode.append(d)
                last = f
        assert last is not None
        log.warning("decode failed (%s) rid=%s conv=%s decode=%s", last.detail or last.kind,
                    turn.rid, turn.conv, last.backend.url)
        return self._failure(last, turn.rid), self._outcome_of(last)

    # -- prefill leg ------------------------------------------------------------------
    async def _prefill_leg(self, turn: Turn, rid: str) -> tuple[Backend, dict[str, Any]]:
        assert self.session is not None
        tried: list[Backend] = []
        last: UpstreamFailure | None = None
        for attempt in range(2):
            p = least_outstanding(self.prefill.backends, self.prefill.next_start(), tried)
            if p is None:
                if last is not None:
                    raise last
                raise Unavailable(PREFILL)
            entry = turn.entry
            handle = loads(entry.params) if entry is not None else None
            payload = dumps(prefill_body(turn.body, handle))
            t = time.perf_counter()
            p.outstanding += 1
            turn.asked_prefill = True
            try:
                data = await self._post_prefill(p, PATHS[turn.kind], payload, rid, turn.auth)
            except asyncio.CancelledError:
                if entry is not None:
                    # P was asked and may have read D's blocks: not safe to hand out again.
                    self.store.forget(entry, "cancelled")
                    turn.entry = None
                raise
            except UpstreamFailure as f:
                self.metrics.observe_leg("prefill", "error", time.perf_counter() - t)
                last = f
                if entry is not None:
                    # Spent or poisoned: see the module docstring. Retry as a miss.
                    await self._quietly(self.store.discard(entry, "reuse_failed"))
                    turn.entry = None
                    turn.reuse = "dropped"
                    if f.kind == "connect":
                        self.set_health(p, False, f.detail)
                        tried.append(p)
                    self.metrics.retries.labels("prefill_reuse_failed").inc()
                    log.warning("prefill with handle failed (%s); retrying without rid=%s "
                                "conv=%s prefill=%s", f.detail or f.kind, rid, turn.conv, p.url)
                    continue
                if f.client_error:
                    raise
                if f.backend_down:
                    self.set_health(p, False, f.detail or f"HTTP {f.status}")
                tried.append(p)
                log.warning("prefill failed (%s) rid=%s conv=%s prefill=%s",
                            f.detail or f"HTTP {f.status}", rid, turn.conv, p.url)
                if attempt == 0:
                    self.metrics.retries.labels("prefill_failed").inc()
                continue
            finally:
                p.outstanding -= 1
            self.metrics.observe_leg("prefill", "ok", time.perf_counter() - t)
            await self._account_reuse(turn, data)
            return p, data
        assert last is not None
        raise last

    async def _account_reuse(self, turn: Turn, data: dict[str, Any]) -> None:
        report = reuse_report(data)
        entry = turn.entry
        if entry is not None:
            await self._quietly(self.store.consume(entry))
            turn.entry = None
            if entry.num_tokens >= self.cfg.kv_recompute_threshold:
                self.metrics.tokens_offered.inc(entry.num_tokens)
            if report is not None and report.partial:
                turn.reuse = "verified-partial"
            if report is not None and report.reused_tokens:
                self.metrics.tokens_reused.labels(report.source).inc(report.reused_tokens)

    async def _post_prefill(self, p: Backend, path: str, payload: bytes, rid: str,
                            auth: str | None) -> dict[str, Any]:
        assert self.session is not None
        try:
            async with self.session.post(p.url + path, data=payload,
                                         headers=self._headers(rid, auth),
                                         timeout=self._t_prefill) as r:
                body = await r.read()
                status = r.status
        except _FAILURES as exc:
            kind, detail = classify(exc)
            raise UpstreamFailure("prefill", p, kind, detail=detail) from None
        if status != 200:
            raise UpstreamFailure("prefill", p, "status", status, body, f"HTTP {status}")
        try:
            data = loads(body)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise UpstreamFailure("prefill", p, "protocol", detail="reply is not a JSON object")
        return data

    # -- decode leg --------------------------------------------------------------------
    async def _decode_leg(self, request: web.Request, turn: Turn, p: Backend,
                          p_body: dict[str, Any], d: Backend, rid: str
                          ) -> tuple[web.StreamResponse, str]:
        """The response and its outcome; UpstreamFailure when D failed before the client
        got a byte (the caller may retry elsewhere)."""
        assert self.session is not None
        owner = proof = None
        if self.cfg.bidirectional:
            owner = self.residency.owner
            proof = make_proof(self.handle_key) if self.handle_key else None
        payload = dumps(decode_body(turn.body, p_body.get(PARAMS), owner, proof))
        t = time.perf_counter()
        d.outstanding += 1
        resp: aiohttp.ClientResponse | None = None
        try:
            try:
                resp = await self.session.post(d.url + PATHS[turn.kind], data=payload,
                                               headers=self._headers(rid, turn.auth),
                                               timeout=self._t_decode)
                if resp.status != 200:
                    body = await resp.read()
                    raise UpstreamFailure("decode", d, "status", resp.status, body,
                                          f"HTTP {resp.status}")
                if not turn.stream:
                    body = await resp.read()
                    return await self._finish_json(turn, d, body, t), "ok"
                first = await resp.content.readany()
                if not first:
                    raise UpstreamFailure("decode", d, "protocol",
                                          detail="stream ended before any data")
            except _FAILURES as exc:
                kind, detail = classify(exc)
                f = UpstreamFailure("decode", d, kind, detail=detail)
                return self._decode_failed(f, t)
            except UpstreamFailure as f:
                return self._decode_failed(f, t)
            return await self._relay(request, turn, d, resp, first, t)
        finally:
            d.outstanding -= 1
            if resp is not None:
                resp.close()

    def _decode_failed(self, f: UpstreamFailure, t: float) -> tuple[web.StreamResponse, str]:
        self.metrics.observe_leg("decode", "error", time.perf_counter() - t)
        if f.client_error:
            return json_response(f.status or 400, f.body or error_body(
                f"decode engine rejected the request: HTTP {f.status}",
                "invalid_request_error")), "upstream_client_error"
        if f.backend_down:
            self.set_health(f.backend, False, f.detail or f"HTTP {f.status}")
        raise f

    async def _finish_json(self, turn: Turn, d: Backend, body: bytes, t: float
                           ) -> web.Response:
        collector = MessageCollector(turn.kind == CHAT) if turn.collects else None
        if collector is not None or _MARKER in body:
            try:
                obj = loads(body)
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                params = obj.pop(PARAMS, None)
                if collector is not None:
                    collector.feed_response(obj)
                if isinstance(params, dict):
                    await self._store_handle(turn, d, params, collector)
                body = dumps(obj)
        now = time.perf_counter()
        self.metrics.observe_ttft(turn.kind, False, now - turn.t0)
        self.metrics.observe_leg("decode", "ok", now - t)
        return json_response(200, body, {"X-Request-Id": turn.rid})

    async def _relay(self, request: web.Request, turn: Turn, d: Backend,
                     resp: aiohttp.ClientResponse, first: bytes, t: float
                     ) -> tuple[web.StreamResponse, str]:
        collector = MessageCollector(turn.kind == CHAT) if turn.collects else None
        filt = SSEFilter(collector)
        out = web.StreamResponse(headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Request-Id": turn.rid,
        })
        done = False
        try:
            await out.prepare(request)
            chunk = filt.feed(first)
            stored = await self._maybe_store(turn, d, filt, collector, False)
            if chunk:
                await out.write(chunk)
                done = chunk.endswith(DONE)
            self.metrics.observe_ttft(turn.kind, True, time.perf_counter() - turn.t0)
            while True:
                try:
                    data = await resp.content.readany()
                except _FAILURES as exc:
                    kind, detail = classify(exc)
                    self.metrics.observe_leg("decode", "error", time.perf_counter() - t)
                    log.warning("decode stream broke (%s) rid=%s conv=%s decode=%s", detail,
                                turn.rid, turn.conv, d.url)
                    if kind == "connect":
                        self.set_health(d, False, detail)
                    await self._end_with_error(out, f"decode engine stream {detail}")
                    return out, "stream_error"
                chunk = filt.feed(data) if data else filt.finish()
                # Stored before the client can see [DONE]: its next turn may come at once.
                stored = await self._maybe_store(turn, d, filt, collector, stored)
                if chunk:
                    await out.write(chunk)
                    done = done or chunk.endswith(DONE)
                if not data:
                    break
        except ConnectionError:
            # The client left; the finally of the caller closes D's stream.
            log.debug("client disconnected rid=%s conv=%s", turn.rid, turn.conv)
            return out, "cancelled"
        if not done:
            log.warning("decode stream ended without [DONE] rid=%s conv=%s decode=%s",
                        turn.rid, turn.conv, d.url)
            await self._end_with_error(out, "decode engine stream ended early")
            return out, "stream_error"
        self.metrics.observe_leg("decode", "ok", time.perf_counter() - t)
        with contextlib.suppress(ConnectionError):
            await out.write_eof()
        return out, "ok"

    async def _maybe_store(self, turn: Turn, d: Backend, filt: SSEFilter,
                     collector: MessageCollector | None, stored: bool) -> bool:
        if stored or filt.params is None:
            return stored
        await self._store_handle(turn, d, filt.params, collector)
        return True

    async def _end_with_error(self, out: web.StreamResponse, message: str) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            await out.write(error_event(message) + DONE)
            await out.write_eof()

    # -- handles ---------------------------------------------------------------------
    async def _store_handle(self, turn: Turn, d: Backend, params: dict[str, Any],
                            collector: MessageCollector | None) -> None:
        engine = params.get("remote_engine_id")
        if not isinstance(engine, str):
            engine = None
        if engine is not None and d.engine_id != engine:
            if d.engine_id is not None:
                log.warning("decode engine id changed (restart) url=%s", d.url)
                self._background(self._quietly(self.store.drop_replica(
                    d.url, "engine_changed", keep_engine_id=engine)))
            d.engine_id = engine
        rid = params.get("remote_request_id")
        rid = rid if isinstance(rid, str) else None
        key, tenant, prefix_len = None, None, 0
        if not self.cfg.bidirectional or not d.in_pool or not d.healthy:
            pass
        elif turn.history is not None and collector is not None:
            key = turn.history.store_key(collector.message())
        elif turn.prompt is not None and collector is not None:
            text = turn.prompt + collector.text
            key = completion_key(turn.tenant, text)
            tenant, prefix_len = turn.tenant, len(text)
        elif turn.store_key is not None:
            key = turn.store_key
        if key is None:
            # D retained the blocks for a handle nobody will ever send: free them now.
            if rid is not None and d.in_pool:
                self.residency.release_ids(d.url, [rid])
            return
        kv = dict(params)
        n = kv.get("remote_num_tokens")
        n = n if isinstance(n, int) and not isinstance(n, bool) else 0
        try:
            await self.store.put(key, dumps(kv), d.url, engine, n, tenant=tenant,
                                 prefix_len=prefix_len, request_id=rid,
                                 blocks=handle_blocks(kv), max_pinned=self.max_pinned(d.url))
        except StoreUnavailable:
            if rid is not None:  # not kept anywhere: D frees the blocks now
                self.residency.release_ids(d.url, [rid])

    async def end_conversation(self, tenant: bytes, conversation_id: str) -> bool:
        """DELETE /v1/conversations/{id}: drop the handle, D frees its blocks now."""
        return await self.store.end(explicit_key(tenant, conversation_id))

    # -- other routes ------------------------------------------------------------------
    async def handle_models(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        tried: list[Backend] = []
        while True:
            d = least_outstanding(self.decode.backends, self.decode.next_start(), tried)
            if d is None:
                self.metrics.request("models", "unavailable")
                return self._unavailable(DECODE)
            try:
                async with self.session.get(d.url + "/v1/models", timeout=self._t_prefill,
                                            headers=self._headers(uuid.uuid4().hex,
                                                                  request.headers.get(
                                                                      "Authorization"))) as r:
                    body, status = await r.read(), r.status
            except _FAILURES as exc:
                self.set_health(d, False, classify(exc)[1])
                tried.append(d)
                continue
            if status >= 500:
                self.set_health(d, False, f"HTTP {status}")
                tried.append(d)
                continue
            self.metrics.request("models", "ok" if status == 200 else "upstream_client_error")
            return json_response(status, body)
