"""Chained digests of the tokens a KV cache holds, and the verified reusable prefix.

D publishes with a handle a chain of digests over its full blocks' tokens, taken at a few
block counts (`checkpoints`); P reuses only up to the last checkpoint whose digest agrees
with its own prompt's, so one differing token breaks the chain from there on. vLLM's
prefix-cache hashes cannot serve: their seed is random per process unless
PYTHONHASHSEED is pinned, and P may run with prefix caching off. The chain's seed holds
what else decides a token's KV (model, revision, dtypes, block size, `engine_shaping`,
and per request the LoRA adapter and `cache_salt`), so nothing else ever matches.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# 2: checkpoints of the chain instead of a digest per block.
VERSION = 2
DIGEST_BYTES = 16


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for p in parts:
        h.update(p)
    return h.digest()


def _canon(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def model_seed(model: str, revision: str | None, dtype: str, cache_dtype: str,
               block_size: int, shaping: dict[str, Any] | None = None) -> bytes:
    """What makes two engines' KV for the same tokens interchangeable; `shaping` is the
    rest of the engine's configuration that decides tokens or KV (`engine_shaping`)."""
    return _h(_canon(["bidir-kv/blocks", VERSION, model, revision, dtype, cache_dtype,
                      block_size, shaping or {}]))


def _stable(value: object) -> object:
    # A callable (hf_overrides may be one) prints with its address: name it instead, so
    # two processes with the same code agree.
    if callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    return value


def engine_shaping(model_config: Any, cache_config: Any,
                   operator_fingerprint: str | None) -> dict[str, Any]:
    """What of vLLM's configuration, beyond model_seed's arguments, shapes the tokens a
    prompt becomes or the KV they get, and the operator's fingerprint of what both roles
    share (which also covers what only the API server sees, such as a chat template).
    Read by name: an attribute a vLLM release lacks counts as unset."""
    mc, cc = model_config, cache_config
    names = ("tokenizer", "tokenizer_mode", "tokenizer_revision", "trust_remote_code",
             "code_revision", "quantization", "hf_overrides", "hf_config_path")
    out: dict[str, Any] = {n: _stable(getattr(mc, n, None)) for n in names}
    out["calculate_kv_scales"] = getattr(cc, "calculate_kv_scales", None)
    out["operator"] = operator_fingerprint
    return out


def fingerprint(seed: bytes) -> str:
    """Short public id of a model seed, published so P can say why nothing matched."""
    return _h(b"fp", seed).hex()[:16]


def request_seed(seed: bytes, lora_name: str | None, cache_salt: str | None) -> bytes:
    return _h(seed, _canon([lora_name, cache_salt]))


def _token_bytes(tokens: Sequence[int]) -> bytes:
    arr = array("q", tokens)
    if sys.byteorder == "big":  # the digest must not depend on the host
        arr.byteswap()
    return arr.tobytes()


def chain_at(seed: bytes, tokens: Sequence[int], block_size: int,
             points: Sequence[int]) -> list[bytes]:
    """The chain's digest at each of `points` (block counts, ascending): the digest at
    point p covers the one at the point before and the tokens of the blocks between, so it
    covers every token up to the end of block p. One hash a point, not a block: a history
    of 8,192 blocks costs ~140 hash calls over its bytes, not 8,192."""
    if not points:
        return []
    width = 8 * block_size
    data = memoryview(_token_bytes(tokens[: points[-1] * block_size]))
    out: list[bytes] = []
    prev, start = seed, 0
    for p in points:
        prev = _h(prev, data[start * width:p * width])
        out.append(prev)
        start = p
    return out


# The record carries the chain's digest at a few block counts, not at every block, so its
# size does not grow with the history (agent contexts: 128k tokens are 8,192 blocks of 16;
# one digest a block made a handle of ~300 KB). Which counts is a pure function of the
# number of blocks held (`checkpoints`), so the record names none: at most SPAN evenly
# spaced (an edit anywhere costs at most one span of recompute, 1/SPAN of the history),
# and the counts 1, 2, 4, 8, ... blocks back from the end (an edit near the end, the
# common case, costs at most about its distance from the end). A chained digest that
# matches at block p proves every block up to p, so reuse stays exact. The chain links
# checkpoints, not blocks (`chain_at`): D and P hash each token once and call the hash
# ~140 times at any length, instead of once a block (20 ms at 8,192 blocks, on the
# scheduler's thread, every turn).
SPAN = 128


