"""Streamed chat and completion responses end with D's `kv_transfer_params`."""

from __future__ import annotations

from bidirkv.connector.core.streamparams import (
    CHAT_OBJECT,
    COMPLETION_OBJECT,
    wrap_stream_generator,
)
from bidirkv.connector.patches.guarded import wrap
from bidirkv.connector.targets import MARK, Skip, Target, resolve

TARGETS = {
    "vllm.entrypoints.openai.chat_completion.serving":
        ("OpenAIServingChat.chat_completion_stream_generator", CHAT_OBJECT),
    "vllm.entrypoints.openai.completion.serving":
        ("OpenAIServingCompletion.completion_stream_generator", COMPLETION_OBJECT),
}


# The generators' signatures are checked by wrap_stream_generator itself.
TARGET_LIST = [Target(module, qualname) for module, (qualname, _) in TARGETS.items()]


def install(module: str) -> list[str]:
    qualname, object_ = TARGETS[module]
    _, _, orig = resolve(module, qualname)
    if getattr(orig, MARK, False):
        return []
    try:
        wrap_stream_generator(orig, object_)  # signature check before touching anything
    except TypeError as exc:
        raise Skip(str(exc)) from None
    wrap(module, qualname, lambda o: wrap_stream_generator(o, object_))
    return [f"stream-params:{qualname.split('.')[0]}"]
