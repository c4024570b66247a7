"""Admission of kv_transfer_params (bidirkv/connector/core/handles.py)."""

import json
import time

import pytest

from bidirkv.connector.core import digests
from bidirkv.connector.core.handles import (
    CLOCK_SKEW_S,
    ReplayGuard,
    admit,
    normalized,
    placeholder_ids,
    sign,
    signature_ok,
)
from bidirkv.connector.core.lease import has_placeholder, ids_to_read
from bidirkv.wire import BLOCKS_KEY, COUNTS_KEY, EXPIRES_KEY, MAC_KEY, VERSION, VERSION_KEY

KEY = b"secret"
MAX = 4096


def d_handle(**over):
    h = {
        "do_remote_decode": True, "do_remote_prefill": False,
        "remote_block_ids": [[3, 4, 5]], "remote_engine_id": "eng-d",
        "remote_request_id": "req-1", "remote_host": "10.0.0.2", "remote_port": 5600,
        "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 300,
        "remote_blocks_expiry_time": 1234.5678, "transfer_mode": "pull",
        EXPIRES_KEY: time.time() + 600, VERSION_KEY: VERSION,
    }
    h.update(over)
    h[MAC_KEY] = sign(h, KEY)
    return h


def test_signed_handle_is_admitted_once():
    guard = ReplayGuard(ttl=60)
    h = d_handle()
    a = admit(h, KEY, MAX, guard, now=0)
    assert a.handle and a.problem is None and a.params == h
    again = admit(h, KEY, MAX, guard, now=1)
    assert not again.handle and again.reason == "replayed"
    # Seen signatures are forgotten after the TTL (the blocks are gone by then anyway).
    assert admit(h, KEY, MAX, guard, now=61).handle


def test_direction_flags_are_outside_the_signature():
    h = d_handle()
    h.update(do_remote_decode=False, do_remote_prefill=True)
    assert signature_ok(h, KEY)


def test_the_previous_key_is_accepted_during_a_rotation():
    h = d_handle()  # signed with KEY
    assert signature_ok(h, (b"new-key", KEY))
    assert admit(h, (b"new-key", KEY), MAX).handle
    assert not signature_ok(h, (b"new-key",))


@pytest.mark.parametrize("field, value", [
    ("remote_block_ids", [[3, 4, 6]]), ("remote_engine_id", "eng-x"),
    ("remote_request_id", "req-2"), ("remote_port", 5601), ("remote_num_tokens", 900),
    ("remote_blocks_expiry_time", 99999.0), ("tp_size", 2), ("remote_host", "10.6.6.6"),
    (EXPIRES_KEY, 4e9),
    ("remote_registration_generation", 2),  # vLLM 0.33: added, raised or (below) removed
])
def test_any_change_of_what_is_read_breaks_the_signature(field, value):
    h = d_handle()
    h[field] = value
    a = admit(h, KEY, MAX)
    assert not a.handle and a.reason == "unauthenticated"
    assert not any(k.startswith("remote_") for k in a.params)
    assert a.params["do_remote_prefill"] is False and a.params["do_remote_decode"] is True


def test_handles_without_a_generation_keep_the_earlier_mac_layout():
    """vLLM 0.32's handles sign as before (layout 3), so engines of this release and the
    previous one read each other's handles during a rolling upgrade."""
    from bidirkv.connector.core.handles import _mac_message

    assert _mac_message(d_handle()).startswith(b"[3,")
    assert _mac_message(d_handle(remote_registration_generation=1)).startswith(b"[4,")


def test_a_signed_registration_generation_cannot_be_removed():
    """vLLM 0.33's handles carry the issuer's registration generation; without it a reader
    would keep its agent for a peer that registered its memory anew."""
    h = d_handle(remote_registration_generation=1)
    assert admit(dict(h), KEY, MAX).handle
    del h["remote_registration_generation"]
    assert admit(h, KEY, MAX).reason == "unauthenticated"


def test_wrong_key_and_missing_signature():
    assert admit(d_handle(), b"other", MAX).reason == "unauthenticated"
    h = d_handle()
    del h[MAC_KEY]
    a = admit(h, KEY, MAX)
    assert a.reason == "malformed" and "not signed" in a.problem


