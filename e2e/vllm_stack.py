"""A real 1P1D vLLM CPU stack for the data-plane suites, and the protocol's two legs.

Both servers run the operator's rendering of a spec (`engine_process`), so the plugin is
loaded the way a pod loads it: through the package's entry point, in every vLLM process.
The helpers drive the two legs over HTTP as docs/protocol.md describes, with a float32
tiny model, whose greedy output is reproducible, so "reuse on" and "reuse off" outputs
can be compared token for token.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from otlp_receiver import Receiver, receiving

from bidirkv.local.engines import LocalPorts, engine_process, local_router_config, local_secrets
from bidirkv.local.model import build_model
from bidirkv.local.ports import free_ports  # below the ephemeral range vLLM binds port 0 in
from bidirkv.local.procs import Proc, merged_env, stop_all
from bidirkv.operator.api.spec import parse_spec
from bidirkv.proof import make_proof
from bidirkv.wire import VERSION, VERSION_KEY

KEY = "e2e-handle-key"


def proof() -> str:
    """What the router adds to each leg: without it prefill keeps nothing for decode and
    decode keeps nothing for reuse, and neither hands out a handle."""
    return make_proof(KEY.encode())
BLOCK = 128
MODEL = "tiny"
START_TIMEOUT = 300
REQUEST_TIMEOUT = 90
MISS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}
# Generation settings under which a reply sent back as history re-tokenizes to exactly
# the generated ids (the word-level tokenizer round-trips, special tokens included).
GEN = {"temperature": 0, "max_tokens": 24, "ignore_eos": True, "skip_special_tokens": False}


def spec_for(model: pathlib.Path, max_model_len: int = 4096) -> dict:
    env = [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"},
           {"name": "UCX_TLS", "value": "tcp,self,sm"},
           {"name": "HF_HUB_OFFLINE", "value": "1"}]
    return {
        "model": {"name": str(model), "servedName": MODEL, "maxModelLen": max_model_len,
                  "dtype": "float32"},
        "engine": {"extraArgs": ["--enforce-eager", "--block-size", str(BLOCK),
                                 "--max-num-seqs", "8", "--max-num-batched-tokens",
                                 str(max_model_len)],
                   "extraEnv": env},
        # P without a prefix cache: every reused token comes from D, and "reuse off"
        # really recomputes.
        "prefill": {"enablePrefixCaching": False,
                    "extraEnv": [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0"}]},
        "decode": {"extraEnv": [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "1"}]},
        "kvTransfer": {"decoderKvBlocksTtlSeconds": 120, "kvRecomputeThreshold": 64,
                       "kvBufferDevice": "cpu"},
        # The suites on this stack test the two legs and the read back; the placements
        # (`cost`, the default, may run a turn whole on decode) name theirs.
        "router": {"conversationTtlSeconds": 100,
                   "placement": {"policy": "alwaysDisaggregate"}},
    }


@dataclass
class Stack:
    p: Proc
    d: Proc
    p_url: str
    d_url: str
    spec: object
    ports: dict
    root: pathlib.Path


@contextmanager
def running_stack(root: pathlib.Path, spec_doc: dict | None = None,
                  extra_args: dict[str, list[str]] | None = None) -> Iterator[Stack]:
    """P and D from `spec_doc` (default: `spec_for` a float32 tiny model built in root);
    `extra_args` per role are appended to that role's rendered vLLM arguments."""
    if spec_doc is None:
        spec_doc = spec_for(build_model(root / "model", dtype="float32"))
    spec = parse_spec(spec_doc)
    http_p, http_d, nixl_p, nixl_d = free_ports(4)
    ports = {"prefill": LocalPorts(http_p, nixl_p), "decode": LocalPorts(http_d, nixl_d)}
    procs: list[Proc] = []
    try:
        for role, lp in ports.items():
            argv, env = engine_process(spec, role, lp, local_secrets(KEY))
            argv += (extra_args or {}).get(role, [])
            # Started from the test's own directory, the repository's operator/ folder
            # would shadow the standard library for `python -m vllm...`.
            procs.append(Proc(role, argv, merged_env(env), root / f"{role}.log",
                              f"http://127.0.0.1:{lp.http}/health").start(cwd=str(root)))
        for proc in procs:
            proc.wait_healthy(START_TIMEOUT)
        yield Stack(procs[0], procs[1], f"http://127.0.0.1:{http_p}",
                    f"http://127.0.0.1:{http_d}", spec, ports, root)
    finally:
        stop_all(procs)


