"""The router's proof and the residency signature: their bytes are a contract between
router and engine releases, so they are pinned to fixed vectors (computed with
`hmac.new(key, msg, sha256)`), whatever the implementation keeps cached."""

from __future__ import annotations

import re

from bidirkv.proof import make_proof, proof_mac, proof_problem, residency_mac

KEY = b"handle-key"


def test_proof_mac_is_hmac_sha256_over_the_nonce_and_expiry_cut_to_32_hex():
    assert proof_mac(KEY, "00112233445566778899aabb", 1790000000) == \
        "a56eef5fc4168327c2e8890f41e69439"
    # A second key in the same process (a rotation) signs with its own.
    assert proof_mac(b"other", "00112233445566778899aabb", 1790000000) != \
        "a56eef5fc4168327c2e8890f41e69439"
    assert proof_mac(KEY, "00112233445566778899aabb", 1790000000) == \
        "a56eef5fc4168327c2e8890f41e69439"


def test_residency_mac_is_pinned():
    assert residency_mac(KEY, "post", "/bidirkv/residency", 1790000000,
                         b'{"owner":"router-1"}') == (
        "26b55c2b7c5682e6574418c811cc015b892803d69193a56f5bc1989ad13a03c5")


def test_a_fresh_proof_has_a_24_hex_nonce_and_checks_under_its_key_only():
    proof = make_proof(KEY, now=1_000.0)
    nonce, expires, mac = proof.split(".")
    assert re.fullmatch(r"[0-9a-f]{24}", nonce)
    assert expires == "1120"
    assert mac == proof_mac(KEY, nonce, 1120)
    assert proof_problem(proof, [b"other", KEY], now=1_000.0) is None
    assert proof_problem(proof, [b"other"], now=1_000.0) == "router proof does not match"