@pytest.mark.parametrize("over", [
    {"remote_block_ids": "abc"}, {"remote_block_ids": []}, {"remote_block_ids": [[-1]]},
    {"remote_block_ids": [["1"]]}, {"remote_block_ids": [[True]]},
    {"remote_block_ids": [list(range(MAX + 2))]}, {"remote_block_ids": [[1]] * 17},
    {"remote_engine_id": None}, {"remote_engine_id": 7}, {"remote_request_id": ""},
    {"remote_host": ["h"]}, {"remote_port": "5600"}, {"remote_port": 70000},
    {"remote_num_tokens": "many"}, {"remote_num_tokens": -1}, {"tp_size": 0},
    {"remote_blocks_expiry_time": "soon"}, {"remote_blocks_expiry_time": float("nan")},
    {EXPIRES_KEY: None}, {EXPIRES_KEY: "later"}, {EXPIRES_KEY: float("inf")},
    {"remote_registration_generation": -1}, {"remote_registration_generation": "1"},
])
def test_malformed_handles_are_dropped(over):
    a = admit(d_handle(**over), KEY, MAX)
    assert not a.handle and a.reason == "malformed" and a.problem


def test_missing_keys_are_dropped():
    a = admit({"do_remote_decode": True, "remote_block_ids": [[1, 2]]}, KEY, MAX)
    assert not a.handle and a.params == {"do_remote_decode": True, "do_remote_prefill": False}


def test_plain_and_miss_params_pass_untouched():
    miss = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}
    a = admit(miss, KEY, MAX)
    assert a.params == miss and not a.handle and a.problem is None


def test_internal_keys_and_bad_flags_from_clients_are_removed():
    a = admit({"do_remote_decode": "yes", "_remote_blocks_processed": True,
               "_p_side_truncated": True}, KEY, MAX)
    assert a.params == {"do_remote_decode": False}


def test_replay_guard_is_bounded():
    guard = ReplayGuard(ttl=1000, capacity=3)
    for i in range(10):
        assert guard.first_use(f"m{i}", now=0)
    assert len(guard._seen) <= 3


def test_upstream_tuple_block_ids_sign_like_their_json_form():
    h = normalized({**d_handle(), "remote_block_ids": ([3, 4, 5],)})
    assert h["remote_block_ids"] == [[3, 4, 5]]
    assert signature_ok(h, KEY)


def test_a_handle_past_its_signed_expiry_is_dropped():
    """A leaked handle is worthless once its issuer may have freed the blocks, even where
    the replay guard has forgotten it; a few seconds of clock skew are tolerated."""
    h = d_handle(**{EXPIRES_KEY: 1000.0})
    assert admit(h, KEY, MAX, ReplayGuard(ttl=60), now=0, wall=1000.0 + CLOCK_SKEW_S).handle
    late = admit(h, KEY, MAX, ReplayGuard(ttl=60), now=0, wall=1000.1 + CLOCK_SKEW_S)
    assert not late.handle and late.reason == "expired"
    assert "remote_block_ids" not in late.params and late.params["do_remote_prefill"] is False
    # A later deadline written over the signed one breaks the signature.
    forged = dict(h, **{EXPIRES_KEY: 5000.0})
    assert admit(forged, KEY, MAX, now=0, wall=2000.0).reason == "unauthenticated"


@pytest.mark.parametrize("version", [VERSION + 1, VERSION - 1, None, "1"])
def test_a_handle_on_a_leg_of_another_wire_version_is_dropped(version):
    a = admit(d_handle(**{VERSION_KEY: version}), KEY, MAX, ReplayGuard(ttl=60), now=0)
    assert not a.handle and a.reason == "wire_version"
    assert "wire version" in a.problem and "remote_block_ids" not in a.params


# -- decode's compact handle: counts on the wire, ids with the grant --------------------------
def compact_handle(counts, **over):
    h = d_handle(**over)
    del h["remote_block_ids"], h[MAC_KEY]
    h[COUNTS_KEY] = counts
    h[MAC_KEY] = sign(h, KEY)
    return h


