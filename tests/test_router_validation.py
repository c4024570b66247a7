"""Client request validation: 400s that name the field and value; consumed fields."""

import json

import pytest
from multidict import CIMultiDict

from bidirkv.router.codec import HAVE_ORJSON
from bidirkv.router.request import validation
from bidirkv.router.request.bodycheck import surrogate_problem
from bidirkv.router.request.validation import CHAT, COMPLETIONS, ClientError, parse_request

MSGS = [{"role": "user", "content": "hi"}]


def parse(body, kind=CHAT, header=None, headers=None):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    if header is not None:
        headers = {"X-Conversation-Id": header, **(headers or {})}
    return parse_request(raw, kind, CIMultiDict(headers or {}))


@pytest.mark.parametrize(
    ("body", "kind", "needle"),
    [
        (b"{not json", CHAT, "not valid JSON"),
        ([1, 2], CHAT, "must be a JSON object"),
        ({}, CHAT, "messages: required"),
        ({"messages": "hi"}, CHAT, "messages: 'hi'"),
        ({"messages": []}, CHAT, "non-empty list"),
        ({"messages": ["hi"]}, CHAT, "messages[0]: 'hi'"),
        ({"messages": [{"content": "x"}]}, CHAT, "messages[0].role: None"),
        ({"messages": MSGS, "stream": "yes"}, CHAT, "stream: 'yes' is not allowed; expected "
                                                    "true or false"),
        ({"messages": MSGS, "max_tokens": 0}, CHAT, "max_tokens: 0"),
        ({"messages": MSGS, "max_tokens": "5"}, CHAT, "max_tokens: '5'"),
        ({"messages": MSGS, "max_tokens": True}, CHAT, "max_tokens: True"),
        ({"messages": MSGS, "n": -1}, CHAT, "n: -1"),
        ({"messages": MSGS, "model": 3}, CHAT, "model: 3"),
        ({"messages": MSGS, "conversation_id": 7}, CHAT, "conversation_id: 7"),
        ({"messages": MSGS, "conversation_id": "x" * 600}, CHAT, "too long"),
        ({"messages": MSGS, "stream_options": "x"}, CHAT, "stream_options: 'x'"),
        ({"messages": MSGS, "cache_salt": ""}, CHAT, "cache_salt: '' is not allowed; "
                                                     "expected a non-empty string"),
        ({"messages": MSGS, "cache_salt": 7}, CHAT, "cache_salt: 7"),
        ({"messages": MSGS, "cache_salt": "s" * 129}, CHAT,
         "cache_salt: 129 characters is too long; at most 128 allowed"),
        ({"prompt": "a", "cache_salt": "s" * 2_000_000}, COMPLETIONS,
         "cache_salt: 2000000 characters is too long; at most 128 allowed"),
        ({"prompt": None}, COMPLETIONS, "prompt: None"),
        ({}, COMPLETIONS, "prompt: required"),
        ({"prompt": [1, "a"]}, COMPLETIONS, "prompt: [1, 'a']"),
    ],
)
def test_bad_requests_are_400_naming_field_and_value(body, kind, needle):
    with pytest.raises(ClientError) as exc:
        parse(body, kind)
    assert exc.value.status == 400
    assert needle in exc.value.message


def test_consumed_fields_and_defaults():
    req = parse({"messages": MSGS, "conversation_id": "c", "kv_transfer_params": {"x": 1},
                 "temperature": 0.5})
    assert req.conversation_id == "c" and req.stream is False
    assert req.body == {"messages": MSGS, "temperature": 0.5}


def test_cache_salt_up_to_vllms_bound_is_taken():
    assert parse({"messages": MSGS, "cache_salt": "s" * 128}).body["cache_salt"] == "s" * 128
    with pytest.raises(ClientError) as exc:
        parse({"messages": MSGS, "cache_salt": "s" * 129})
    assert exc.value.param == "cache_salt"


