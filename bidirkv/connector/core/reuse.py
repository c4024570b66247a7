"""P's side of a reuse turn: how much of D's KV to read, and the report the router counts.

Upstream P reads `min(remote_num_tokens, prompt)` tokens of D's blocks on trust. Here the
handle is first narrowed to the leading blocks whose digests match P's own prompt
(`digests.verify_prefix`); the rest is recomputed. Narrowing also fixes a shorter
prompt: P's worker pairs its new blocks with the *last* remote blocks of the list, which
is only right when the list ends where the read ends.

The report, returned in P's `kv_transfer_params["bidirkv"]`:
    reused_tokens    tokens P read from D instead of computing them
    offered_tokens   tokens of D's KV this prompt could use: D's full blocks, up to the
                     prompt's last token (a partial last block is never read), so a
                     complete reuse reads reused == offered; if the handle could not be
                     checked, D's whole `remote_num_tokens`
    verified         the handle's digests were compared with the prompt
    held_tokens      D's `remote_num_tokens`
    verified_tokens  length of the matching prefix
    local_cached_tokens, recomputed_tokens, reason
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bidirkv.connector.core.digests import parse_held, verify_prefix
from bidirkv.connector.core.handles import Admission, block_counts, placeholder_ids
from bidirkv.wire import BLOCKS_KEY, COUNTS_KEY


@dataclass
class Report:
    offered_tokens: int
    held_tokens: int = 0
    verified: bool = False
    verified_tokens: int = 0
    reused_tokens: int = 0
    local_cached_tokens: int = 0
    recomputed_tokens: int | None = None
    reason: str = "no_handle"

    def wire(self) -> dict[str, Any]:
        out = asdict(self)
        if out["recomputed_tokens"] is None:
            del out["recomputed_tokens"]
        return out


def offered_tokens(raw: dict[str, Any]) -> int:
    n = raw.get("remote_num_tokens")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else 0


def plan(adm: Admission, offered: int, prompt: Sequence[int] | None, seed: bytes,
         req_seed: bytes, block_size: int, layout_ok: bool) -> Report:
    """Narrow the admitted handle in `adm.params` (in place) to the verified prefix.

    A handle that fails verification keeps its block list but offers 0 tokens: P reads
    nothing and still notifies D, which frees the blocks instead of pinning them for
    the whole TTL.
    """
    if not adm.handle:
        return Report(offered, offered, reason=adm.reason or "no_handle")
    params = adm.params
    counts = block_counts(params)
    held = parse_held(params.get(BLOCKS_KEY), max(counts))

    def refuse(reason: str) -> Report:
        params["remote_num_tokens"] = 0
        _narrow(params, counts)
        return Report(offered, offered, reason=reason)

    if prompt is None:
        return refuse("unsupported_prompt")  # embeddings or multimodal input
    if not layout_ok:
        return refuse("unsupported_layout")
    if held is None:
        return refuse("no_digest")
    if held.blocks * held.block_size > offered or any(n < held.blocks for n in counts):
        return refuse("inconsistent_handle")
    v = verify_prefix(held, prompt, seed, req_seed, block_size)
    _narrow(params, [v.blocks] * len(counts) if v.blocks else counts)
    params["remote_num_tokens"] = v.tokens
    return Report(v.comparable_blocks * held.block_size, offered, verified=True,
                  verified_tokens=v.tokens, reason=v.reason)


def _narrow(params: dict[str, Any], counts: list[int]) -> None:
    """The handle's block list cut to `counts` per group: vLLM's ids (a P-issued list),
    or placeholders for a compact one's, whose ids come with decode's grant."""
    ids = params.get("remote_block_ids")
    if params.get(COUNTS_KEY) is None and ids is not None:
        params["remote_block_ids"] = [list(g[:n]) for g, n in zip(ids, counts, strict=True)]
    else:
        params["remote_block_ids"] = placeholder_ids(counts)


def record_match(report: Report, pulled: int, local_cached: int, prompt_len: int) -> None:
    """What the scheduler decided, given the verified prefix (last call wins)."""
    report.reused_tokens = max(pulled, 0)
    report.local_cached_tokens = local_cached
    report.recomputed_tokens = max(prompt_len - local_cached - report.reused_tokens, 0)
    if report.verified and report.verified_tokens and not pulled:
        # vLLM only reads when at least kv_recompute_threshold tokens are new.
        report.reason = "local_cache" if local_cached >= report.verified_tokens else (
            "below_threshold"
        )


def record_load_failure(report: Report, prompt_len: int) -> None:
    report.reused_tokens = 0
    report.recomputed_tokens = max(prompt_len - report.local_cached_tokens, 0)
    report.reason = "load_failed"
