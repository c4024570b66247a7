"""One stored decode handle (`Entry`), the outcomes of a lookup, and the sorted index of
stored prompt lengths that prefix lookups walk. Shared by both stores (handles.py,
shared.py)."""

from __future__ import annotations

import bisect

HIT = "hit"
MISS = "miss"
EXPIRED = "expired"


class Entry:
    __slots__ = (
        "key",
        "params",
        "decode_url",
        "engine_id",
        "num_tokens",
        "expires_at",
        "reserved",
        "tenant",
        "prefix_len",
        "request_id",
        "blocks",
        "chars",
        "prompt_key",
        "kept_at",
        "gap",
    )

    def __init__(
        self,
        key: bytes,
        params: bytes,
        decode_url: str,
        engine_id: str | None,
        num_tokens: int,
        expires_at: float,
        tenant: bytes | None,
        prefix_len: int,
        request_id: str | None = None,
        blocks: int = 0,
        chars: int = 0,
        prompt_key: bytes | None = None,
        kept_at: float = 0.0,
        gap: float | None = None,
    ) -> None:
        self.key = key
        self.params = params
        self.decode_url = decode_url
        self.engine_id = engine_id
        self.num_tokens = num_tokens
        self.expires_at = expires_at
        self.reserved = False
        # Set only for prompt-prefix entries (/v1/completions without an id).
        self.tenant = tenant
        self.prefix_len = prefix_len
        # D's own id of the retained request (what it frees on release) and how many
        # blocks it pins there.
        self.request_id = request_id
        self.blocks = blocks
        # Characters of the text whose KV D holds (prompt and answer; 0: unknown): the
        # placement estimates a next turn's new tokens from what it adds.
        self.chars = chars
        # An explicit-id chat turn's prompt: its message count and their keyed hash
        # (LookupKeys.messages_key, as bytes: 4-byte count + digest). The next turn's
        # prompt extends it when its first messages hash the same.
        self.prompt_key = prompt_key
        # When D kept it (Unix seconds; 0: unknown) and the moving average of the
        # conversation's idle times between turns (bidirkv/returns.py; None: no turn came
        # back yet): the next turn's estimate of when it returns, sent to D.
        self.kept_at = kept_at
        self.gap = gap


class Lengths:
    """Sorted distinct prefix lengths of one tenant's completion entries, with counts."""

    __slots__ = ("sorted", "counts")

    def __init__(self) -> None:
        self.sorted: list[int] = []
        self.counts: dict[int, int] = {}

    def add(self, n: int) -> None:
        c = self.counts.get(n, 0)
        if c == 0:
            bisect.insort(self.sorted, n)
        self.counts[n] = c + 1

    def remove(self, n: int) -> None:
        c = self.counts.get(n, 0)
        if c <= 1:
            self.counts.pop(n, None)
            i = bisect.bisect_left(self.sorted, n)
            if i < len(self.sorted) and self.sorted[i] == n:
                del self.sorted[i]
        else:
            self.counts[n] = c - 1

    def up_to(self, n: int) -> list[int]:
        return self.sorted[: bisect.bisect_right(self.sorted, n)]