@contextmanager
def traced_stack(root: pathlib.Path) -> Iterator[tuple[Stack, Receiver]]:
    """`running_stack` with both engines exporting their spans (vLLM's own exporter, as
    spec.monitoring.tracing renders it) to an OTLP receiver in this process, which the
    routers of `running_router` export to as well."""
    with receiving() as receiver:
        doc = spec_for(build_model(root / "model", dtype="float32"))
        doc["monitoring"] = {"tracing": {"otlpEndpoint": receiver.url}}
        # Spans leave each process within a fifth of a second, not five.
        doc["engine"]["extraEnv"].append({"name": "OTEL_BSP_SCHEDULE_DELAY", "value": "200"})
        with running_stack(root, doc) as stack:
            yield stack, receiver


@contextmanager
def running_router(s: Stack, name: str = "router", **overrides) -> Iterator[tuple[str, Proc]]:
    """The real router process over the stack (its rendered config, plus `overrides`; an
    override of None removes that key)."""
    port, = free_ports(1)
    cfg = local_router_config(s.spec, [s.ports["prefill"]], [s.ports["decode"]])
    for key, value in overrides.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    cfg_path = s.root / f"{name}.json"
    cfg_path.write_text(json.dumps(cfg))
    argv = [str(pathlib.Path(sys.executable).parent / "bidir-kv"), "router", "--config",
            str(cfg_path), "--port", str(port), "--host", "127.0.0.1"]
    router = Proc(name, argv, merged_env({"BIDIRKV_HANDLE_KEY": KEY}), s.root / f"{name}.log",
                  f"http://127.0.0.1:{port}/health").start(cwd=str(s.root))
    try:
        router.wait_healthy(60)
        yield f"http://127.0.0.1:{port}", router
    finally:
        router.stop()


# -- HTTP ---------------------------------------------------------------------------------

def post(url: str, body: dict, timeout: float = REQUEST_TIMEOUT) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json",
                                  "X-Request-Id": str(uuid.uuid4())})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def stream(url: str, body: dict, timeout: float = REQUEST_TIMEOUT) -> list[dict | str]:
    """The data of each SSE event ([DONE] as the string)."""
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    events: list[dict | str] = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200
        for line in r:
            line = line.strip()
            if line.startswith(b"data:"):
                data = line[5:].strip()
                events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


def stream_text(events: list) -> str:
    parts = []
    for ev in events:
        for ch in ev.get("choices", []) if isinstance(ev, dict) else ():
            parts.append((ch.get("delta") or {}).get("content") or ch.get("text") or "")
    return "".join(parts)


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in
               re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def metric_reaches(url: str, name: str, value: float, within_s: float = 10.0) -> float:
    """The metric once it reaches `value` (or its last reading): vLLM's API server
    records an engine step's stats as it handles that step's output, which may come
    after the response that step finished."""
    deadline = time.monotonic() + within_s
    got = metric(url, name)
    while got < value and time.monotonic() < deadline:
        time.sleep(0.1)
        got = metric(url, name)
    return got


def chat(messages: list[dict], **over) -> dict:
    return {"model": MODEL, "messages": messages, **GEN, **over}


def prefill_leg(s: Stack, body: dict, handle: dict | None = None) -> dict:
    pbody = dict(body, stream=False, max_tokens=1)
    pbody.pop("stream_options", None)
    pbody["kv_transfer_params"] = (dict(handle, do_remote_decode=True,
                                        do_remote_prefill=False) if handle else dict(MISS))
    # What the router adds to a prefill leg too: without it P hands out no handle.
    pbody["kv_transfer_params"]["bidirkv_proof"] = proof()
    pbody["kv_transfer_params"][VERSION_KEY] = VERSION
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, out = post(s.p_url + path, pbody)
    assert status == 200, out
    return out


def decode_leg(s: Stack, body: dict, p_out: dict, streamed: bool = True
               ) -> tuple[str, dict | None, list]:
    dbody = dict(body, stream=streamed,
                 kv_transfer_params=dict(p_out["kv_transfer_params"], bidirkv_proof=proof(),
                                         **{VERSION_KEY: VERSION}))
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if not streamed:
        status, out = post(s.d_url + path, dbody)
        assert status == 200, out
        ch = out["choices"][0]
        return (ch.get("message") or {}).get("content") or ch.get("text"), out.get(
            "kv_transfer_params"), []
    events = stream(s.d_url + path, dbody)
    params = [e["kv_transfer_params"] for e in events
              if isinstance(e, dict) and "kv_transfer_params" in e]
    return stream_text(events), (params[-1] if params else None), events


def turn(s: Stack, body: dict, handle: dict | None = None, streamed: bool = True):
    """One protocol turn: P (with D's handle or as a miss), then D. (text, D params, P)."""
    p_out = prefill_leg(s, body, handle)
    text, d_params, _ = decode_leg(s, body, p_out, streamed)
    return text, d_params, p_out
