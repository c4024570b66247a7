"""Decode's /bidirkv/residency: who may call it (the handle key's signature), what body
is refused, and ids it skips."""

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from bidirkv.connector.endpoint import (
    MAX_BODY,
    MAX_ID,
    Credentials,
    ResidencyEndpoint,
    answer,
    body_problem,
    lease_bound,
    retention_ttl,
    valid_ids,
)
from bidirkv.connector.identity import Here
from bidirkv.proof import (
    AUTH_SKEW_S,
    RESIDENCY_AUTH_HEADER,
    RESIDENCY_TARGET_HEADER,
    residency_headers,
    sign_residency,
)
from bidirkv.wire import RESIDENCY_PATH, RESIDENCY_VERSION_FIELD, VERSION


def test_a_batch_with_bad_ids_is_taken_and_the_bad_ones_skipped():
    body = {"owner": "r", "leaseSeconds": 15,
            "release": ["chatcmpl-a-1", "x" * (MAX_ID + 1), "", 7, None, "chatcmpl-b-2"]}
    assert body_problem(body) is None
    assert valid_ids(body["release"]) == (["chatcmpl-a-1", "chatcmpl-b-2"], 4)


@pytest.mark.parametrize("body, word", [
    ([], "JSON object"), ({"owner": "r"}, "go together"), ({"nope": 1}, "unknown keys"),
    ({"release": "a"}, "list"), ({"owner": "r", "leaseSeconds": 0}, "1-86400"),
    ({"owner": "r", "leaseSeconds": 86401}, "leaseSeconds 86401: must be a number in 1-86400"),
])
def test_what_is_still_refused(body, word):
    assert word in body_problem(body)


# -- authentication: only holders of the handle key call the route ----------------------------
KEY = b"k" * 32
# The engine called, as its connection reaches it: a pod named decode-0 at 10.0.0.5:8000.
HERE = Here("decode-0", "10.0.0.5", 8000)
TARGET = "decode-0.decode.ns.svc:8000"  # its name, as the operator gives it to the router


def signed(body: dict, key: bytes = KEY, now: float | None = None) -> tuple[str, bytes]:
    raw = json.dumps(body).encode()
    return sign_residency(key, TARGET, RESIDENCY_PATH, raw, now), raw


def creds(auth, target=TARGET, here=HERE) -> Credentials:
    return Credentials(auth, target, here)


class Engine:
    def __init__(self, out: dict | None = None) -> None:
        self.calls: list[dict] = []
        self.out = out

    async def __call__(self, body: dict) -> dict:
        self.calls.append(body)
        return dict(self.out or {"enabled": True, "releasedBlocks": 0})


def run(auth, raw, call, keys=(KEY,), target=TARGET, here=HERE):
    return asyncio.run(answer(creds(auth, target, here), raw, keys, call))


BODY = {"owner": "router-a", "leaseSeconds": 30, "release": ["r1"],
        RESIDENCY_VERSION_FIELD: VERSION}


def test_a_signed_call_reaches_the_engine():
    engine = Engine()
    auth, raw = signed(BODY)
    status, out = run(auth, raw, engine)
    assert status == 200, out
    assert engine.calls == [{"owner": "router-a", "leaseSeconds": 30, "release": ["r1"]}]
    # The previous key is accepted while a rotation rolls out.
    auth, raw = signed(BODY, key=b"old" * 11)
    assert run(auth, raw, engine, keys=(KEY, b"old" * 11))[0] == 200


@pytest.mark.parametrize("make_auth, word", [
    (lambda raw: None, f"missing {RESIDENCY_AUTH_HEADER}"),
    (lambda raw: "garbage", "malformed"),
    (lambda raw: sign_residency(b"another key" * 3, TARGET, RESIDENCY_PATH, raw),
     "does not match"),
    (lambda raw: sign_residency(KEY, TARGET, RESIDENCY_PATH, raw, time.time() - AUTH_SKEW_S - 5),
     "more than 60 s"),
    (lambda raw: sign_residency(KEY, TARGET, RESIDENCY_PATH, raw + b" "),
     "not the one X-Bidirkv-Auth signed"),
    (lambda raw: sign_residency(KEY, TARGET, "/v1/chat/completions", raw), "does not match"),
    # Signed for another engine, its target header changed to this one's on the way.
    (lambda raw: sign_residency(KEY, "decode-1.decode.ns.svc:8000", RESIDENCY_PATH, raw),
     "does not match"),
])
def test_a_call_without_a_valid_signature_is_refused_and_does_nothing(make_auth, word):
    engine = Engine()
    raw = json.dumps(BODY).encode()
    status, out = run(make_auth(raw), raw, engine)
    assert status == 401 and out["error"]["type"] == "unauthorized"
    assert word in out["error"]["message"], out
    assert engine.calls == []


