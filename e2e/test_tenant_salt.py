"""Each tenant's cache_salt in real servers: another tenant's request for a prompt one
tenant sent finds none of it in decode's prefix cache (where retention keeps every
tenant's prompts; this stack's prefill has no prefix cache), while the tenant's own
repeat does (salting costs a tenant nothing of its own reuse)."""

from __future__ import annotations

import importlib.util
import json
import urllib.request

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    pytest.skip("the vLLM CPU engine stack is not installed (make engine)",
                allow_module_level=True)

from bidirkv.local.model import random_text  # noqa: E402

from .vllm_stack import BLOCK, REQUEST_TIMEOUT, chat, metric, metric_reaches, running_router

pytestmark = [pytest.mark.engine, pytest.mark.timeout(420)]

QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"


@pytest.fixture(scope="module")
def stack(traced):
    return traced[0]  # the shared stack (e2e/conftest.py)


def ask(url: str, body: dict, credential: str) -> None:
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json",
                                  "Authorization": f"Bearer {credential}"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
        assert r.status == 200
        json.loads(r.read())


def hits_of(stack, url: str, body: dict, credential: str) -> float:
    """Decode's prefix-cache hits for one request, read once its step's stats came (the
    queries counter moved)."""
    queries, hits = metric(stack.d_url, QUERIES), metric(stack.d_url, HITS)
    ask(url, body, credential)
    metric_reaches(stack.d_url, QUERIES, queries + 1)
    return metric(stack.d_url, HITS) - hits


def test_another_tenant_finds_nothing_of_a_tenants_prompt_cached(stack):
    with running_router(stack, "router-salt",
                        placement={"policy": "alwaysDisaggregate"}) as (url, _):
        body = chat([{"role": "user", "content": random_text(300, seed=901)}],
                    stream=False)
        hits_of(stack, url, body, "tenant-a")  # kept on decode, salted for A
        assert hits_of(stack, url, body, "tenant-b") == 0
        assert hits_of(stack, url, body, "tenant-a") >= BLOCK
