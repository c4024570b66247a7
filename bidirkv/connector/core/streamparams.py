"""D's `kv_transfer_params` at the end of a streamed response.

vLLM 0.32 returns them only in non-streamed bodies, so a router serving streaming
clients never learns where D keeps a conversation's KV. The serving layer's stream
generators are wrapped: the engine outputs they consume pass through a tap that keeps
the last params seen, and one extra event carrying them goes out just before
`data: [DONE]`:
    data: {"id": ..., "object": ..., "created": ..., "model": ..., "choices": [],
           "kv_transfer_params": {...}}
Chunks with empty `choices` are already legal in OpenAI streams (the usage chunk), and
the router drops this one before the client sees it (`bidirkv/router/engine/sse.py`).
"""

from __future__ import annotations

import functools
import inspect
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

DONE = "data: [DONE]\n\n"
CHAT_OBJECT = "chat.completion.chunk"
COMPLETION_OBJECT = "text_completion"
REQUIRED_ARGS = ("result_generator", "request_id", "model_name")


def params_event(params: dict[str, Any], *, request_id: str, model: str, created: int,
                 object_: str) -> str:
    chunk = {"id": request_id, "object": object_, "created": created, "model": model,
             "choices": [], "kv_transfer_params": params}
    return "data: " + json.dumps(chunk, separators=(",", ":"), default=str) + "\n\n"


class ParamsBox:
    __slots__ = ("params",)

    def __init__(self) -> None:
        self.params: dict[str, Any] | None = None


async def tap(source: AsyncIterator[Any], box: ParamsBox) -> AsyncIterator[Any]:
    """Pass engine outputs through, keeping the last params of the first prompt.

    Chat yields RequestOutput, completions (index, RequestOutput); a batched completion
    has one handle per prompt, and the non-streamed body also carries only the first.
    """
    async for item in source:
        out = item
        if isinstance(item, tuple) and len(item) == 2:
            if item[0] != 0:
                yield item
                continue
            out = item[1]
        params = getattr(out, "kv_transfer_params", None)
        if isinstance(params, dict):
            box.params = params
        yield item


async def with_params_event(events: AsyncIterator[str], box: ParamsBox,
                            make_event: Callable[[dict[str, Any]], str]
                            ) -> AsyncIterator[str]:
    async for event in events:
        if event == DONE and box.params is not None:
            yield make_event(box.params)
            box.params = None
        yield event


def wrap_stream_generator(orig: Callable[..., AsyncIterator[str]], object_: str
                          ) -> Callable[..., AsyncIterator[str]]:
    """A drop-in replacement of a serving class's `*_stream_generator` method."""
    sig = inspect.signature(orig)
    missing = [a for a in REQUIRED_ARGS if a not in sig.parameters]
    if missing or not inspect.isasyncgenfunction(orig):
        raise TypeError(f"{orig.__qualname__} is not a stream generator taking "
                        f"{', '.join(REQUIRED_ARGS)}")

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> AsyncIterator[str]:
        bound = sig.bind(*args, **kwargs)
        box = ParamsBox()
        bound.arguments["result_generator"] = tap(bound.arguments["result_generator"], box)
        request_id = str(bound.arguments["request_id"])
        model = str(bound.arguments["model_name"])
        created = bound.arguments.get("created_time")
        created = created if isinstance(created, int) else int(time.time())

        def make_event(params: dict[str, Any]) -> str:
            return params_event(params, request_id=request_id, model=model,
                                created=created, object_=object_)

        return with_params_event(orig(*bound.args, **bound.kwargs), box, make_event)

    return wrapper
