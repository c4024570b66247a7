"""Where one turn runs, decided per turn by what it costs (pure functions and a small
online cost model). The paths (EXTEND, ON_DECODE, READ_BACK, MOVE, PREFILL), the policies
and the cap are in docs/router.md, Placement; every path gives the reuse-off output: the
choice changes only where work is done.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Any

from bidirkv.router.codec import dumps
from bidirkv.router.config import Placement

EXTEND = "extend"
ON_DECODE = "decode"
READ_BACK = "read_back"
MOVE = "move"
PREFILL = "prefill"

COST = "cost"
ALWAYS_DISAGGREGATE = "alwaysDisaggregate"
THRESHOLDS = "thresholds"
POLICIES = (COST, ALWAYS_DISAGGREGATE, THRESHOLDS)

# Bounded label values of placements_total{decision,reason}.
REASONS = ("no_handle", "policy", "prefix_unknown", "append_over_cap", "decode_busy",
           "short_append", "prefill_busy", "long_append", "cheaper_on_decode",
           "cheaper_disaggregated", "extend_failed", "prompt_over_cap", "learning",
           "holder_draining")
# The router has no tokenizer: a prompt's tokens are its characters (prompt_chars) over a
# ratio learned from what prefill reports, the median of the last CHARS_SAMPLES prompts
# (a few odd prompts do not move it) kept within this band (English ~4, code ~3, no
# traffic moves it further). So a cap is an estimate: text of r characters a token is
# estimated at no less than r / CHARS_PER_TOKEN_MAX of its tokens (2/3 for English, ~4;
# 1/4 for CJK, ~1.5).
CHARS_PER_TOKEN_MIN = 2.0
CHARS_PER_TOKEN_MAX = 6
CHARS_SAMPLES = 63
# An image, audio or video part: its tokens depend on the model's processor (hundreds to
# thousands); it counts as this many characters (1,024 tokens at 4 characters a token).
MEDIA_PART_CHARS = 4096
# A leg that prefilled fewer tokens than this says more about its fixed costs than about
# its cost per token: not learned from.
MIN_SAMPLE_TOKENS = 64


@dataclass(frozen=True)
class Inputs:
    held_tokens: int | None  # tokens the holder retains for this conversation; None: none
    new_tokens: int  # the turn's tokens beyond those (estimated)
    prefill_inflight: int  # legs in flight on the least loaded prefill
    holder_inflight: int  # legs in flight on the holder (0 without one)
    # The router knows the prompt extends exactly what the holder keeps (the conversation
    # was named by its history or its prompt prefix, and the prompt is not shorter): an
    # explicit conversation id proves nothing of the sort, and an edited history would
    # have decode prefill all of it past the edit.
    extends_held: bool = True
    # Legs in flight on the least loaded usable decode replica other than the holder;
    # None: there is none.
    other_inflight: int | None = None
    # The router has seen a prompt's token count (prefill reports it): until then it
    # cannot size a turn against the cap, and decode is given no prefill.
    sized: bool = True
    # The holder is leaving (its pod got SIGTERM): it takes no extend, and the turn moves
    # to `other_inflight`'s replica, which is never a draining one.
    holder_draining: bool = False


@dataclass(frozen=True)
class Costs:
    """Milliseconds: per token prefilled (on P or on D: the same engine, see CostModel),
    per token read from D, and the second leg's cost: its own (a request, a connection, a
    scheduler step on D) and per token of the prompt D pulls from P."""

    prefill_ms: float = 0.5
    read_ms: float = 0.05
    hop_ms: float = 20.0
    pull_ms: float = 0.005

    def hop(self, tokens: int) -> float:
        return self.hop_ms + self.pull_ms * tokens


@dataclass(frozen=True)
class Decision:
    path: str
    reason: str


def estimate_ms(inp: Inputs, c: Costs) -> tuple[float, float]:
    """(the whole turn on one decode replica, the two-leg path with the read), time to
    first token. A leg in flight ahead of this one costs about one more prefill of the
    same size. The decode replica is the holder, or without one the least loaded."""
    held = inp.held_tokens or 0
    ahead = inp.holder_inflight if inp.held_tokens is not None else inp.other_inflight or 0
    local = inp.new_tokens * c.prefill_ms * (1 + ahead)
    prefill_work = held * min(c.read_ms, c.prefill_ms) + inp.new_tokens * c.prefill_ms
    return local, c.hop(held + inp.new_tokens) + prefill_work * (1 + inp.prefill_inflight)


def place(inp: Inputs, policy: Placement, costs: Costs) -> Decision:
    if inp.held_tokens is None:
        return _unheld(inp, policy, costs)
    if inp.holder_draining and inp.other_inflight is not None:
        return Decision(MOVE, "holder_draining")
    if policy.policy == ALWAYS_DISAGGREGATE:
        return Decision(READ_BACK, "policy")
    if not inp.sized:
        return Decision(READ_BACK, "learning")
    if not inp.extends_held:
        return Decision(READ_BACK, "prefix_unknown")
    if _over_cap(inp, policy):
        return Decision(READ_BACK, "append_over_cap")
    if inp.holder_inflight >= policy.decode_busy_requests:
        if inp.other_inflight is not None and inp.other_inflight < inp.holder_inflight:
            return Decision(MOVE, "decode_busy")
        return Decision(READ_BACK, "decode_busy")
    if policy.policy == THRESHOLDS:
        if inp.new_tokens <= policy.local_prefill_tokens:
            return Decision(EXTEND, "short_append")
        if inp.prefill_inflight >= policy.prefill_busy_requests:
            return Decision(EXTEND, "prefill_busy")
        return Decision(READ_BACK, "long_append")
    return _cheaper(inp, costs, EXTEND, READ_BACK)


def _unheld(inp: Inputs, policy: Placement, costs: Costs) -> Decision:
    """A turn no decode replica holds: under `cost`, whole on the least loaded decode
    replica when that is estimated sooner; else the two legs."""
    if policy.policy != COST or inp.other_inflight is None:
        return Decision(PREFILL, "no_handle")
    if not inp.sized:
        return Decision(PREFILL, "learning")
    if _over_cap(inp, policy):
        return Decision(PREFILL, "prompt_over_cap")
    if inp.other_inflight >= policy.decode_busy_requests:
        return Decision(PREFILL, "decode_busy")
    return _cheaper(inp, costs, ON_DECODE, PREFILL)


def _over_cap(inp: Inputs, policy: Placement) -> bool:
    cap = policy.max_local_prefill_tokens
    return inp.new_tokens > cap or cap == 0


def _cheaper(inp: Inputs, costs: Costs, whole: str, two_legs: str) -> Decision:
    local, disaggregated = estimate_ms(inp, costs)
    if local <= disaggregated:
        return Decision(whole, "cheaper_on_decode")
    return Decision(two_legs, "cheaper_disaggregated")


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list):
        return 0
    n = 0
    for part in content:
        if not isinstance(part, dict):
            continue
        text = part.get("text")
        n += len(text) if isinstance(text, str) else MEDIA_PART_CHARS
    return n


def json_chars(value: Any) -> int:
    if value is None:
        return 0
    return len(value) if isinstance(value, str) else len(dumps(value))


def message_chars(message: Any) -> int:
    """Characters of one chat message that reach the prompt: its content (an image, audio
    or video part as MEDIA_PART_CHARS) and its tool calls' names and arguments. Not its
    reasoning: clients drop it, and chat templates drop it from earlier turns."""
    if not isinstance(message, dict):
        return 0
    n = _content_chars(message.get("content"))
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            n += json_chars(fn.get("name")) + json_chars(fn.get("arguments"))
    return n


def prompt_chars(body: dict[str, Any]) -> int:
    """Characters of a chat or completion body's prompt: every message part that reaches
    it and the tools offered (as their JSON); a completion prompt given as token ids
    counts CHARS_PER_TOKEN_MAX a token."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(p) if isinstance(p, str) else CHARS_PER_TOKEN_MAX for p in prompt)
    messages = body.get("messages")
    n = 0
    if isinstance(messages, list):
        for m in messages:
            # Most messages are text without tool calls: counted here, not by the helpers'
            # three calls each (the same count).
            if (type(m) is dict and type(content := m.get("content")) is str
                    and m.get("tool_calls") is None):
                n += len(content)
            else:
                n += message_chars(m)
    return n + (json_chars(body.get("tools")) if body.get("tools") else 0)


