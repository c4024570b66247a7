"""Streamed chat and completion responses end with D's `kv_transfer_params`.

vLLM 0.32 sends them only in non-streamed bodies; from 0.33 its stream response models
declare the field and the finishing chunk carries them, so there nothing is patched (the
router reads them from that chunk either way: bidirkv/router/engine/sse.py).
"""

from __future__ import annotations

import importlib
import logging

from bidirkv.connector.core.streamparams import (
    CHAT_OBJECT,
    COMPLETION_OBJECT,
    wrap_stream_generator,
)
from bidirkv.connector.patches.guarded import wrap
from bidirkv.connector.targets import MARK, PatchSite, Skip, resolve

log = logging.getLogger("vllm.bidirkv")

PARAMS = "kv_transfer_params"
TARGETS = {
    "vllm.entrypoints.openai.chat_completion.serving":
        ("OpenAIServingChat.chat_completion_stream_generator", CHAT_OBJECT),
    "vllm.entrypoints.openai.completion.serving":
        ("OpenAIServingCompletion.completion_stream_generator", COMPLETION_OBJECT),
}
# The stream chunk's model next to each serving module.
MODELS = {
    "vllm.entrypoints.openai.chat_completion.serving":
        ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionStreamResponse"),
    "vllm.entrypoints.openai.completion.serving":
        ("vllm.entrypoints.openai.completion.protocol", "CompletionStreamResponse"),
}


# The generators' signatures are checked by wrap_stream_generator itself.
TARGET_LIST = [PatchSite(module, qualname) for module, (qualname, _) in TARGETS.items()]


def streams_params_itself(module: str) -> bool:
    """True where vLLM's stream chunks carry `kv_transfer_params` (vLLM 0.33 on)."""
    where, name = MODELS[module]
    try:
        model = getattr(importlib.import_module(where), name)
    except (ImportError, AttributeError):
        return False
    return PARAMS in (getattr(model, "model_fields", None) or {})


def install(module: str) -> list[str]:
    qualname, object_ = TARGETS[module]
    _, _, orig = resolve(module, qualname)
    if getattr(orig, MARK, False):
        return []
    if streams_params_itself(module):
        log.info("bidir-kv: vLLM streams kv_transfer_params itself (%s); not patched",
                 qualname.split(".")[0])
        return []
    try:
        wrap_stream_generator(orig, object_)  # signature check before touching anything
    except TypeError as exc:
        raise Skip(str(exc)) from None
    wrap(module, qualname, lambda o: wrap_stream_generator(o, object_))
    return [f"stream-params:{qualname.split('.')[0]}"]