def test_an_engine_without_a_key_trusts_no_caller():
    auth, raw = signed(BODY)
    status, out = run(auth, raw, Engine(), keys=())
    assert status == 401 and "BIDIRKV_HANDLE_KEY" in out["error"]["message"]


def test_a_signed_call_of_another_version_or_a_bad_body_is_still_refused():
    auth, raw = signed({"release": []})
    assert run(auth, raw, Engine())[0] == 409
    auth, raw = signed({"owner": "r", "leaseSeconds": 86400, RESIDENCY_VERSION_FIELD: VERSION})
    status, out = asyncio.run(answer(creds(auth), raw, (KEY,), Engine(), lease_bound(480)))
    assert status == 400 and "1-480" in out["error"]["message"]


def test_a_lease_is_no_longer_than_decode_keeps_the_blocks():
    """A day-long lease on a decode that keeps blocks 480 s keeps nothing longer, only
    the owner's entry: refused, naming the field, the value and the most it grants."""
    kv = {"kv_connector": "NixlConnector",
          "kv_connector_extra_config": {"decoder_kv_blocks_ttl": 480}}
    for args in (SimpleNamespace(kv_transfer_config=kv),
                 SimpleNamespace(kv_transfer_config=json.dumps(kv)),
                 SimpleNamespace(kv_transfer_config=SimpleNamespace(**kv))):
        assert retention_ttl(args) == 480
    for args in (SimpleNamespace(), SimpleNamespace(kv_transfer_config=None),
                 SimpleNamespace(kv_transfer_config={"kv_connector_extra_config": {
                     "decoder_kv_blocks_ttl": "soon"}})):
        assert retention_ttl(args) is None
    problem = body_problem({"owner": "r", "leaseSeconds": 86400}, lease_bound(480))
    assert problem.startswith("leaseSeconds 86400: must be a number in 1-480 (")
    assert "decoder_kv_blocks_ttl" in problem
    assert body_problem({"owner": "r", "leaseSeconds": 480}, lease_bound(480)) is None


def test_an_owner_decode_has_no_room_for_is_answered_429():
    refused = "owner 'x' refused: decode already tracks 256 owners"
    auth, raw = signed(BODY)
    status, out = run(auth, raw, Engine({"enabled": True, "refused": refused}))
    assert status == 429 and out["error"] == {"message": refused, "type": "too_many_owners"}


def test_the_route_checks_the_signature_before_reading_the_body(monkeypatch):
    """Through FastAPI, as vLLM mounts it: 401 with a challenge, 413 past the size bound.
    (Starlette's test client reaches the app as testserver:80.)"""
    fastapi = pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    monkeypatch.setenv("BIDIRKV_HANDLE_KEY", KEY.decode())
    monkeypatch.delenv("BIDIRKV_HANDLE_KEY_PREVIOUS", raising=False)
    app = fastapi.FastAPI()
    ResidencyEndpoint(hostname="testserver").attach_router(app)
    engine = Engine()
    app.state.bidirkv_engine = type("Client", (), {"engine_core": type(
        "Core", (), {"call_utility_async": staticmethod(
            lambda name, body: engine(body))})()})()
    client = TestClient(app)
    raw = json.dumps(BODY).encode()
    r = client.post(RESIDENCY_PATH, content=raw)
    assert r.status_code == 401 and "WWW-Authenticate" in r.headers
    assert f"missing {RESIDENCY_AUTH_HEADER}" in r.json()["error"]["message"]
    r = client.post(RESIDENCY_PATH, content=raw,
                    headers=residency_headers(KEY, "testserver:80", RESIDENCY_PATH, raw))
    assert r.status_code == 200 and len(engine.calls) == 1
    # Signed for another engine: refused, naming what this one answers to.
    r = client.post(RESIDENCY_PATH, content=raw,
                    headers=residency_headers(KEY, "decode-1:80", RESIDENCY_PATH, raw))
    assert r.status_code == 401 and len(engine.calls) == 1
    assert "'decode-1:80' names another engine: this engine is 'testserver'" in \
        r.json()["error"]["message"]
    big = b"x" * (MAX_BODY + 1)
    r = client.post(RESIDENCY_PATH, content=big,
                    headers=residency_headers(KEY, "testserver:80", RESIDENCY_PATH, big))
    assert r.status_code == 413 and len(engine.calls) == 1


