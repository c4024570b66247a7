"""Client request checks: what the router itself relies on, with OpenAI-style errors.

Only fields the router reads or rewrites are checked here (the engines validate the
rest); each error names the field, the value and what is allowed, and is a 4xx.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bidirkv.router.codec import HAVE_ORJSON, dumps, loads
from bidirkv.router.request.bodycheck import (
    MAX_DEPTH,
    container_problem,
    deep_message,
    depth_problem,
    nesting_problem,
    surrogate_problem,
)

CHAT = "chat"
COMPLETIONS = "completions"
MAX_CONVERSATION_ID = 512
# vLLM's own bound (vllm/entrypoints/generate/base/protocol.py, `validate_cache_salt`):
# a client written for vLLM sends no longer salt. The engines never see it (the router
# sends its keyed digest instead), so vLLM's forbidden characters do not matter here.
MAX_CACHE_SALT = 128


class ClientError(Exception):
    """A request the client must fix; becomes an OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_


def error_body(message: str, type_: str, param: str | None = None,
               code: int | str | None = None) -> bytes:
    return dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bad(field: str, value: Any, allowed: str) -> ClientError:
    return ClientError(400, f"{field}: {_show(value)} is not allowed; expected {allowed}", field)


def _too_long(field: str, value: str, limit: int) -> ClientError:
    return ClientError(400, f"{field}: {len(value)} characters is too long; at most {limit} "
                       "allowed", field)


class ParsedRequest:
    __slots__ = ("body", "stream", "conversation_id", "parent_id")

    def __init__(self, body: dict[str, Any], stream: bool, conversation_id: str | None,
                 parent_id: str | None = None) -> None:
        self.body = body
        self.stream = stream
        self.conversation_id = conversation_id
        # The conversation a sub-agent or fork says it comes from (a parent header).
        self.parent_id = parent_id


def _token_counts(body: dict[str, Any], max_model_len: int | None) -> None:
    """max_tokens, max_completion_tokens and n: positive integers when given; then the
    first two within the model's context, when it is known."""
    for field in ("max_tokens", "max_completion_tokens", "n"):
        value = body.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise _bad(field, value, "a positive integer")
    if max_model_len is None:
        return
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is not None and value > max_model_len:
            raise ClientError(400, f"{field}: {value} is more than the model's context "
                              f"length ({max_model_len} tokens)", field)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise _bad("messages", messages, "a list of message objects")
    if not messages:
        raise _bad("messages", messages, "a non-empty list of message objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", m, "an object with a `role`")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise _bad(f"messages[{i}].role", role, "a non-empty string")


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return
        if all(
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                              for t in p)
            for p in prompt
        ):
            return
    raise _bad(
        "prompt", prompt,
        "a string, a list of strings, a list of token ids or a list of token-id lists",
    )


def _decoded(raw: bytes, max_containers: int | None) -> Any:
    """The body's JSON, refused when hostile (too many containers, too deep, a lone
    surrogate) or not JSON."""
    # orjson stops past 1024 levels by itself, and the depth is checked once parsed;
    # the standard library's parser would recurse, so without orjson it is checked first.
    # Either bound needs one object or array per unit: a body with no more brackets than
    # the bound (counted once, in C; brackets inside strings only over-count) is not
    # scanned or walked for it.
    brackets = raw.count(b"[") + raw.count(b"{")
    if problem := ((max_containers is not None and brackets > max_containers
                    and container_problem(raw, max_containers))
                   or (not HAVE_ORJSON and (nesting_problem(raw) or surrogate_problem(raw)))):
        raise ClientError(400, problem)
    try:
        body = loads(raw)
    except (ValueError, RecursionError) as exc:
        if "depth limit" in str(exc):  # orjson, past its own limit
            raise ClientError(400, deep_message()) from None
        # orjson refuses every lone surrogate escape, so a body it took has none and is
        # not scanned for them (a pass over the whole body: ~0.2 ms a 128k-token history);
        # one it refused is, for the message that says where.
        raise ClientError(400, (HAVE_ORJSON and surrogate_problem(raw))
                          or f"request body is not valid JSON: {exc}") from None
    if HAVE_ORJSON and brackets > MAX_DEPTH and (problem := depth_problem(body)):
        raise ClientError(400, problem)
    return body


