"""Run the benchmark against a router: N conversations x T turns, one request at a time.

One request at a time: the engines' and the router's counters (and decode's residency
report) are scraped around each request, so their deltas belong to it. A concurrent
client would measure queueing on a 2-core machine, not KV reuse. Without think time the
order is turn t of every conversation, then turn t+1; with it (turns.py) each
conversation comes back its think time after its answer, and the one due first goes next.
Every turn records the gap since its conversation's previous answer and why it reused or
not (turns.py).

Lower bound (optional, `lower_bound_url`): before a conversation's turn is sent through
the router, the same prompt goes straight to a server whose local prefix cache already
holds the conversation's history (on the local stack: the decode server of the OFF run,
prefix caching on, which decoded the previous turns). It computes only the new tokens and
does neither a second leg nor a KV transfer: the TTFT a prefill with a warm cache gets.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from bidirkv.bench import promtext
from bidirkv.bench.client import Reply, chat, first_model, post_json
from bidirkv.bench.conversation import (
    Appends,
    Conversation,
    chat_body,
    user_text,
    with_conversation_id,
)
from bidirkv.bench.turns import Think, refusals_delta
from bidirkv.bench.turns import reason as turn_reason
from bidirkv.proof import residency_headers, residency_target
from bidirkv.wire import RESIDENCY_PATH, RESIDENCY_VERSION_FIELD, VERSION

# The router's reuse outcomes (bidirkv/router/metrics.py; a client of any router, so not
# imported from it, and held equal by tests/test_bench_stats.py). "extended" first: such
# a turn was looked up as a hit, then ran on decode.
REUSE_OUTCOMES = ("extended", "hit", "miss", "expired", "verified-partial", "dropped", "off")
# What a reused turn reused (bidirkv_router_reuse_kind_total{kind}): its own history, its
# parent's (named by a parent header), a parent's found by its history (a fork), or a
# prefix. A router without that counter leaves these None.
REUSE_KINDS = ("returning", "child", "fork", "prefix")
# The router's answer names where a turn ran when `placementHeader` is on.
PLACEMENT_HEADER = "X-Bidirkv-Placement"

ROUTER_METRICS: dict[str, tuple[str, dict[str, str]]] = {
    "prefill_s": ("bidirkv_router_leg_duration_seconds_sum", {"leg": "prefill"}),
    "reused_tokens": ("bidirkv_router_reuse_tokens_total", {}),
    "offered_tokens": ("bidirkv_router_reuse_tokens_offered_total", {}),
    **{f"reuse_{o}": ("bidirkv_router_reuse_total", {"outcome": o}) for o in REUSE_OUTCOMES},
    **{f"reuse_kind_{k}": ("bidirkv_router_reuse_kind_total", {"kind": k}) for k in REUSE_KINDS},
}
# On P, NIXL reads are D -> P: the reuse transfer. (P -> D reads are counted on D.)
PREFILL_METRICS: dict[str, tuple[str, dict[str, str]]] = {
    "p_transfer_s": ("vllm:nixl_xfer_time_seconds_sum", {}),
    "p_transfers": ("vllm:nixl_xfer_time_seconds_count", {}),
    "p_transfer_bytes": ("vllm:nixl_bytes_transferred_sum", {}),
    "p_failed_transfers": ("vllm:nixl_num_failed_transfers_total", {}),
    "p_external_hit_tokens": ("vllm:external_prefix_cache_hits_total", {}),
    "p_compute_s": ("vllm:request_prefill_time_seconds_sum", {}),
    "p_computed_tokens": ("vllm:request_prefill_kv_computed_tokens_sum", {}),
}
DECODE_METRICS: dict[str, tuple[str, dict[str, str]]] = {
    "d_transfer_s": ("vllm:nixl_xfer_time_seconds_sum", {}),
    "d_transfer_bytes": ("vllm:nixl_bytes_transferred_sum", {}),
}


@dataclass(frozen=True)
class BenchConfig:
    url: str
    label: str = "run"
    model: str | None = None
    conversations: int = 2
    turns: int = 10
    new_tokens: int = 1000
    output_tokens: int = 48
    warmup_turns: int = 2
    settle_s: float = 1.0
    stream: bool = True
    id_mode: str = "body"
    prefill_metrics: str | None = None  # P's /metrics (local stack, port-forward, ...)
    decode_metrics: str | None = None
    lower_bound_url: str | None = None
    decode_residency: str | None = None  # D's /bidirkv/residency: refusals by reason
    # The resource's handle key, which decode asks of every residency call (a local stack's
    # is fresh per stack); None: BIDIRKV_HANDLE_KEY from the environment, if any.
    handle_key: bytes | None = field(default=None, repr=False)
    think: Think = field(default_factory=Think)
    # Variable appends (an agent's trace) instead of new_tokens every turn.
    appends: Appends | None = None
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "new_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        if self.warmup_turns < 0 or self.settle_s < 0:
            raise ValueError("warmup turns and settle time must be >= 0")


@dataclass
class TurnRecord:
    label: str
    conversation: int
    turn: int  # 1-based
    context_tokens: int | None
    output_tokens: int | None
    ttft_s: float
    total_s: float
    text_sha: str
    text: str
    lower_bound_s: float | None = None
    reuse: str | None = None  # the router's reuse outcome for this request
    metrics: dict[str, float | None] = field(default_factory=dict)
    gap_s: float | None = None  # since this conversation's previous answer
    think_s: float = 0.0  # the think time the schedule gave this turn
    reason: str | None = None  # why it reused or not (turns.REASONS)
    refusals: dict[str, int] = field(default_factory=dict)  # D's, during this request
    placement: str | None = None  # the router's placement header, when it sends one

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def request_pending(before: Any, after: Any) -> bool:
    """True while the router's request counter has not grown since `before` (a router
    without that counter, or no scrape, is never waited for)."""
    if before is None or after is None:
        return False
    was = promtext.total(before, "bidirkv_router_requests_total")
    now = promtext.total(after, "bidirkv_router_requests_total")
    if now is None:
        return False
    return now <= (was or 0)


def reuse_outcome(m: dict[str, float | None]) -> str | None:
    for o in REUSE_OUTCOMES:
        if (m.get(f"reuse_{o}") or 0) > 0:
            return o
    return None


def reuse_kind(m: dict[str, float | None]) -> str | None:
    """What the request reused, by the router's count (REUSE_KINDS); None: nothing counted."""
    return next((k for k in REUSE_KINDS if (m.get(f"reuse_kind_{k}") or 0) > 0), None)


