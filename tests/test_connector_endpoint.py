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
    ResidencyEndpoint,
    answer,
    body_problem,
    lease_bound,
    retention_ttl,
    valid_ids,
)
from bidirkv.proof import AUTH_SKEW_S, RESIDENCY_AUTH_HEADER, sign_residency
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


def signed(body: dict, key: bytes = KEY, now: float | None = None) -> tuple[str, bytes]:
    raw = json.dumps(body).encode()
    return sign_residency(key, RESIDENCY_PATH, raw, now), raw


class Engine:
    def __init__(self, out: dict | None = None) -> None:
        self.calls: list[dict] = []
        self.out = out

    async def __call__(self, body: dict) -> dict:
        self.calls.append(body)
        return dict(self.out or {"enabled": True, "releasedBlocks": 0})


def run(auth, raw, call, keys=(KEY,)):
    return asyncio.run(answer(auth, raw, keys, call))


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
    (lambda raw: sign_residency(b"another key" * 3, RESIDENCY_PATH, raw), "does not match"),
    (lambda raw: sign_residency(KEY, RESIDENCY_PATH, raw, time.time() - AUTH_SKEW_S - 5),
     "more than 60 s"),
    (lambda raw: sign_residency(KEY, RESIDENCY_PATH, raw + b" "), "does not match"),
    (lambda raw: sign_residency(KEY, "/v1/chat/completions", raw), "does not match"),
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
    status, out = asyncio.run(answer(auth, raw, (KEY,), Engine(), lease_bound(480)))
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
    """Through FastAPI, as vLLM mounts it: 401 with a challenge, 413 past the size bound."""
    fastapi = pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    monkeypatch.setenv("BIDIRKV_HANDLE_KEY", KEY.decode())
    monkeypatch.delenv("BIDIRKV_HANDLE_KEY_PREVIOUS", raising=False)
    app = fastapi.FastAPI()
    ResidencyEndpoint().attach_router(app)
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
                    headers={RESIDENCY_AUTH_HEADER: sign_residency(KEY, RESIDENCY_PATH, raw)})
    assert r.status_code == 200 and len(engine.calls) == 1
    big = b"x" * (MAX_BODY + 1)
    r = client.post(RESIDENCY_PATH, content=big,
                    headers={RESIDENCY_AUTH_HEADER: sign_residency(KEY, RESIDENCY_PATH, big)})
    assert r.status_code == 413 and len(engine.calls) == 1
