"""Conversation identity: explicit ids, auto-identification from history, tenant scoping."""

from bidirkv.router.request.identity import (
    canonical_message,
    chat_history,
    completion_key,
    explicit_key,
    short_hash,
    tenant_of,
)

A, B = tenant_of("Bearer key-a"), tenant_of("Bearer key-b")


def test_tenants():
    assert A != B
    assert tenant_of(None) == tenant_of("") == b"anonymous"
    assert tenant_of("Bearer key-a") == A


def test_explicit_key_is_scoped_per_tenant():
    assert explicit_key(A, "conv-1") == explicit_key(A, "conv-1")
    assert explicit_key(A, "conv-1") != explicit_key(B, "conv-1")
    assert explicit_key(A, "conv-1") != explicit_key(A, "conv-2")


def test_next_turn_finds_what_the_last_turn_stored():
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assistant = {"role": "assistant", "content": "hello"}
    stored = chat_history(A, turn1).store_key(assistant)
    turn2 = turn1 + [assistant, {"role": "user", "content": "more"}]
    h2 = chat_history(A, turn2)
    assert h2.lookup_key == stored
    # A third turn continues from the second's store key.
    a2 = {"role": "assistant", "content": "more!"}
    turn3 = turn2 + [a2, {"role": "user", "content": "again"}]
    assert chat_history(A, turn3).lookup_key == h2.store_key(a2)


def test_first_turn_has_no_lookup_key():
    assert chat_history(A, [{"role": "user", "content": "hi"}]).lookup_key is None


def test_other_tenant_or_edited_history_misses():
    turn1 = [{"role": "user", "content": "hi"}]
    assistant = {"role": "assistant", "content": "hello"}
    stored = chat_history(A, turn1).store_key(assistant)
    turn2 = turn1 + [assistant, {"role": "user", "content": "more"}]
    assert chat_history(B, turn2).lookup_key != stored
    edited = [{"role": "user", "content": "hi!"}, assistant, {"role": "user", "content": "more"}]
    assert chat_history(A, edited).lookup_key != stored
    changed_reply = turn1 + [{"role": "assistant", "content": "hello."}]
    assert chat_history(A, changed_reply).lookup_key != stored


def test_canonical_form_ignores_what_does_not_reach_the_prompt():
    base = canonical_message({"role": "assistant", "content": "hi"})
    assert canonical_message({"content": "hi", "role": "assistant"}) == base
    assert canonical_message({"role": "assistant", "content": "hi", "reasoning_content": "hmm",
                              "refusal": None}) == base
    assert canonical_message({"role": "assistant",
                              "content": [{"type": "text", "text": "hi"}]}) == base
    assert canonical_message({"role": "assistant", "content": None}) == \
        canonical_message({"role": "assistant", "content": ""})
    assert canonical_message({"role": "user", "content": "hi"}) != base


def test_tool_calls_are_part_of_the_identity():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    m1 = {"role": "assistant", "content": None, "tool_calls": [call]}
    m2 = {"role": "assistant", "content": "", "tool_calls": [{**call, "index": 0}]}
    assert canonical_message(m1) == canonical_message(m2)
    other = {**call, "function": {"name": "f", "arguments": '{"x":1}'}}
    assert canonical_message(m1) != canonical_message({**m1, "tool_calls": [other]})


def test_completion_keys_and_short_hash():
    assert completion_key(A, "abc") != completion_key(B, "abc")
    h = short_hash("my-secret-conversation")
    assert len(h) == 10 and "secret" not in h and h == short_hash("my-secret-conversation")
