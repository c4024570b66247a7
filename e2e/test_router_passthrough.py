"""What vLLM refuses reaches the client through the router unchanged: a history longer
than the model's context gets vLLM's own 400 (real servers, the shared stack)."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    pytest.skip("the vLLM CPU engine stack is not installed (make engine)",
                allow_module_level=True)

from bidirkv.local.model import random_text  # noqa: E402

from .vllm_stack import chat, post, running_router  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def stack(traced):
    return traced[0]  # the shared stack (e2e/conftest.py)


@pytest.mark.parametrize("policy", ["cost", "alwaysDisaggregate"])
def test_a_history_over_the_models_length_gets_vllms_400_unchanged(stack, policy):
    # The stack's model takes 4096 tokens (vllm_stack.spec_for); this history is longer.
    long = [{"role": "user", "content": random_text(6000, seed=977)}]
    with running_router(stack, f"router-{policy}", placement={"policy": policy}) as (url, _):
        for streamed in (False, True):
            body = chat(long, stream=streamed)
            want = post(stack.p_url + "/v1/chat/completions", body)
            assert want[0] == 400 and "maximum context length" in str(want[1]), want
            assert post(url + "/v1/chat/completions", body) == want, streamed
        # The router still serves.
        status, out = post(url + "/v1/chat/completions",
                           chat([{"role": "user", "content": "hello"}], stream=False))
        assert status == 200, out