class Runner:
    def __init__(self, cfg: BenchConfig, progress: bool = True,
                 log: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.progress = progress
        self.log = log or (lambda _msg: None)
        self.model = cfg.model
        # 1-minute load averages around the run: other work on the machine shows here.
        self.loadavg: dict[str, float] = {}
        self._answered: dict[int, float] = {}  # conversation -> when its last answer came

    def _residency(self) -> dict[str, Any] | None:
        # An empty body only reads the report: no lease, no release. Decode answers only
        # holders of the handle key; without it the report, and the refusals by reason,
        # are left out.
        key = self.cfg.handle_key or os.environ.get("BIDIRKV_HANDLE_KEY", "").strip().encode()
        url = self.cfg.decode_residency
        sign = (lambda raw: residency_headers(key, residency_target(url or ""), RESIDENCY_PATH,
                                               raw)
                ) if key else None
        return post_json(self.cfg.decode_residency, {RESIDENCY_VERSION_FIELD: VERSION},
                         sign=sign)

    def _scrape(self) -> tuple[Any, Any, Any]:
        c = self.cfg
        return (promtext.scrape(c.url.rstrip("/") + "/metrics"),
                promtext.scrape(c.prefill_metrics), promtext.scrape(c.decode_metrics))

    def _scrape_after(self, before: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        """The scrape once the router has counted the request: it counts a request's
        outcome (and its reuse) when the handler ends, which can be just after the client
        read the last byte. A router that counts nothing gives up after 2 s."""
        after = self._scrape()
        for _ in range(40):
            if not request_pending(before[0], after[0]):
                break
            time.sleep(0.05)
            after = self._scrape()
        return after

    def _send(self, conv: Conversation, url: str, body: dict[str, Any], headers: dict[str, str]
              ) -> Reply:
        return chat(url, body, headers, timeout=self.cfg.timeout_s)

    def _lower_bound(self, conv: Conversation) -> float:
        # Straight to the server, no conversation id: a plain request with a local prefix hit.
        body = chat_body(self.model or "", conv.messages, 1, self.cfg.stream)
        assert self.cfg.lower_bound_url is not None
        return self._send(conv, self.cfg.lower_bound_url, body, {}).ttft_s

    def turn(self, conv: Conversation, turn: int, measure: bool, think_s: float = 0.0,
             words: int | None = None, text: str | None = None,
             headers: dict[str, str] | None = None) -> TurnRecord:
        """One turn of `conv`; `words`: this turn's user words instead of the config's (a
        caller that schedules its own turns, such as the long-context phase); `text`: the
        user message itself (a replayed trace); `headers`: more request headers for the
        router (an agent's session and parent ids), none for the lower bound."""
        c = self.cfg
        if text is None:
            if words is None:
                words = (c.appends.words(c.seed, conv.index, turn) if c.appends is not None
                         else c.new_tokens)
            elif words < 1:
                raise ValueError(f"words {words}: a turn adds at least 1 word")
            text = user_text(c.seed, conv.index, turn, words)
        conv.ask(text)
        lb = self._lower_bound(conv) if (measure and c.lower_bound_url) else None
        body, id_headers = with_conversation_id(
            chat_body(self.model or "", conv.messages, c.output_tokens, c.stream), conv.cid,
            c.id_mode)
        headers = {**id_headers, **(headers or {})}
        if measure and c.settle_s:
            time.sleep(c.settle_s)
        before = self._scrape() if measure else (None, None, None)
        res_before = self._residency() if measure else None
        last = self._answered.get(conv.index)
        gap = time.monotonic() - last if last is not None else None
        reply = self._send(conv, c.url, body, headers)
        self._answered[conv.index] = time.monotonic()
        after = self._scrape_after(before) if measure else (None, None, None)
        refused = refusals_delta(res_before, self._residency()) if measure else {}
        conv.answer(reply.text)
        m: dict[str, float | None] = {}
        m.update(promtext.deltas(before[0], after[0], ROUTER_METRICS))
        m.update(promtext.deltas(before[1], after[1], PREFILL_METRICS))
        m.update(promtext.deltas(before[2], after[2], DECODE_METRICS))
        outcome = reuse_outcome(m)
        reused = m.get("p_external_hit_tokens")
        if reused is None:
            reused = m.get("reused_tokens")
        return TurnRecord(
            label=c.label, conversation=conv.index, turn=turn,
            context_tokens=reply.prompt_tokens, output_tokens=reply.completion_tokens,
            ttft_s=reply.ttft_s, total_s=reply.total_s,
            text_sha=hashlib.sha256(reply.text.encode()).hexdigest()[:16], text=reply.text,
            lower_bound_s=lb, reuse=outcome, metrics=m, gap_s=gap, think_s=think_s,
            reason=turn_reason(turn, outcome, reused, refused), refusals=refused,
            placement=reply.headers.get(PLACEMENT_HEADER.lower()),
        )

    def warm_up(self, run_id: str, words: int | None = None) -> None:
        """The config's warm-up turns, in a conversation of their own: first-request costs
        and the NIXL handshakes in both directions (P->D on turn 1, D->P on turn 2) happen
        here, not in turn 1. `words`: each warm-up turn's user words (default: as a turn's)."""
        from tqdm import tqdm

        c = self.cfg
        if not c.warmup_turns:
            return
        if self.model is None:
            self.model = first_model(c.url)
        warm = Conversation(-1, f"{run_id}-warmup")
        bar = tqdm(range(1, c.warmup_turns + 1), desc=f"bench {c.label}: warm-up",
                   unit="turn", disable=not self.progress, leave=False)
        for t in bar:
            self.turn(warm, t, measure=False, words=words)
        if c.lower_bound_url:
            self._lower_bound(warm)

    def run(self) -> list[TurnRecord]:
        from tqdm import tqdm

        c = self.cfg
        self.loadavg["start"] = os.getloadavg()[0]
        if self.model is None:
            self.model = first_model(c.url)
        run_id = f"{c.label}-{c.seed}-{int(time.time())}"
        self.warm_up(run_id)
        convs = [Conversation(i, f"{run_id}-c{i}") for i in range(c.conversations)]
        records: list[TurnRecord] = []
        bar = tqdm(total=c.turns * c.conversations, desc=f"bench {c.label}", unit="turn",
                   disable=not self.progress)
        due = {conv.index: (0.0, 0.0) for conv in convs}  # (monotonic time, think time)
        try:
            while due:
                # The conversation due first; ties by index (no think time: round-robin).
                conv = min((cv for cv in convs if cv.index in due),
                           key=lambda cv: (due[cv.index][0], cv.index))
                at, think = due.pop(conv.index)
                if (wait := at - time.monotonic()) > 0:
                    bar.set_postfix_str(f"conversation {conv.index} thinks {wait:.0f} s")
                    time.sleep(wait)
                t = conv.turns_done + 1
                rec = self.turn(conv, t, measure=True, think_s=think)
                records.append(rec)
                bar.set_postfix_str(f"turn {t} ctx {rec.context_tokens} "
                                    f"ttft {rec.ttft_s * 1000:.0f} ms {rec.reason}")
                bar.update(1)
                if t < c.turns:
                    nxt = c.think.before(c.seed, conv.index, t + 1)
                    due[conv.index] = (time.monotonic() + nxt, nxt)
        finally:
            bar.close()
            self.loadavg["end"] = os.getloadavg()[0]
        return records