def _checked_fields(body: dict[str, Any], kind: str, max_model_len: int | None) -> bool:
    """The fields the router reads checked; whether the answer is streamed."""
    if kind == CHAT:
        if "messages" not in body:
            raise ClientError(400, "messages: required for /v1/chat/completions", "messages")
        _check_messages(body["messages"])
    else:
        if "prompt" not in body:
            raise ClientError(400, "prompt: required for /v1/completions", "prompt")
        _check_prompt(body["prompt"])
    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise _bad("stream", stream, "true or false")
    _token_counts(body, max_model_len)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", model, "a string")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise _bad("stream_options", so, "an object")
    _check_cache_salt(body.get("cache_salt"))
    return stream


def _check_cache_salt(salt: Any) -> None:
    """What vLLM takes: a non-empty string, no longer than it takes (a salt is a secret
    of a few dozen characters; a megabyte of one is only work for the router)."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise _bad("cache_salt", salt, "a non-empty string")
    if len(salt) > MAX_CACHE_SALT:
        raise _too_long("cache_salt", salt, MAX_CACHE_SALT)


# Where a request names its conversation, the first present wins: bidir-kv's own names,
# then the ones vLLM takes and agent clients send (vLLM's typed `session_id` and its
# `X-Session-ID` header, the only id vLLM's multi-turn benchmark client sends). Each
# present one is checked, so none an engine sees is over the bound.
ID_SOURCES = (("body", "conversation_id"), ("header", "X-Conversation-Id"),
              ("body", "session_id"), ("header", "X-Session-ID"))


def _checked_id(name: str, value: Any) -> str | None:
    """An id as sent (None: not sent), held to a conversation id's bounds."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _bad(name, value, "a non-empty string")
    if len(value) > MAX_CONVERSATION_ID:
        raise _too_long(name, value, MAX_CONVERSATION_ID)
    return value


def _conversation_id(body: dict[str, Any], headers: Mapping[str, str] | None) -> str | None:
    """The conversation's id by ID_SOURCES. `conversation_id` is ours and taken out of the
    body; `session_id` is vLLM's own field and stays for the engines."""
    found = None
    for where, name in ID_SOURCES:
        if where == "body":
            value = body.pop(name, None) if name == "conversation_id" else body.get(name)
        else:
            value = headers.get(name) if headers is not None else None
        value = _checked_id(name, value)
        found = value if found is None else found
    return found


def parent_id(headers: Mapping[str, str] | None, names: Sequence[str]) -> str | None:
    """The parent conversation a request names: the first of `names` (the configured
    parent headers, `parentHeaders`) it sends. Each one sent is held to the bounds of a
    conversation id, so an oversized one is refused whichever wins."""
    found = None
    for name in names if headers is not None else ():
        value = _checked_id(name, headers.get(name))
        found = value if found is None else found
    return found


def parse_request(raw: bytes, kind: str, headers: Mapping[str, str] | None,
                  max_model_len: int | None = None,
                  max_containers: int | None = None,
                  parent_headers: Sequence[str] = ()) -> ParsedRequest:
    """Validate and take apart a client body.

    Consumed here and never forwarded upstream: `conversation_id` (ours) and
    `kv_transfer_params` (only the router may tell engines where KV lives). `headers`:
    the request's, for the ids ID_SOURCES and `parent_headers` name there.
    """
    body = _decoded(raw, max_containers)
    if not isinstance(body, dict):
        raise ClientError(400, f"request body must be a JSON object, got {type(body).__name__}")
    stream = _checked_fields(body, kind, max_model_len)
    body.pop("kv_transfer_params", None)
    return ParsedRequest(body, stream, _conversation_id(body, headers),
                         parent_id(headers, parent_headers))
