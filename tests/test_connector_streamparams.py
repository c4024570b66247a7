"""The final SSE chunk with D's params (connector/core/streamparams.py),
read by the router."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from bidirkv.connector.core.streamparams import (
    CHAT_OBJECT,
    DONE,
    params_event,
    wrap_stream_generator,
)
from bidirkv.router.engine.sse import SSEFilter

PARAMS = {"do_remote_decode": True, "remote_block_ids": [[1, 2]], "remote_num_tokens": 99}


def test_params_event_is_one_well_formed_sse_event():
    ev = params_event(PARAMS, request_id="chatcmpl-1", model="m", created=5,
                      object_=CHAT_OBJECT)
    assert ev.startswith("data: ") and ev.endswith("\n\n") and "\n" not in ev[:-2]
    chunk = json.loads(ev[6:])
    assert chunk == {"id": "chatcmpl-1", "object": CHAT_OBJECT, "created": 5, "model": "m",
                     "choices": [], "kv_transfer_params": PARAMS}


class FakeServing:
    """The shape of vLLM's serving classes: an async generator method fed engine outputs."""

    async def chat_completion_stream_generator(self, request, result_generator, request_id,
                                               model_name, conversation=None):
        async for res in result_generator:
            yield f"data: {json.dumps({'choices': [{'delta': {'content': res.text}}]})}\n\n"
        yield DONE

    async def completion_stream_generator(self, request, engine_inputs, result_generator,
                                          request_id, created_time, model_name, num_prompts):
        async for i, res in result_generator:
            yield f"data: {json.dumps({'choices': [{'index': i, 'text': res.text}]})}\n\n"
        yield DONE


async def outputs(items):
    for item in items:
        yield item


def out(text, params=None):
    return SimpleNamespace(text=text, kv_transfer_params=params)


async def collect(gen):
    return [e async for e in gen]


def test_chat_stream_gets_the_params_before_done_and_the_router_takes_them_out():
    wrapped = wrap_stream_generator(FakeServing.chat_completion_stream_generator,
                                    CHAT_OBJECT)
    gen = wrapped(FakeServing(), None, outputs([out("a"), out("b", PARAMS)]), "rid", "m")
    events = asyncio.run(collect(gen))
    assert len(events) == 4 and events[-1] == DONE
    chunk = json.loads(events[-2][6:])
    assert chunk["choices"] == [] and chunk["kv_transfer_params"] == PARAMS
    # The router's filter keeps the params and drops the whole chunk.
    f = SSEFilter()
    forwarded = f.feed("".join(events).encode()) + f.finish()
    assert f.params == PARAMS and b"kv_transfer_params" not in forwarded
    assert forwarded.endswith(DONE.encode())


def test_completion_stream_keeps_keyword_calls_and_uses_the_first_prompt():
    wrapped = wrap_stream_generator(FakeServing.completion_stream_generator,
                                    "text_completion")
    items = [(0, out("a")), (1, out("x", {"other": 1})), (0, out("b", PARAMS))]
    gen = wrapped(FakeServing(), None, [], outputs(items), "cmpl-1", created_time=77,
                  model_name="m", num_prompts=2)
    events = asyncio.run(collect(gen))
    chunk = json.loads(events[-2][6:])
    assert chunk["kv_transfer_params"] == PARAMS and chunk["created"] == 77
    assert chunk["object"] == "text_completion"


def test_no_params_no_extra_chunk():
    wrapped = wrap_stream_generator(FakeServing.chat_completion_stream_generator,
                                    CHAT_OBJECT)
    events = asyncio.run(collect(wrapped(FakeServing(), None, outputs([out("a")]), "r", "m")))
    assert events[-1] == DONE and "kv_transfer_params" not in "".join(events)


def test_generators_of_another_shape_are_refused():
    async def other(self, request, generator):
        yield DONE

    def not_a_generator(self, request, result_generator, request_id, model_name):
        return None

    for fn in (other, not_a_generator):
        with pytest.raises(TypeError):
            wrap_stream_generator(fn, CHAT_OBJECT)
