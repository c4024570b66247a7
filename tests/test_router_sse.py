"""SSE pass-through: params found in the last chunk, stripped, the rest byte-identical."""

import json

from bidirkv.router.engine.sse import (
    DONE,
    MessageCollector,
    SSEFilter,
    error_event,
    event_boundary,
    event_data,
    strip_params,
)

PARAMS = {"do_remote_decode": True, "remote_block_ids": [[1, 2]], "remote_host": "10.0.0.2"}


def ev(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chat_chunk(content=None, finish=None, **extra):
    delta = {} if content is None else {"content": content}
    return {"id": "x", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


STREAM = (ev(chat_chunk("Hel")) + ev(chat_chunk("lo")) + ev(chat_chunk(finish="stop"))
          + ev({"id": "x", "choices": [], "kv_transfer_params": PARAMS}) + DONE)


def run(filt: SSEFilter, data: bytes, step: int) -> bytes:
    out = b"".join(filt.feed(data[i:i + step]) for i in range(0, len(data), step))
    return out + filt.finish()


def test_params_only_chunk_is_dropped_whatever_the_chunking():
    expected = STREAM.replace(ev({"id": "x", "choices": [], "kv_transfer_params": PARAMS}), b"")
    for step in (1, 7, 64, len(STREAM)):
        filt = SSEFilter()
        assert run(filt, STREAM, step) == expected
        assert filt.params == PARAMS


def test_params_on_a_content_chunk_only_lose_the_key():
    data = ev(chat_chunk("Hi")) + ev(chat_chunk(finish="stop", kv_transfer_params=PARAMS)) + DONE
    filt = SSEFilter()
    out = run(filt, data, 5)
    assert b"kv_transfer_params" not in out and filt.params == PARAMS
    events = [json.loads(event_data(e)) for e in out.split(b"\n\n")[:2]]
    assert events[1]["choices"][0]["finish_reason"] == "stop"
    assert out.endswith(DONE)


def compact(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def test_vllm_0_33_streams_take_out_every_null_and_the_finishing_params():
    """vLLM 0.33 writes the key on every chunk (`null`) and the params on the finishing
    chunk: the nulls go as bytes, the rest of each chunk byte-identical."""
    nulls = [chat_chunk("Hel", kv_transfer_params=None), chat_chunk("lo", kv_transfer_params=None)]
    data = b"".join(compact(c) for c in nulls) + compact(
        chat_chunk(finish="stop", kv_transfer_params=PARAMS)) + DONE
    for step in (1, 9, len(data)):
        filt = SSEFilter()
        out = run(filt, data, step)
        assert b"kv_transfer_params" not in out and filt.params == PARAMS
        head = b"".join(compact({k: v for k, v in c.items() if k != "kv_transfer_params"})
                        for c in nulls)
        assert out.startswith(head)
        events = [json.loads(event_data(e)) for e in out.split(b"\n\n")
                  if e and e != DONE.strip()]
        assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_usage_chunk_with_params_is_kept():
    usage = {"id": "x", "choices": [], "usage": {"prompt_tokens": 3}}
    assert strip_params({**usage, "kv_transfer_params": PARAMS}) == usage
    assert strip_params({"id": "x", "choices": [], "kv_transfer_params": PARAMS}) is None


def test_untouched_bytes_when_no_params():
    data = ev(chat_chunk("a")) + DONE
    filt = SSEFilter()
    assert run(filt, data, 3) == data and filt.params is None


def test_crlf_events_and_unterminated_tail():
    data = (b"data: " + json.dumps({"choices": [], "kv_transfer_params": PARAMS}).encode()
            + b"\r\n\r\ndata: [DONE]")
    filt = SSEFilter()
    out = run(filt, data, 4)
    assert filt.params == PARAMS and out == b"data: [DONE]\n\n"
    assert event_boundary(b"a\r\n\r\nb") == 5 and event_boundary(b"abc") == 0


def test_content_mentioning_the_key_is_not_mistaken():
    tricky = ev(chat_chunk('"kv_transfer_params"')) + DONE
    filt = SSEFilter()
    assert run(filt, tricky, 10) == tricky and filt.params is None


def test_collector_rebuilds_chat_message_and_tool_calls():
    c = MessageCollector(chat=True)
    filt = SSEFilter(c)
    calls = [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "lookup", "arguments": '{"q":'}},
        {"index": 0, "function": {"arguments": ' "x"}'}},
    ]
    data = (ev(chat_chunk("Hel")) + ev(chat_chunk("lo"))
            + ev({"choices": [{"index": 0, "delta": {"tool_calls": calls[:1]}}]})
            + ev({"choices": [{"index": 0, "delta": {"tool_calls": calls[1:]}}]})
            + ev({"choices": [{"index": 1, "delta": {"content": "other choice"}}]})
            + ev(chat_chunk(finish="tool_calls")) + DONE)
    run(filt, data, 11)
    assert c.message() == {
        "role": "assistant", "content": "Hello",
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "lookup", "arguments": '{"q": "x"}'}}],
    }


def test_collector_on_whole_responses():
    c = MessageCollector(chat=False)
    c.feed_response({"choices": [{"index": 0, "text": "abc", "finish_reason": "length"}]})
    assert c.text == "abc"
    c = MessageCollector(chat=True)
    c.feed_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}]})
    assert c.message() == {"role": "assistant", "content": "x"}


def test_error_event_shape():
    e = error_event("boom")
    assert e.startswith(b"data: ") and e.endswith(b"\n\n")
    assert json.loads(event_data(e[:-2]))["error"]["message"] == "boom"