def checkpoints(n: int) -> list[int]:
    """The block counts (1-based, ascending) at which a record of `n` blocks carries the
    chain's digest: every block when n <= SPAN."""
    if n <= 0:
        return []
    step = -(-n // SPAN)
    points = set(range(step, n + 1, step))
    back = 1
    while back <= n:
        points.add(n - back + 1)
        back *= 2
    return sorted(points)


@dataclass(frozen=True)
class HeldBlocks:
    """What D says its retained blocks hold (the `bidirkv_blocks` record): `blocks` full
    blocks, and the chain's digest at each of `checkpoints(blocks)`, in order."""

    block_size: int
    fingerprint: str
    blocks: int
    digests: tuple[bytes, ...]

    @classmethod
    def of(cls, block_size: int, fingerprint: str, seed: bytes,
           tokens: Sequence[int]) -> HeldBlocks:
        """The record of the full blocks of `tokens` (a partial last block has none)."""
        n = len(tokens) // block_size
        return cls(block_size, fingerprint, n,
                   tuple(chain_at(seed, tokens, block_size, checkpoints(n))))

    def to_wire(self) -> dict:
        return {"v": VERSION, "bs": self.block_size, "fp": self.fingerprint,
                "n": self.blocks, "cp": base64.b64encode(b"".join(self.digests)).decode()}


def parse_held(record: object, max_blocks: int) -> HeldBlocks | None:
    """The record from a handle, or None when it is not exactly what D writes (another
    version, more blocks than the handle's block list, digests not one per checkpoint)."""
    if not isinstance(record, dict) or record.get("v") != VERSION:
        return None
    bs, fp, n, cp = record.get("bs"), record.get("fp"), record.get("n"), record.get("cp")
    if not (isinstance(bs, int) and not isinstance(bs, bool) and 0 < bs <= 1 << 20):
        return None
    if not (isinstance(fp, str) and len(fp) == 16):
        return None
    if not (isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= max_blocks):
        return None
    points = len(checkpoints(n))
    # Checked before decoding: a caller cannot make P decode more than the bound.
    if not (isinstance(cp, str) and len(cp) == 4 * -(-points * DIGEST_BYTES // 3)):
        return None
    try:
        raw = base64.b64decode(cp, validate=True)
    except (ValueError, binascii.Error):
        return None
    if len(raw) != points * DIGEST_BYTES:
        return None
    return HeldBlocks(bs, fp, n, tuple(raw[i:i + DIGEST_BYTES]
                                       for i in range(0, len(raw), DIGEST_BYTES)))


@dataclass(frozen=True)
class Verification:
    blocks: int  # leading blocks P may read
    tokens: int  # blocks * block_size
    comparable_blocks: int  # blocks both sides could have agreed on
    reason: str  # match | prompt_shorter | mismatch | model_mismatch | block_size_mismatch


def verify_prefix(held: HeldBlocks, prompt: Sequence[int], seed: bytes, req_seed: bytes,
                  block_size: int) -> Verification:
    """How many leading blocks of D's KV are valid for `prompt`: up to the last checkpoint
    before the first that differs from P's own chain (or lies past what P may read).

    At least one prompt token is always left to compute: the last position must run
    through the model to produce logits, and a prompt covered to its end by reused
    blocks is a path vLLM handles by rewinding into a block that was just read.
    """
    comparable = min(held.blocks, max(len(prompt) - 1, 0) // held.block_size)
    if held.block_size != block_size:
        return Verification(0, 0, comparable, "block_size_mismatch")
    if held.fingerprint != fingerprint(seed):
        return Verification(0, 0, comparable, "model_mismatch")
    points = checkpoints(held.blocks)
    reachable = [p for p in points if p <= comparable]
    mine = chain_at(req_seed, prompt, block_size, reachable)
    n, reason = 0, "match" if len(reachable) == len(points) else "prompt_shorter"
    for point, theirs, ours in zip(reachable, held.digests, mine, strict=False):
        if not hmac.compare_digest(ours, theirs):
            reason = "mismatch"
            break
        n = point
    return Verification(n, n * block_size, comparable, reason)