# -- the target: a signature is good at the engine it names only ------------------------------
DRAIN = {"drain": True, RESIDENCY_VERSION_FIELD: VERSION}


@pytest.mark.parametrize("target_a, here_a, here_b", [
    # Kubernetes: the router calls each pod by its own DNS name; the launcher names its host.
    ("decode-0.decode.ns.svc:8000", Here("decode-0", "10.0.0.5", 8000),
     Here("decode-1", "10.0.0.6", 8000)),
    ("decode-0:8000", Here("decode-0", "127.0.0.1", 8000), Here("decode-1", "127.0.0.1", 8000)),
    # Pod IPs.
    ("10.0.0.5:8000", Here("decode-0", "10.0.0.5", 8000), Here("decode-1", "10.0.0.6", 8000)),
    # A local stack: one host, one address, a port per engine.
    ("127.0.0.1:8101", Here("box", "127.0.0.1", 8101), Here("box", "127.0.0.1", 8102)),
    ("box:8101", Here("box", "127.0.0.1", 8101), Here("box", "127.0.0.1", 8102)),
])
def test_a_drain_signed_for_engine_a_is_refused_by_engine_b(target_a, here_a, here_b):
    """A drain seen on the way (the same body for every engine) marked each engine it was
    replayed to as leaving, for good: the signature now names its engine."""
    engine_a, engine_b = Engine(), Engine()
    raw = json.dumps(DRAIN).encode()
    headers = residency_headers(KEY, target_a, RESIDENCY_PATH, raw)
    auth, target = headers[RESIDENCY_AUTH_HEADER], headers[RESIDENCY_TARGET_HEADER]
    status, out = run(auth, raw, engine_b, target=target, here=here_b)
    assert status == 401 and engine_b.calls == []
    assert f"{RESIDENCY_TARGET_HEADER} {target_a!r} names another engine" in \
        out["error"]["message"]
    assert run(auth, raw, engine_a, target=target, here=here_a)[0] == 200
    assert engine_a.calls == [{"drain": True}]


@pytest.mark.parametrize("target, here, ok", [
    ("10.0.0.5:8000", Here("decode-0", "::ffff:10.0.0.5", 8000), True),  # a dual-stack socket
    ("[fd00::5]:8000", Here("decode-0", "fd00::5", 8000), True),
    ("localhost:8000", Here("decode-0", "127.0.0.1", 8000), True),
    ("localhost:8000", Here("decode-0", "10.0.0.5", 8000), False),
    ("decode-0.decode.ns.svc:8000", Here("DECODE-0.decode.ns.svc.cluster.local", "10.0.0.5",
                                         8000), True),
    ("decode-0:8001", Here("decode-0", "10.0.0.5", 8000), False),
    # A Service in front of several engines names none of them.
    ("decode.ns.svc:8000", Here("decode-0", "10.0.0.5", 8000), False),
    ("10.0.0.6:8000", Here("decode-0", "10.0.0.5", 8000), False),
    # A connection whose address the server did not give: nothing to check against.
    ("decode-0:8000", Here("decode-0"), False),
])
def test_which_targets_name_this_engine(target, here, ok):
    assert (here.target_problem(target) is None) is ok


def test_a_target_of_another_form_is_refused_naming_the_form():
    auth, raw = signed(BODY)
    for target, word in ((None, f"missing {RESIDENCY_TARGET_HEADER}"),
                         ("Decode-0:8000", "malformed"), ("decode-0", "malformed"),
                         ("a|b:80", "malformed")):
        status, out = run(auth, raw, Engine(), target=target)
        assert status == 401 and word in out["error"]["message"], out


def test_a_call_the_engine_never_answers_ends_with_a_503():
    """vLLM stopping its engine core leaves a utility call in flight unanswered, and its
    API server's shutdown waits for every request: unbounded, a drained pod never exits."""
    never = asyncio.Event()

    async def hung(body):
        await never.wait()

    auth, raw = signed(BODY)
    status, out = asyncio.run(answer(creds(auth), raw, (KEY,), hung, engine_s=0.05))
    assert status == 503 and "did not answer" in out["error"]["message"], out
