"""Block digests and the verified prefix (bidirkv/connector/core/digests.py)."""

import base64
import json
from itertools import pairwise
from types import SimpleNamespace

import pytest

from bidirkv.connector.core.digests import (
    DIGEST_BYTES,
    SPAN,
    HeldBlocks,
    chain_at,
    checkpoints,
    engine_shaping,
    fingerprint,
    model_seed,
    parse_held,
    request_seed,
    verify_prefix,
)

BS = 4
SEED = model_seed("tiny", None, "torch.float32", "auto", BS)
REQ = request_seed(SEED, None, None)


def held_for(tokens, seed=SEED, req=REQ, bs=BS):
    return HeldBlocks.of(bs, fingerprint(seed), req, tokens)


HELD_TOKENS = list(range(100, 118))  # 18 tokens: 4 full blocks + 2


def check(prompt, held=None, seed=SEED, req=REQ, bs=BS):
    return verify_prefix(held or held_for(HELD_TOKENS), prompt, seed, req, bs)


def test_only_full_blocks_are_digested():
    assert held_for(HELD_TOKENS).blocks == 4 and len(held_for(HELD_TOKENS).digests) == 4
    assert chain_at(REQ, HELD_TOKENS, BS, [1, 2]) == chain_at(REQ, HELD_TOKENS, BS,
                                                               [1, 2, 3, 4])[:2]
    assert held_for([1, 2, 3]).blocks == 0 and chain_at(REQ, [1, 2, 3], BS, []) == []


def test_a_checkpoint_covers_every_token_before_it():
    # Linking checkpoints, not blocks: the digest at block 4 is one hash over blocks 3-4
    # on top of the one at block 2, and changes with any token before it.
    two, four = chain_at(REQ, HELD_TOKENS, BS, [2, 4])
    assert chain_at(REQ, HELD_TOKENS, BS, [2]) == [two]
    for i in range(16):
        edited = list(HELD_TOKENS)
        edited[i] += 1
        assert chain_at(REQ, edited, BS, [2, 4])[1] != four, i


def test_exact_extension_reuses_every_held_block():
    v = check(HELD_TOKENS + [7, 8, 9])
    assert (v.blocks, v.tokens, v.reason) == (4, 16, "match")


def test_mismatch_in_block_zero_reuses_nothing():
    prompt = list(HELD_TOKENS)
    prompt[1] = 999
    v = check(prompt + [1])
    assert (v.blocks, v.tokens, v.comparable_blocks, v.reason) == (0, 0, 4, "mismatch")


@pytest.mark.parametrize("pos, blocks", [(4, 1), (9, 2), (15, 3)])
def test_mismatch_mid_prefix_keeps_the_blocks_before_it(pos, blocks):
    prompt = list(HELD_TOKENS) + [5, 5, 5]
    prompt[pos] = 999
    v = check(prompt)
    assert (v.blocks, v.reason) == (blocks, "mismatch")


def test_difference_in_the_partial_last_block_does_not_matter():
    prompt = HELD_TOKENS[:16] + [0, 0, 0, 0]  # tokens 16, 17 of D differ: never read
    assert check(prompt).blocks == 4


def test_shorter_prompt_is_capped_and_leaves_a_token_to_compute():
    v = check(HELD_TOKENS[:9])  # 2 full blocks + 1 token
    assert (v.blocks, v.comparable_blocks, v.reason) == (2, 2, "prompt_shorter")
    # A prompt ending exactly on a block boundary keeps its last block to compute.
    v = check(HELD_TOKENS[:8])
    assert (v.blocks, v.reason) == (1, "prompt_shorter")
    assert check([]).blocks == 0


def test_different_model_or_dtype_never_matches():
    other = model_seed("tiny", None, "torch.bfloat16", "auto", BS)
    v = check(HELD_TOKENS + [1], held=held_for(HELD_TOKENS, other, request_seed(other, None,
                                                                                 None)))
    assert (v.blocks, v.reason) == (0, "model_mismatch")
    # Even with a forged fingerprint, the chain itself differs from block 0 on.
    forged = HeldBlocks.of(BS, fingerprint(SEED), request_seed(other, None, None),
                           HELD_TOKENS)
    assert check(HELD_TOKENS + [1], held=forged).blocks == 0
    assert model_seed("tiny-b", None, "torch.float32", "auto", BS) != SEED


def _configs(**model):
    mc = SimpleNamespace(**{"tokenizer": "tiny", "tokenizer_mode": "auto",
                            "trust_remote_code": False, "quantization": None,
                            "hf_overrides": {}, **model})
    return mc, SimpleNamespace(cache_dtype="auto")


def _seed(operator_fp="f" * 16, **model):
    return model_seed("tiny", None, "torch.float32", "auto", BS,
                      engine_shaping(*_configs(**model), operator_fp))


@pytest.mark.parametrize("change", [
    {"tokenizer_mode": "mistral"}, {"tokenizer": "other/tokenizer"},
    {"trust_remote_code": True}, {"quantization": "fp8"},
    {"hf_overrides": {"rope_scaling": {"factor": 4.0}}},
    # The operator's fingerprint: a chat template in engine.extraArgs, which only the API
    # server reads, still changes every digest (two versions of a rollout).
    {"operator_fp": "0" * 16},
])
def test_what_shapes_tokens_or_kv_is_in_the_seed(change):
    mine = _seed()
    assert _seed() == mine  # two processes of one configuration agree
    theirs = _seed(**change)
    assert theirs != mine
    v = check(HELD_TOKENS + [1], held=held_for(HELD_TOKENS, theirs,
                                               request_seed(theirs, None, None)),
              seed=mine, req=request_seed(mine, None, None))
    assert (v.blocks, v.reason) == (0, "model_mismatch")


