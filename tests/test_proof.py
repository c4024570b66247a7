"""The router's proof and the residency signature: their bytes are a contract between
router and engine releases, so they are pinned to fixed vectors (computed with
`hmac.new(key, msg, sha256)`), whatever the implementation keeps cached."""

from __future__ import annotations

import re

from bidirkv.proof import (
    make_proof,
    proof_mac,
    proof_problem,
    residency_mac,
    residency_target,
    sign_residency,
)

KEY = b"handle-key"


def test_proof_mac_is_hmac_sha256_over_the_nonce_and_expiry_cut_to_32_hex():
    assert proof_mac(KEY, "00112233445566778899aabb", 1790000000) == \
        "a56eef5fc4168327c2e8890f41e69439"
    # A second key in the same process (a rotation) signs with its own.
    assert proof_mac(b"other", "00112233445566778899aabb", 1790000000) != \
        "a56eef5fc4168327c2e8890f41e69439"
    assert proof_mac(KEY, "00112233445566778899aabb", 1790000000) == \
        "a56eef5fc4168327c2e8890f41e69439"


BODY = b'{"owner":"router-1"}'
DIGEST = "f18774d0b606e621a9d92ec96d3be0b028ce72cc15eaf53101f7ed5b9d1bf3e7"  # sha256(BODY)
MAC = "91bea22926063b470a5cf628680e16327b4d18b80c3657fa8ac8ed1d60f4fb5e"


def test_residency_mac_is_pinned():
    """HMAC-SHA256 over bidirkv-residency/2|POST|<path>|<target>|<seconds>|<length>|<sha256>."""
    assert residency_mac(KEY, "post", "/bidirkv/residency", "decode-0.decode.ns.svc:8000",
                         1790000000, len(BODY), DIGEST) == MAC
    assert sign_residency(KEY, "decode-0.decode.ns.svc:8000", "/bidirkv/residency", BODY,
                          now=1790000000.5) == f"1790000000.20.{DIGEST}.{MAC}"


def test_a_residency_target_is_the_host_and_port_called():
    assert residency_target("http://Decode-0.decode.ns.svc:8000") == \
        "decode-0.decode.ns.svc:8000"
    assert residency_target("http://127.0.0.1:8101/bidirkv/residency") == "127.0.0.1:8101"
    assert residency_target("http://[FD00::5]:8000") == "[fd00::5]:8000"
    assert residency_target("http://decode-0") == "decode-0:80"
    assert residency_target("https://decode-0") == "decode-0:443"


def test_a_fresh_proof_has_a_24_hex_nonce_and_checks_under_its_key_only():
    proof = make_proof(KEY, now=1_000.0)
    nonce, expires, mac = proof.split(".")
    assert re.fullmatch(r"[0-9a-f]{24}", nonce)
    assert expires == "1120"
    assert mac == proof_mac(KEY, nonce, 1120)
    assert proof_problem(proof, [b"other", KEY], now=1_000.0) is None
    assert proof_problem(proof, [b"other"], now=1_000.0) == "router proof does not match"
