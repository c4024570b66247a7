"""Block digests and the verified prefix (bidirkv/connector/core/digests.py)."""

from types import SimpleNamespace

import pytest

from bidirkv.connector.core.digests import (
    HeldBlocks,
    block_digests,
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
    return HeldBlocks(bs, fingerprint(seed), block_digests(req, tokens, bs))


HELD_TOKENS = list(range(100, 118))  # 18 tokens: 4 full blocks + 2


def check(prompt, held=None, seed=SEED, req=REQ, bs=BS):
    return verify_prefix(held or held_for(HELD_TOKENS), prompt, seed, req, bs)


def test_only_full_blocks_are_digested():
    assert len(block_digests(REQ, HELD_TOKENS, BS)) == 4
    assert block_digests(REQ, HELD_TOKENS, BS, max_blocks=2) == block_digests(
        REQ, HELD_TOKENS, BS)[:2]
    assert block_digests(REQ, [1, 2, 3], BS) == []


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
    forged = HeldBlocks(BS, fingerprint(SEED),
                        block_digests(request_seed(other, None, None), HELD_TOKENS, BS))
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
    assert parse_held(wire, max_blocks=3) is None  # more digests than blocks
    for bad in (None, [], {**wire, "v": 2}, {**wire, "bs": "4"}, {**wire, "bs": True},
                {**wire, "fp": 5}, {**wire, "digests": "x"}, {**wire, "digests": [1]},
                {**wire, "digests": ["ab"]}):
        assert parse_held(bad, max_blocks=10) is None
