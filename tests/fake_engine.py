"""A fake vLLM engine speaking the NixlConnector P/D protocol over HTTP, for tests and
benchmarks (see docs/protocol.md, sections 1 and 2).

Prefill role: answers a one-token, non-streamed completion whose top-level
`kv_transfer_params` say where its blocks are (do_remote_prefill: true, ...). A request
without `kv_transfer_params` is served whole, as a decode would (a prefill server is a
complete engine), with no params.
Decode role: streams SSE chunks and ends with a params-only chunk
`{"choices": [], "kv_transfer_params": {...}}` before `data: [DONE]`; a non-streamed
reply carries the params at the top of its body.

Decode also answers /bidirkv/residency as the plugin does, keeping the notes a router
leaves beside the requests it handed out a handle for and paging them back on a recall
(what bidirkv/connector/core/notes.py does), without its bounds or its signature check.

/metrics serves vLLM's Prometheus text with bidir-kv's `vllm:bidirkv_retained_requests`
gauge (what the operator reads from a draining decode pod): the requests decode handed
out a handle for and still holds, or the count a test sets.

Every request is recorded; behaviour can be changed at run time (fail, hang, stall or
break mid-stream, return 5xx), and a request the client abandons is counted.

Handles are small by default (a few block ids, no digests). With `block_size` set
(`--block-size 16`) they are what a real engine hands out at that length: one block id a
`block_size` tokens of the prompt, from a real engine's range (up to ~1M), D's digest
record built by the plugin's own code (`HeldBlocks.of` over stand-in
token ids), the expiry and the MAC, so their bytes are exact. A body may name its own
token count (`fake_prompt_tokens`: a small body that stands for a long history).

Run standalone (benchmarks): python tests/fake_engine.py --role decode --port 8200
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from bidirkv.connector.core import digests
from bidirkv.connector.core.handles import sign, stamp_expiry
from bidirkv.wire import (
    BLOCKS_KEY,
    COUNTS_KEY,
    MAC_KEY,
    NOTE_LEAVES_OUT,
    SHARED_BLOCKS_KEY,
    VERSION,
    VERSION_KEY,
)

# Realistic handles (Behaviour.block_size): block ids below this (a large KV pool), the
# key they are signed with and the digest seed (any: only their bytes are measured).
MAX_BLOCK_ID = 1_000_000
HANDLE_KEY = b"fake-engine-handle-key"
SEED = digests.model_seed("fake-model", None, "bfloat16", "auto", 16)
# A body field naming the prompt's token count (a small body standing for a long one).
PROMPT_TOKENS_FIELD = "fake_prompt_tokens"


@dataclass
class Received:
    path: str
    headers: Any  # case-insensitive, as on the wire
    body: dict[str, Any]

    @property
    def kv(self) -> dict[str, Any] | None:
        return self.body.get("kv_transfer_params")

    @property
    def has_handle(self) -> bool:
        """True when a prefill request carries a decode handle (reuse turn)."""
        kv = self.kv or {}
        return (bool(kv.get("remote_block_ids") or kv.get(COUNTS_KEY))
                and kv.get("do_remote_decode") is True)


@dataclass
class Behaviour:
    status: int | None = None  # answer every generation request with this status
    fail_next: int = 0  # answer this many generation requests with `status_next`
    status_next: int = 500
    fail_with_handle: int | None = None  # prefill: this status when a handle is sent
    hang: bool = False  # never answer generation requests
    close_before_reply: bool = False  # drop the connection without answering
    close_next: int = 0  # drop the connection of this many generation requests
    stall_after: int | None = None  # decode stream: stall forever after N chunks
    break_after: int | None = None  # decode stream: drop the connection after N chunks
    chunk_delay: float = 0.0  # decode stream: pause between chunks
    one_write: bool = False  # decode stream: every event and the end in one write
    stall_before_end: bool = False  # decode stream: every event, then never the end
    reply: list[str] = field(default_factory=lambda: ["Hello", " from", " the", " fake", "."])
    params_on_last_chunk: bool = False  # decode: params on the finish chunk, not alone
    # decode: as vLLM 0.33 streams, with compact JSON: `"kv_transfer_params":null` on
    # every chunk, the params on the finish chunk
    native_stream_params: bool = False
    no_params: bool = False  # decode: finish without kv_transfer_params
    health_status: int = 200
    residency_status: int = 200  # decode: /bidirkv/residency answers with this status
    recall_gate: asyncio.Event | None = None  # decode: a recall is answered once it is set
    wire_version: int = VERSION  # the bidir-kv wire version its handles carry
    num_blocks: int = 1000  # decode: the capacity /bidirkv/residency reports
    shared_blocks: int | None = None  # decode: its handles say this many were kept already
    # decode: /bidirkv/residency says it is draining (set, as on the real engine, by a
    # call with `"drain": true`; a call with false clears it)
    draining: bool = False
    max_model_len: int = 4096  # what /v1/models reports, as vLLM does
    # decode: the count /metrics reports as vllm:bidirkv_retained_requests (None: the
    # requests it handed out a handle for and still holds); prefill reports 0
    retained_requests: int | None = None
    metrics_status: int = 200  # /metrics answers with this status
    # Realistic handles at this block size (None: a few ids, no digests, no MAC)
    block_size: int | None = None


class FakeEngine:
    def __init__(self, role: str, engine_id: str | None = None, model: str = "fake-model",
                 nixl_host: str = "10.0.0.9", nixl_port: int = 5600) -> None:
        assert role in ("prefill", "decode")
        self.role = role
        self.engine_id = engine_id or f"{role}-{uuid.uuid4().hex[:8]}"
        self.model = model
        # What the engine believes its side-channel address is (a pod IP in a cluster).
        self.nixl_host = nixl_host
        self.nixl_port = nixl_port
        self.behaviour = Behaviour()
        self.received: list[Received] = []
        self.health_checks = 0
        self.cancelled = 0
        self.cancelled_event = asyncio.Event()
        self.completed = 0
        self.record = True
        self.residency_calls: list[dict[str, Any]] = []
        self.released: list[str] = []
        self.released_event = asyncio.Event()
        # decode: the request ids it handed out a handle for (what it retains), and the
        # notes their owner left beside them (request id -> (sequence, owner, note)), as
        # bidirkv/connector/core/notes.py keeps them.
        # request id -> what the note leaves out of its handle (wire.NOTE_LEAVES_OUT)
        self.issued: dict[str, dict[str, Any]] = {}
        self.notes: dict[str, tuple[int, str, str]] = {}
        self._note_seq = itertools.count(1)
        self._blocks = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.port = 0

    # -- lifecycle ---------------------------------------------------------------
    def app(self) -> web.Application:
        # vLLM takes bodies of any size; so does the stand-in (aiohttp's default is 1 MiB).
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        if self.role == "decode":
            app.router.add_post("/bidirkv/residency", self._residency)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- helpers -------------------------------------------------------------------
    def generations(self) -> list[Received]:
        return [r for r in self.received if r.path.startswith("/v1/") and r.body is not None]

    def _mark_cancelled(self) -> None:
        self.cancelled += 1
        self.cancelled_event.set()

    def _params(self, request_id: str, num_tokens: int) -> dict[str, Any]:
        bs = self.behaviour.block_size
        # With a block size: one block a `bs` tokens, the last one partial.
        blocks = ([next(self._blocks) for _ in range(max(1, num_tokens // 16 + 1))]
                  if bs is None else [0] * -(-num_tokens // bs))
        decode = self.role == "decode"
        out = {
            "do_remote_prefill": not decode, "do_remote_decode": decode,
            "remote_block_ids": [blocks], "remote_engine_id": self.engine_id,
            "remote_request_id": request_id, "remote_host": self.nixl_host,
            "remote_port": self.nixl_port, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
            "remote_num_tokens": num_tokens,
            "remote_blocks_expiry_time": 123456.789 if decode else None,
            "transfer_mode": "pull", VERSION_KEY: self.behaviour.wire_version,
        }
        if bs is not None:  # as the plugin signs a handle (connector/hooks/reuse.py)
            if decode:
                out[BLOCKS_KEY] = digests.HeldBlocks.of(
                    bs, digests.fingerprint(SEED), SEED, range(num_tokens)).to_wire()
            # The issuer names its blocks by count; the reader asks it for their ids.
            out[COUNTS_KEY] = [len(blocks)]
            del out["remote_block_ids"]
            stamp_expiry(out, 480.0)
            out[MAC_KEY] = sign(out, HANDLE_KEY)
        if decode and self.behaviour.shared_blocks is not None:
            out[SHARED_BLOCKS_KEY] = self.behaviour.shared_blocks  # beside the signed part
        return out

    @staticmethod
    def _prompt_tokens(body: dict[str, Any]) -> int:
        if isinstance(body.get(PROMPT_TOKENS_FIELD), int):
            return body[PROMPT_TOKENS_FIELD]
        if "messages" in body:
            return sum(len(json.dumps(m)) // 4 + 1 for m in body["messages"])
        return len(str(body.get("prompt", ""))) // 4 + 1

    # -- handlers ------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        return web.json_response({}, status=self.behaviour.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        """vLLM's /metrics as a decode engine with bidir-kv exports it (one engine)."""
        if self.behaviour.metrics_status != 200:
            return web.Response(status=self.behaviour.metrics_status)
        n = self.behaviour.retained_requests
        if n is None:
            n = len(self.issued) if self.role == "decode" else 0
        labels = f'engine="0",model_name="{self.model}"'
        text = ("# HELP vllm:bidirkv_retained_requests Requests retained for a later turn.\n"
                "# TYPE vllm:bidirkv_retained_requests gauge\n"
                f"vllm:bidirkv_retained_requests{{{labels}}} {float(n)}\n"
                "# HELP vllm:num_requests_running Requests running.\n"
                "# TYPE vllm:num_requests_running gauge\n"
                f"vllm:num_requests_running{{{labels}}} 0.0\n")
        return web.Response(text=text, content_type="text/plain")

    async def _residency(self, request: web.Request) -> web.Response:
        """What the bidir-kv plugin's route answers (bidirkv/connector/endpoint.py), recorded."""
        body = await request.json()
        self.residency_calls.append(body)
        if self.behaviour.residency_status != 200:
            return web.json_response({}, status=self.behaviour.residency_status)
        self.released.extend(body.get("release") or [])
        for rid in body.get("release") or []:
            self.issued.pop(rid, None)
            self.notes.pop(rid, None)
        if body.get("release"):
            self.released_event.set()
        if isinstance(body.get("drain"), bool):
            self.behaviour.draining = body["drain"]
        out = {"enabled": True, "numBlocks": self.behaviour.num_blocks,
               "freeBlocks": self.behaviour.num_blocks, "retainedBlocks": 0,
               "releasedBlocks": 0, "released": {"router": 0},
               "draining": self.behaviour.draining, "activeRequests": 0}
        owner = body.get("owner")
        for rid, note in (body.get("keep") or {}).items():
            if rid in self.issued:
                self.notes[rid] = (next(self._note_seq), owner, note)
        if isinstance(body.get("recall"), int):
            if self.behaviour.recall_gate is not None:
                await self.behaviour.recall_gate.wait()
            mine = sorted((seq, rid, note) for rid, (seq, who, note) in self.notes.items()
                          if who == owner and seq > body["recall"])
            out.update({"notes": {rid: note for _, rid, note in mine},
                        "recallHandles": {rid: self.issued[rid] for _, rid, _ in mine},
                        "recallNext": max([body["recall"]] + [s for s, _, _ in mine]),
                        "recallMore": False})
        return web.json_response(out)

    def issue(self, params: dict[str, Any]) -> None:
        """Decode handed out `params`: it retains the request, and keeps what a note
        leaves out of the handle for a recall."""
        self.issued[params["remote_request_id"]] = {
            k: params[k] for k in NOTE_LEAVES_OUT if k in params}

    def forget_notes(self) -> None:
        """A restart of the engine: it retains nothing, so it holds no notes."""
        self.issued.clear()
        self.notes.clear()

    async def wait_released(self, request_id: str, timeout: float = 5.0) -> bool:
        """True once `request_id` was sent for release (bounded wait)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while request_id not in self.released:
            left = deadline - loop.time()
            if left <= 0:
                return False
            self.released_event.clear()
            try:
                await asyncio.wait_for(self.released_event.wait(), left)
            except TimeoutError:
                return request_id in self.released
        return True

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "owned_by": "fake",
             "max_model_len": self.behaviour.max_model_len}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        rec = Received(request.path, CIMultiDict(request.headers), body)
        if self.record:
            self.received.append(rec)
        b = self.behaviour
        try:
            if b.hang:
                await asyncio.sleep(3600)
            if b.close_next > 0 or b.close_before_reply:
                b.close_next = max(0, b.close_next - 1)
                assert request.transport is not None
                request.transport.close()
                await asyncio.sleep(1)
                return web.Response()
            if b.fail_next > 0:
                b.fail_next -= 1
                return web.json_response({"error": {"message": "injected"}},
                                         status=b.status_next)
            if b.status is not None:
                return web.json_response({"error": {"message": "injected"}}, status=b.status)
            if self.role == "prefill" and b.fail_with_handle is not None and rec.has_handle:
                return web.json_response({"error": {"message": "expired remote read"}},
                                         status=b.fail_with_handle)
            if self.role == "prefill" and rec.kv is not None:
                return self._prefill_reply(request, rec)
            if body.get("stream"):
                return await self._stream(request, rec)
            return self._decode_reply(request, rec)
        except asyncio.CancelledError:
            self._mark_cancelled()
            raise

    def _rid(self, request: web.Request) -> str:
        return request.headers.get("X-Request-Id", uuid.uuid4().hex)

    def _prefill_reply(self, request: web.Request, rec: Received) -> web.Response:
        n = self._prompt_tokens(rec.body)
        kv = self._params(self._rid(request), n)
        offered = (rec.kv or {}).get("remote_num_tokens") if rec.has_handle else None
        if isinstance(offered, int):
            kv["bidirkv"] = {"reused_tokens": min(offered, n), "offered_tokens": offered,
                             "verified": True}
        chat = "messages" in rec.body
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": "x"}
        else:
            choice["text"] = "x"
        self.completed += 1
        return web.json_response({
            "id": "cmpl-p", "object": "chat.completion" if chat else "text_completion",
            "model": self.model, "choices": [choice],
            "usage": {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1},
            "kv_transfer_params": kv,
        })

    def _decode_reply(self, request: web.Request, rec: Received) -> web.Response:
        b = self.behaviour
        chat = "messages" in rec.body
        text = "".join(b.reply)
        n = self._prompt_tokens(rec.body) + len(b.reply) - 1
        out: dict[str, Any] = {}
        if self.role == "prefill":
            out["kv_transfer_params"] = None  # what vLLM answers to a request without any
        elif not b.no_params:
            out["kv_transfer_params"] = self._params(self._rid(request), n)
            self.issue(out["kv_transfer_params"])
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        out.update({
            "id": "cmpl-d", "object": "chat.completion" if chat else "text_completion",
            "model": self.model, "choices": [choice],
            "usage": {"prompt_tokens": n, "completion_tokens": len(b.reply)},
        })
        self.completed += 1
        return web.json_response(out)

    async def _stream(self, request: web.Request, rec: Received) -> web.StreamResponse:
        b = self.behaviour
        chat = "messages" in rec.body
        obj = "chat.completion.chunk" if chat else "text_completion"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            data = {"id": "cmpl-d", "object": obj, "created": 1, "model": self.model,
                    "choices": choices, **extra}
            if b.native_stream_params:
                data.setdefault("kv_transfer_params", None)
                return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        events: list[bytes] = []
        if chat:
            events.append(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "finish_reason": None}]))
        for piece in b.reply:
            if chat:
                events.append(chunk([{"index": 0, "delta": {"content": piece},
                                      "finish_reason": None}]))
            else:
                events.append(chunk([{"index": 0, "text": piece, "finish_reason": None}]))
        n = self._prompt_tokens(rec.body) + len(b.reply) - 1
        whole = self.role == "prefill"
        params = None if b.no_params or whole else self._params(self._rid(request), n)
        if params is not None:
            self.issue(params)
        finish = [{"index": 0, "delta": {}, "finish_reason": "stop"}] if chat else \
            [{"index": 0, "text": "", "finish_reason": "stop"}]
        if params is not None and (b.params_on_last_chunk or b.native_stream_params):
            events.append(chunk(finish, kv_transfer_params=params))
        else:
            events.append(chunk(finish))
            if params is not None:
                events.append(chunk([], kv_transfer_params=params))
        events.append(b"data: [DONE]\n\n")
        if b.one_write:
            await resp.write_eof(b"".join(events))
            self.completed += 1
            return resp
        try:
            for i, ev in enumerate(events):
                if b.stall_after is not None and i >= b.stall_after:
                    await asyncio.sleep(3600)
                if b.break_after is not None and i >= b.break_after:
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                await resp.write(ev)
                if b.chunk_delay:
                    await asyncio.sleep(b.chunk_delay)
            if b.stall_before_end:
                await asyncio.sleep(3600)
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            self._mark_cancelled()
            raise
        self.completed += 1
        return resp


async def _serve(role: str, host: str, port: int, reply_tokens: int,
                 block_size: int | None = None) -> None:
    engine = FakeEngine(role)
    engine.record = False  # a benchmark would otherwise grow memory forever
    engine.behaviour.reply = [f" t{i}" for i in range(reply_tokens)]
    engine.behaviour.block_size = block_size
    if block_size is not None:  # a pool its block ids fit in: the router keeps its handles
        engine.behaviour.num_blocks = MAX_BLOCK_ID
    await engine.start(host, port)
    print(f"fake {role} engine on {engine.url}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["prefill", "decode"], required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--reply-tokens", type=int, default=8)
    ap.add_argument("--block-size", type=int, help="realistic handles at this block size")
    args = ap.parse_args()
    asyncio.run(_serve(args.role, args.host, args.port, args.reply_tokens, args.block_size))


if __name__ == "__main__":
    main()


class Cluster:
    """Fake engines plus a router in this process, all on 127.0.0.1 ephemeral ports.

        async with Cluster(prefill=1, decode=2, config={"bidirectional": True}) as c:
            await c.chat([...], conversation_id="a")
    """

    def __init__(self, prefill: int = 1, decode: int = 1, config: dict[str, Any] | None = None,
                 config_path: Any = None, file_config: Any = None,
                 reload_interval: float = 0.05, handle_key: bytes | None = None) -> None:
        self.p = [FakeEngine("prefill", nixl_host="10.0.1.1") for _ in range(prefill)]
        self.d = [FakeEngine("decode", nixl_host="10.0.2.2") for _ in range(decode)]
        self.config = config or {}
        # With a file: `file_config(cluster)` gives its content once the engines listen,
        # and the command-line overrides are only `config`.
        self.config_path = config_path
        self.file_config = file_config
        self.reload_interval = reload_interval
        self.handle_key = handle_key
        self.running: Any = None
        self.session: Any = None

    async def __aenter__(self) -> Cluster:
        import aiohttp

        from bidirkv.router.config import load_config
        from bidirkv.router.server.app import build_app, start_router

        for e in self.p + self.d:
            await e.start()
        if self.config_path is not None:
            self.write_config(self.file_config(self))
            overrides = dict(self.config)
        else:
            # Most tests here are about the two legs and the handles: the router takes
            # them for every turn unless a test asks for a placement (the default, `cost`,
            # may serve a first turn whole on decode). Their answers name the placement
            # (placementHeader, off by default), which many of them assert on.
            overrides = {"prefill": [e.url for e in self.p], "decode": [e.url for e in self.d],
                         "placement": {"policy": "alwaysDisaggregate"}, "placementHeader": True}
            overrides.update(self.config)
        cfg = load_config(self.config_path, overrides)
        app = build_app(cfg, config_path=self.config_path, overrides=overrides,
                        reload_interval=self.reload_interval, handle_key=self.handle_key)
        self.running = await start_router(app)
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.session is not None:
            await self.session.close()
        if self.running is not None:
            await self.running.stop()
        for e in self.p + self.d:
            await e.stop()

    def write_config(self, data: dict[str, Any]) -> None:
        """Replace the config file atomically (as a ConfigMap update would)."""
        import os

        tmp = f"{self.config_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.config_path)

    @property
    def url(self) -> str:
        return self.running.url

    @property
    def router(self) -> Any:
        return self.running.router

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None
                   ) -> tuple[int, bytes, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.session.post(self.url + path, data=data, headers={
                "Content-Type": "application/json", **(headers or {})}) as r:
            return r.status, await r.read(), r.headers

    async def chat(self, messages: list[dict[str, Any]], stream: bool = False,
                   headers: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
        """One chat turn; returns {status, raw, message, events} (events when streamed)."""
        body = {"model": "fake-model", "messages": messages, "stream": stream, **extra}
        status, raw, hdrs = await self.post("/v1/chat/completions", body, headers)
        return _parse(status, raw, hdrs, stream, chat=True)

    async def complete(self, prompt: Any, stream: bool = False,
                       headers: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
        body = {"model": "fake-model", "prompt": prompt, "stream": stream, **extra}
        status, raw, hdrs = await self.post("/v1/completions", body, headers)
        return _parse(status, raw, hdrs, stream, chat=False)

    async def metrics(self) -> str:
        async with self.session.get(self.url + "/metrics") as r:
            return await r.text()


def sse_events(raw: bytes) -> list[Any]:
    """Data payloads of an SSE body: decoded JSON, or the string for [DONE]."""
    out: list[Any] = []
    for event in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                data = line[5:].strip()
                out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def _parse(status: int, raw: bytes, headers: Any, stream: bool, chat: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"status": status, "raw": raw, "headers": headers}
    if status != 200:
        out["error"] = json.loads(raw) if raw.startswith(b"{") else raw
        return out
    if stream:
        events = sse_events(raw)
        out["events"] = events
        text = []
        for ev in events:
            if isinstance(ev, dict):
                for ch in ev.get("choices") or ():
                    text.append((ch.get("delta") or {}).get("content") or ch.get("text") or "")
        out["text"] = "".join(text)
    else:
        body = json.loads(raw)
        out["body"] = body
        choice = body["choices"][0]
        out["text"] = choice["message"]["content"] if chat else choice["text"]
    if chat:
        out["message"] = {"role": "assistant", "content": out["text"]}
    return out