def new_tokens(prompt_chars: int, held_tokens: int, chars_per_token: float,
               held_chars: int = 0) -> int:
    """The turn's tokens beyond what the holder retains. With the characters of the text
    it holds, from what the prompt adds to them; else from the whole prompt's size. The
    router has no tokenizer; the ratio is learned from the engines' usage (CostModel)."""
    if held_chars > 0:
        return max(0, round((prompt_chars - held_chars) / chars_per_token))
    return max(0, round(prompt_chars / chars_per_token) - held_tokens)


def _ewma(old: float, sample: float, weight: float = 0.2) -> float:
    return old + weight * (sample - old)


class Line:
    """y = fixed + per_x * x, fitted online by least squares with exponential forgetting
    (each sample weighs `weight`, older ones fade), so a cost that grows with the size of
    the work is learned from the work the router sees. While the samples' x spread less
    than `min_spread`, the slope stays as it was (its prior at first) and only the fixed
    part is learned."""

    def __init__(self, fixed: float, per_x: float, weight: float = 0.2,
                 min_spread: float = 256.0) -> None:
        self.fixed, self.per_x = fixed, per_x
        self._keep = 1 - weight
        self._min_var = min_spread * min_spread
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, x: float, y: float) -> None:
        k = self._keep if self._n else 0.0  # the first sample replaces the default
        self._n = self._n * k + 1
        self._x = self._x * k + x
        self._y = self._y * k + y
        self._xx = self._xx * k + x * x
        self._xy = self._xy * k + x * y
        mx, my = self._x / self._n, self._y / self._n
        var = self._xx / self._n - mx * mx
        # Too little spread to tell a slope: keep the last one (the prior at first).
        slope = (self._xy / self._n - mx * my) / var if var >= self._min_var else self.per_x
        # Costs are never negative: a noisy fit that says so keeps the other part exact.
        self.per_x = max(0.0, slope)
        self.fixed = my - self.per_x * mx
        if self.fixed < 0:
            self.fixed = 0.0
            self.per_x = max(0.0, self._xy / self._xx) if self._xx > 0 else 0.0