def test_a_callable_override_seeds_by_name_not_by_address():
    def load():  # one function as two processes load it: two objects, two addresses
        def override(config):
            return config
        return override

    first, second = load(), load()
    assert first is not second and str(first) != str(second)
    assert _seed(hf_overrides=first) == _seed(hf_overrides=second)
    assert _seed(hf_overrides=first) != _seed()


def test_lora_and_cache_salt_separate_tenants():
    salted = request_seed(SEED, None, "tenant-a")
    v = check(HELD_TOKENS + [1], held=held_for(HELD_TOKENS, req=salted))
    assert v.blocks == 0
    assert check(HELD_TOKENS + [1], held=held_for(HELD_TOKENS, req=salted),
                 req=salted).blocks == 4
    assert request_seed(SEED, "adapter", None) != REQ


def test_block_size_mismatch():
    v = check(HELD_TOKENS + [1], bs=8)
    assert (v.blocks, v.reason) == (0, "block_size_mismatch")


def test_wire_record_round_trip_and_rejects():
    held = held_for(HELD_TOKENS)
    assert parse_held(held.to_wire(), max_blocks=10) == held
    wire = held.to_wire()
    assert parse_held(wire, max_blocks=3) is None  # more blocks than the handle lists
    short = base64.b64encode(b"x" * (3 * DIGEST_BYTES)).decode()
    for bad in (None, [], {**wire, "v": 1}, {**wire, "v": 3}, {**wire, "bs": "4"},
                {**wire, "bs": True}, {**wire, "fp": 5}, {**wire, "n": -1},
                {**wire, "n": True}, {**wire, "n": 5}, {**wire, "cp": 7},
                {**wire, "cp": short}, {**wire, "cp": "!" * len(wire["cp"])},
                {"v": 1, "bs": BS, "fp": wire["fp"], "digests": ["ab" * 16] * 4}):
        assert parse_held(bad, max_blocks=10) is None


# -- agent-length histories: 16-token blocks, as GPU engines use ----------------------
GPU_BS = 16
LONG = [(i * 7919) % 50_000 for i in range(8192 * GPU_BS + 5)]  # 8,192 full blocks


@pytest.fixture(scope="module")
def long_held():
    return HeldBlocks.of(GPU_BS, fingerprint(SEED), REQ, LONG)


def test_every_block_is_a_checkpoint_up_to_a_span():
    assert checkpoints(0) == []
    assert checkpoints(SPAN) == list(range(1, SPAN + 1))
    points = checkpoints(8192)
    assert points[-1] == 8192 and points == sorted(set(points))
    assert len(points) <= SPAN + 14  # the spans, then 1, 2, 4, ... back from the end
    assert max(b - a for a, b in pairwise([0, *points])) <= -(-8192 // SPAN)


def test_the_record_of_8192_blocks_stays_within_its_bound(long_held):
    wire = json.dumps(long_held.to_wire())
    assert len(wire) <= 4096
    # One digest a block (the record before) was ~70 times that.
    assert len(wire) * 50 < 8192 * 2 * DIGEST_BYTES


@pytest.mark.parametrize("edit_block", [5000, 1, 8191])
def test_an_edit_reuses_its_unedited_prefix_within_one_span(long_held, edit_block):
    held = long_held
    prompt = list(LONG) + [1, 2, 3]
    prompt[(edit_block - 1) * GPU_BS + 3] = 999_999  # a token of block `edit_block`
    v = verify_prefix(held, prompt, SEED, REQ, GPU_BS)
    span = -(-8192 // SPAN)
    assert v.reason == "mismatch"
    assert edit_block - 1 - span <= v.blocks <= edit_block - 1
    # Close to the end the checkpoints are denser: an edit there costs at most its
    # distance from the end again.
    if 8192 - edit_block < span:
        assert v.blocks >= edit_block - 1 - 2 * (8192 - edit_block + 1)


def test_a_whole_long_history_is_reused(long_held):
    held = long_held
    v = verify_prefix(held, list(LONG) + [1], SEED, REQ, GPU_BS)
    assert (v.blocks, v.reason) == (8192, "match")


def test_a_tampered_checkpoint_is_a_miss_from_there_never_a_wrong_read(long_held):
    held = long_held
    points = checkpoints(8192)
    bad = list(held.digests)
    i = points.index(next(p for p in points if p >= 4000))
    bad[i] = bytes(DIGEST_BYTES)
    v = verify_prefix(HeldBlocks(GPU_BS, held.fingerprint, 8192, tuple(bad)),
                      list(LONG) + [1], SEED, REQ, GPU_BS)
    # Reuse stops before the tampered checkpoint; everything read is proven by the
    # checkpoint before it (a chained digest covers every token up to it).
    assert (v.blocks, v.reason) == (points[i - 1], "mismatch")


def test_a_record_claiming_more_blocks_than_its_handle_lists_is_refused(long_held):
    wire = long_held.to_wire()
    assert parse_held(wire, max_blocks=8191) is None
    assert parse_held(wire, max_blocks=8192) is not None
