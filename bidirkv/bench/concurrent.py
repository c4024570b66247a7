"""The concurrent benchmark: a pool of conversations, N requests in flight, think time.

Where the sequential runner (runner.py) isolates one request to measure KV reuse, this
one loads the cluster the way agents do: more conversations than decode can keep, each
coming back after its user "thinks", several at once. It answers the questions the
sequential run cannot: does retained KV make new work wait, and does reuse still pay
when the cluster is busy? Per request it records when it started, its TTFT and whether
it failed; the router's counters around the whole run give the reuse hits.

The schedule is deterministic for a seed: conversation i starts after i * stagger
seconds, then each turn is sent `think` seconds after the previous answer, by the first
of N workers that is free. Turns of one conversation never overlap.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from bidirkv.bench import promtext
from bidirkv.bench.client import RequestFailed, chat, first_model
from bidirkv.bench.conversation import Conversation, chat_body, user_text, with_conversation_id

ROUTER_COUNTERS = {
    f"reuse_{o}": ("bidirkv_router_reuse_total", {"outcome": o})
    # extended: run whole on the decode replica holding their KV (placement), reused there
    for o in ("hit", "miss", "expired", "verified-partial", "dropped", "extended")
} | {"reused_tokens": ("bidirkv_router_reuse_tokens_total", {})}


@dataclass(frozen=True)
class ConcurrentConfig:
    url: str
    label: str = "run"
    model: str | None = None
    conversations: int = 12  # the pool
    turns: int = 4
    concurrency: int = 4  # requests in flight
    think_s: float = 1.0  # between an answer and the conversation's next turn
    stagger_s: float = 0.25  # between the first turns of two conversations
    first_tokens: int = 1000  # user words of the first turn
    new_tokens: int = 250  # user words of every later turn
    output_tokens: int = 32
    stream: bool = True
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "concurrency", "first_tokens", "new_tokens",
                     "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        if self.think_s < 0 or self.stagger_s < 0:
            raise ValueError("think and stagger times must be >= 0")


@dataclass
class RequestRecord:
    conversation: int
    turn: int
    start_s: float  # since the run started
    ttft_s: float | None
    total_s: float | None
    context_tokens: int | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ConcurrentRun:
    cfg: ConcurrentConfig
    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0
    router: dict[str, float | None] = field(default_factory=dict)


class _Schedule:
    """Conversations by the time their next turn may go (a heap), under one lock."""

    def __init__(self, cfg: ConcurrentConfig, convs: list[Conversation]) -> None:
        self._heap = [(i * cfg.stagger_s, i) for i in range(len(convs))]
        heapq.heapify(self._heap)
        self._lock = threading.Condition()
        self._busy = 0

    def take(self) -> tuple[float, int] | None:
        with self._lock:
            while not self._heap:
                if self._busy == 0:
                    return None  # nothing queued, nothing in flight: done
                self._lock.wait()
            self._busy += 1
            return heapq.heappop(self._heap)

    def done(self, index: int, next_at: float | None) -> None:
        with self._lock:
            self._busy -= 1
            if next_at is not None:
                heapq.heappush(self._heap, (next_at, index))
            self._lock.notify_all()


def run(cfg: ConcurrentConfig, progress: bool = True,
        send: Callable[..., Any] = chat) -> ConcurrentRun:
    from tqdm import tqdm

    model = cfg.model or first_model(cfg.url)
    run_id = f"{cfg.label}-{cfg.seed}-{int(time.time())}"
    convs = [Conversation(i, f"{run_id}-c{i}") for i in range(cfg.conversations)]
    schedule = _Schedule(cfg, convs)
    out = ConcurrentRun(cfg)
    lock = threading.Lock()
    bar = tqdm(total=cfg.conversations * cfg.turns, desc=f"bench {cfg.label} "
               f"(x{cfg.concurrency})", unit="req", disable=not progress)
    before = promtext.scrape(cfg.url.rstrip("/") + "/metrics")
    t0 = time.monotonic()

    def worker() -> None:
        while (item := schedule.take()) is not None:
            at, i = item
            conv = convs[i]
            if (wait := at - (time.monotonic() - t0)) > 0:
                time.sleep(wait)
            turn = conv.turns_done + 1
            words = cfg.first_tokens if turn == 1 else cfg.new_tokens
            conv.ask(user_text(cfg.seed, i, turn, words))
            body, headers = with_conversation_id(
                chat_body(model, conv.messages, cfg.output_tokens, cfg.stream), conv.cid, "body")
            start = time.monotonic() - t0
            try:
                reply = send(cfg.url, body, headers, timeout=cfg.timeout_s)
                conv.answer(reply.text)
                rec = RequestRecord(i, turn, start, reply.ttft_s, reply.total_s,
                                    reply.prompt_tokens)
            except RequestFailed as exc:
                rec = RequestRecord(i, turn, start, None, None, error=str(exc)[:300])
            with lock:
                out.records.append(rec)
                bar.update(1)
            # A failed turn ends its conversation: its history no longer matches anything.
            more = rec.error is None and turn < cfg.turns
            schedule.done(i, time.monotonic() - t0 + cfg.think_s if more else None)

    try:
        with ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="bench") as pool:
            for f in [pool.submit(worker) for _ in range(cfg.concurrency)]:
                f.result()
    finally:
        bar.close()
    out.wall_s = time.monotonic() - t0
    after = promtext.scrape(cfg.url.rstrip("/") + "/metrics")
    out.router = promtext.deltas(before, after, ROUTER_COUNTERS)
    out.records.sort(key=lambda r: r.start_s)
    return out