def test_a_compact_handle_is_admitted_and_its_counts_are_signed():
    h = compact_handle([3])
    assert admit(h, KEY, MAX).handle
    forged = dict(h, **{COUNTS_KEY: [2]})
    assert admit(forged, KEY, MAX).reason == "unauthenticated"
    # Ids beside the counts, or neither: not a handle this release issues.
    for bad in (dict(h, remote_block_ids=[[1, 2, 3]]),
                {k: v for k, v in h.items() if k != COUNTS_KEY}):
        assert admit(bad, KEY, MAX).reason == "malformed"
    for counts in ([], [-1], [MAX + 2], ["3"], [True], [1] * 17, 3):
        assert admit(compact_handle(counts), KEY, MAX).reason == "malformed", counts


def test_a_compact_handle_is_read_only_on_a_leg_that_reads():
    """The ids come with the reader's ask right before its read: on a leg that reads
    nothing (both flags false) vLLM would never ask."""
    lent = compact_handle([3], do_remote_decode=False, do_remote_prefill=True)
    assert admit(lent, KEY, MAX).handle  # D reads P's lent blocks
    idle = compact_handle([3], do_remote_decode=False, do_remote_prefill=False)
    a = admit(idle, KEY, MAX)
    assert not a.handle and "do_remote_prefill" in a.problem


def test_decodes_handle_at_8192_blocks_of_16_stays_within_4_kib():
    """128k tokens in blocks of 16: the counts and the digest record, not 8,192 ids."""
    tokens = 8192 * 16
    h = compact_handle([8192], remote_num_tokens=tokens)
    h[BLOCKS_KEY] = digests.HeldBlocks.of(16, digests.fingerprint(b"s"), b"s",
                                          range(tokens)).to_wire()
    h[MAC_KEY] = sign(h, KEY)
    assert admit(h, KEY, tokens).handle
    assert len(json.dumps(h, separators=(",", ":"))) <= 4096


def test_the_ids_read_are_the_grants_cut_to_the_verified_prefix():
    want = placeholder_ids([2, 2])  # narrowed to 2 blocks, two KV groups
    assert ids_to_read(want, [[7, 8, 9], [4, 5, 6]]) == [[7, 8], [4, 5]]
    # A grant that does not cover the read, or another layout: nothing is read.
    assert ids_to_read(want, [[7], [4, 5, 6]]) is None
    assert ids_to_read(want, [[7, 8, 9]]) is None
    assert ids_to_read(want, []) is None
    # A P-issued list (real ids) is read as it is; a placeholder is never left in.
    assert ids_to_read([[1, 2]], [[9, 9]]) == [[1, 2]]
    assert has_placeholder(want) and not has_placeholder([[1, 2], []])
    assert not has_placeholder(ids_to_read(want, [[7, 8], [4, 5]]))


def test_a_shared_read_is_never_a_use_and_asks_by_its_own_name():
    """A child's read of its parent's handle (the router's SHARED_KEY) leaves the blocks
    retained: any number of them, then the parent's own read, are each admitted; the
    shared ones name the request with SHARE_PREFIX, which decode's grant and notification
    tell apart (core/residency.py, nixl/notifs.py)."""
    from bidirkv.wire import SHARE_PREFIX, SHARED_KEY

    guard = ReplayGuard(ttl=60)
    h = d_handle()
    for now in range(3):
        a = admit({**h, SHARED_KEY: True}, KEY, MAX, guard, now=now)
        assert a.handle and a.params["remote_request_id"] == SHARE_PREFIX + "req-1"
        assert SHARED_KEY not in a.params
    own = admit(h, KEY, MAX, guard, now=4)
    assert own.handle and own.params["remote_request_id"] == "req-1"
    assert admit(h, KEY, MAX, guard, now=5).reason == "replayed"
    # Only `true` shares; a forged one is still checked as any handle.
    assert admit({**h, SHARED_KEY: "yes"}, KEY, MAX, guard, now=6).reason == "replayed"
    forged = admit({**h, SHARED_KEY: True, "remote_num_tokens": 299}, KEY, MAX, guard, now=7)
    assert forged.reason == "unauthenticated"