def test_session_ids_name_the_conversation_after_bidirkvs_own():
    """vLLM's `session_id` (kept for the engines) and X-Session-ID, after ours."""
    sess = {"X-Session-ID": "hs"}
    assert parse({"messages": MSGS}, headers={"x-session-id": "hs"}).conversation_id == "hs"
    req = parse({"messages": MSGS, "session_id": "bs"}, headers=sess)
    assert req.conversation_id == "bs" and req.body["session_id"] == "bs"
    assert parse({"messages": MSGS, "session_id": "bs"}, header="h").conversation_id == "h"
    req = parse({"messages": MSGS, "conversation_id": "c", "session_id": "bs"}, CHAT, "h", sess)
    assert req.conversation_id == "c" and "conversation_id" not in req.body
    # Every id sent is held to the bound, the one used or not.
    for body, headers, field in (
            ({"messages": MSGS, "session_id": "s" * 513}, None, "session_id"),
            ({"messages": MSGS, "conversation_id": "c"}, {"X-Session-ID": "s" * 513},
             "X-Session-ID"),
            ({"messages": MSGS, "session_id": 7}, None, "session_id"),
            ({"messages": MSGS}, {"X-Session-ID": ""}, "X-Session-ID")):
        with pytest.raises(ClientError) as exc:
            parse(body, headers=headers)
        assert exc.value.status == 400 and exc.value.param == field, field


def test_header_id_and_body_precedence():
    assert parse({"messages": MSGS}, header="h").conversation_id == "h"
    assert parse({"messages": MSGS, "conversation_id": "b"}, header="h").conversation_id == "b"
    with pytest.raises(ClientError, match="X-Conversation-Id"):
        parse({"messages": MSGS}, header="")


@pytest.mark.parametrize("prompt", ["a", ["a", "b"], [1, 2], [[1], [2, 3]]])
def test_prompt_forms(prompt):
    assert parse({"prompt": prompt, "stream": None}, COMPLETIONS).stream is False


def test_brackets_inside_strings_do_not_count_as_containers():
    code = "{[" * 50_000  # a message quoting code: one string, no containers
    body = json.dumps({"messages": [{"role": "user", "content": code}] * 3}).encode()
    assert parse_request(body, CHAT, None, max_containers=100).body["messages"]
    many = json.dumps({"messages": [{"role": "user", "content": "x"}] * 100}).encode()
    with pytest.raises(ClientError, match="more than 100 JSON objects and arrays"):
        parse_request(many, CHAT, None, max_containers=100)


@pytest.mark.parametrize("depth", [65, 1000, 1500, 2_000_000])
def test_deep_bodies_are_refused_with_one_message(depth):
    """Below the parser's own limit (orjson: 1024) the parsed body is walked without
    recursion; past it the parser stops at once. Either way, the same 400."""
    raw = b'{"messages":' + b"[" * depth + b"]" * min(depth, 2000) + b"}"
    with pytest.raises(ClientError, match="nested deeper than 64 levels"):
        parse_request(raw, CHAT, None)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"max_completion_tokens": 5000}, "max_completion_tokens: 5000 is more than the "
                                          "model's context length (4096 tokens)"),
        ({"n": 4097}, None),  # n is not a token count
        # Every count is checked for its type before any against the context.
        ({"max_tokens": 5000, "n": 0}, "n: 0 is not allowed"),
    ],
)
def test_token_counts_against_the_models_context(extra, needle):
    raw = json.dumps({"messages": MSGS, **extra}).encode()
    if needle is None:
        assert parse_request(raw, CHAT, None, 4096).body["n"] == 4097
        return
    with pytest.raises(ClientError) as e:
        parse_request(raw, CHAT, None, 4096)
    assert needle in e.value.message


@pytest.mark.skipif(not HAVE_ORJSON, reason="without orjson every body is scanned first")
def test_a_body_the_parser_takes_is_not_scanned_again_for_lone_surrogates(monkeypatch):
    """orjson refuses every lone surrogate, so only a body it refused is scanned for the
    message that says where: a long history is not passed over once more on every turn."""
    scanned = []

    def spy(raw):
        scanned.append(len(raw))
        return surrogate_problem(raw)

    monkeypatch.setattr(validation, "surrogate_problem", spy)
    text = "caf\u00e9 \U0001f600 " * 1000  # escaped as \u00e9 and a surrogate pair
    raw = json.dumps({"messages": [{"role": "user", "content": text}]}).encode()
    assert b"\\ud83d\\ude00" in raw
    assert parse_request(raw, CHAT, None).body["messages"][0]["content"] == text
    assert scanned == []
    lone = b'{"messages":[{"role":"user","content":"a\\ud800b"}]}'
    with pytest.raises(ClientError, match=r"messages\[0\].content: contains a lone UTF-16"):
        parse_request(lone, CHAT, None)
    with pytest.raises(ClientError, match="not valid JSON"):
        parse_request(b'{"messages":[}', CHAT, None)
    assert scanned == [len(lone), len(b'{"messages":[}')]