class CostModel:
    """Per-token costs and the prompt's characters per token, learned from the legs and
    the engines' usage; each default is replaced by its first measurement.

    One prefill cost for P and D (same model, same machine): learned apart, D's came from
    long histories and P's from fresh prompts, and a fresh 512-token prompt took the two
    legs on an idle decode server (+35 ms at concurrency 1)."""

    def __init__(self, costs: Costs | None = None, chars_per_token: float = 4.0) -> None:
        self._costs = costs or Costs()
        self.chars_per_token = chars_per_token
        self._ratios: deque[float] = deque(maxlen=CHARS_SAMPLES)
        # The same samples in order: a turn's median is an insert and a removal, not a sort.
        self._ordered: list[float] = []
        self._seen: set[str] = set()
        self._hop = Line(self._costs.hop_ms, self._costs.pull_ms)

    @property
    def costs(self) -> Costs:
        return self._costs

    def _learn(self, name: str, sample: float) -> None:
        old = getattr(self._costs, name)
        value = _ewma(old, sample) if name in self._seen else sample
        self._seen.add(name)
        self._costs = _with(self._costs, **{name: value})

    def observe_prompt(self, prompt_chars: int, prompt_tokens: int) -> None:
        """A prompt's characters and the tokens prefill counted (see CHARS_PER_TOKEN_MIN)."""
        if prompt_chars > 0 and prompt_tokens > 0:
            ratio, ordered = prompt_chars / prompt_tokens, self._ordered
            if len(self._ratios) == CHARS_SAMPLES:
                del ordered[bisect.bisect_left(ordered, self._ratios[0])]
            self._ratios.append(ratio)
            bisect.insort(ordered, ratio)
            self.chars_per_token = min(float(CHARS_PER_TOKEN_MAX),
                                       max(CHARS_PER_TOKEN_MIN, _median(ordered)))
            self._seen.add("chars")

    def observe_prefill(self, ms: float, computed: int, read: int = 0) -> None:
        """A prefill leg: `computed` tokens prefilled, `read` read from decode."""
        if computed >= MIN_SAMPLE_TOKENS and read == 0:
            self._learn("prefill_ms", ms / computed)
        elif read >= MIN_SAMPLE_TOKENS:
            rest = max(0.0, ms - computed * self._costs.prefill_ms)
            self._learn("read_ms", rest / read)

    @property
    def sized(self) -> bool:
        """A prompt's characters per token was measured (else turns cannot be sized)."""
        return "chars" in self._seen

    def observe_hop(self, ms: float, tokens: int) -> None:
        """The two-leg path's second leg, from P's answer to D's first byte; `tokens`: the
        prompt's, which D pulls from P."""
        if ms >= 0 and tokens >= 0:
            self._hop.add(max(0, tokens), ms)
            self._costs = _with(self._costs, hop_ms=self._hop.fixed, pull_ms=self._hop.per_x)

    def observe_extend(self, ms: float, computed: int) -> None:
        """A whole turn on decode, to its first byte: `computed` tokens prefilled there."""
        if computed >= MIN_SAMPLE_TOKENS:
            self._learn("prefill_ms", ms / computed)


def _median(ordered: list[float]) -> float:
    """statistics.median of samples already in order (the same float)."""
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _with(c: Costs, **over: float) -> Costs:
    return Costs(**{**c.__dict__, **over})
