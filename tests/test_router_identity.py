"""Conversation identity: explicit ids, auto-identification from history, tenant scoping,
each tenant's cache salt, and who names a tenant."""

import hashlib
import tracemalloc

from bidirkv.router.request.identity import (
    ANONYMOUS,
    SALT_HEX_LEN,
    LookupKeys,
    Tenants,
    accounting_tenant,
    canonical_message,
    chat_history,
    completion_key,
    explicit_key,
    isolation_tenant,
    tenant_of,
)
from bidirkv.wire import TENANT_LABEL_LEN

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


def test_an_explicit_ids_message_keys_come_from_one_pass_and_keep_their_bytes():
    # Stored as Entry.prompt_key and compared across replicas and releases: pinned.
    keys = LookupKeys(b"handle-key")
    a = keys.tenant_of("Bearer key-a")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "text", "text": "more"}]}]
    assert keys.messages_key(a, msgs, 2).hex() == "3cb46e051888dc9cf1db532a3ae124e5"
    assert keys.messages_key(a, msgs, 3).hex() == "04eb2c520ff87df59bfcbfe33d64d4d2"
    for n in (0, 2, 3, 5):
        assert keys.messages_keys(a, msgs, n) == (keys.messages_key(a, msgs, n),
                                                  keys.messages_key(a, msgs, 3))
    assert keys.messages_key(B, msgs, 2) != keys.messages_key(a, msgs, 2)


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


def test_completion_keys_are_scoped_per_tenant():
    assert completion_key(A, "abc") != completion_key(B, "abc")


def test_the_conversation_label_is_keyed_and_per_tenant():
    """Logs and spans: an id guessed by anyone without the handle key cannot be tested
    against the label (an unkeyed hash could), and one id of two tenants reads as two."""
    keys = LookupKeys(b"k" * 32)
    label = keys.conversation_label(A, "conv-1")
    assert len(label) == 10 and label == keys.conversation_label(A, "conv-1")
    assert label != keys.conversation_label(B, "conv-1")
    assert label != LookupKeys(b"j" * 32).conversation_label(A, "conv-1")
    assert label != hashlib.sha256(b"conv-1").hexdigest()[:10]
    # Every replica holding the handle key logs one conversation alike.
    assert LookupKeys(b"k" * 32).conversation_label(A, "conv-1") == label


def test_each_tenant_has_its_own_cache_salt_stable_turn_to_turn():
    keys = LookupKeys(b"k" * 32)
    salt = keys.cache_salt(A)
    assert len(salt) == SALT_HEX_LEN and int(salt, 16) >= 0
    assert keys.cache_salt(A) == salt == LookupKeys(b"k" * 32).cache_salt(A)
    assert keys.cache_salt(B) != salt and keys.cache_salt(ANONYMOUS) != salt
    # Keyed: without the handle key nobody computes another tenant's salt.
    assert LookupKeys(b"j" * 32).cache_salt(A) != salt
    # A client's salt splits its own tenant's cache, never reaches another's.
    assert keys.cache_salt(A, "mine") not in (salt, keys.cache_salt(B, "mine"))
    assert keys.cache_salt(A, "mine") == keys.cache_salt(A, "mine")
    # The same values as every earlier router: replicas mid-rollout share the prefix cache.
    assert keys.cache_salt(b"t" * 16) == "11ae9d0cbc4f4990f5fc12bbbe140368"
    assert keys.cache_salt(b"t" * 16, "mine") == "fa2ea34adcea84d72224dd4cf2cdbdf0"


def test_a_clients_salts_are_never_kept():
    """However many distinct salts, and however long, the keys keep nothing of them (an
    lru_cache keyed by the salt kept each one whole: 20 of 200 kB each kept 4 MB)."""
    keys = LookupKeys(b"k" * 32)
    keys.cache_salt(A, "warm")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        salts = {keys.cache_salt(A, f"{i}:" + "s" * 200_000) for i in range(20)}
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(salts) == 20
    assert kept < 200_000, kept


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tenant(tenants, value, source="10.0.0.1", cap=2, trusted=None, headers=None):
    h = headers if headers is not None else {"Authorization": value} if value else {}
    return tenants.of(h, source, "Authorization", trusted, cap, 60.0)


def test_one_source_names_at_most_its_cap_of_tenants(caplog):
    """A client rotating credentials is pooled past the cap: the bounds count its new
    tenants as one, while each keeps its own keys and salt."""
    keys, clock = LookupKeys(b"k" * 32), Clock()
    tenants = Tenants(keys, clock)
    a, b = tenant(tenants, "a"), tenant(tenants, "b")
    assert (a, b) == (keys.tenant_of("a"), keys.tenant_of("b"))
    assert "maxTenantsPerSource" not in caplog.text
    c, d = tenant(tenants, "c"), tenant(tenants, "d")
    # Said once, not per request: behind a proxy it would be every request.
    assert caplog.text.count("maxTenantsPerSource") == 1 and "10.0.0.1" in caplog.text
    assert c != keys.tenant_of("c") and d != c
    assert accounting_tenant(c) == accounting_tenant(d)  # one tenant for the bounds
    assert accounting_tenant(c) not in (a, b)
    assert isolation_tenant(c) == keys.tenant_of("c")  # its own keys, its own salt
    assert keys.explicit_key(c, "x") == keys.explicit_key(keys.tenant_of("c"), "x")
    assert keys.cache_salt(c) != keys.cache_salt(d)
    # Decode's label is the group's: decode's eviction pools them too.
    assert c.hex()[:TENANT_LABEL_LEN] == d.hex()[:TENANT_LABEL_LEN]
    # Known tenants stay themselves; another source has its own cap.
    assert tenant(tenants, "a") == a and tenant(tenants, "b") == b
    assert tenant(tenants, "c", source="10.0.0.2") == keys.tenant_of("c")
    # The anonymous tenant is one whatever the source.
    assert tenant(tenants, None) == ANONYMOUS
    # A tenant unseen for the idle time frees its place.
    clock.now = 30.0
    tenant(tenants, "a")
    clock.now = 70.0
    assert tenant(tenants, "c") == keys.tenant_of("c")
    assert tenant(tenants, "d") != keys.tenant_of("d")  # "a" was seen at 30


def test_no_cap_and_the_trusted_header():
    keys = LookupKeys(b"k" * 32)
    tenants = Tenants(keys)
    names = [tenant(tenants, str(i), cap=None) for i in range(10)]
    assert names == [keys.tenant_of(str(i)) for i in range(10)]
    # With a trusted header only it names the tenant: the credential and the source's cap
    # play no part, and a request without it is the anonymous tenant.
    trusted = [tenants.of({"Authorization": str(i), "X-Tenant": "acme"}, "10.0.0.9",
                          "Authorization", "X-Tenant", 1, 60.0) for i in range(5)]
    assert trusted == [keys.tenant_of("acme")] * 5
    assert tenants.of({"Authorization": "x"}, "10.0.0.9", "Authorization", "X-Tenant", 1,
                      60.0) == ANONYMOUS


def test_what_the_tenants_remember_is_bounded():
    keys = LookupKeys(b"k" * 32)
    tenants = Tenants(keys, max_tracked=10)
    for i in range(100):
        assert tenant(tenants, f"t{i}", source=f"10.0.{i}.1") == keys.tenant_of(f"t{i}")
    assert len(tenants._sources) <= 10
