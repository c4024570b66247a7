"""The drop-vs-drain benchmark's pure parts: when its events fire, which turns each is
judged on, the table and the verdict.

One seeded multi-turn trace runs against a 1P2D local stack once per mode, and three
events, one at a time, hit the servers that hold conversations:
- a rollout of decode-0 (it stops, then starts again with the same command),
- a scale-down of decode-1 (2 -> 1: it stops for good),
- a restart of the router (with its in-process handle store).
In `drain` mode each server stops as a deleted pod does (SIGTERM: decode drains first);
in `drop` mode it is killed (SIGKILL), as a pod without the drain loses what it holds.
The same trace also runs with no event (`baseline`: the TTFTs each event is held against)
and with reuse off (`off`: the outputs every run must equal, float32).

Each event fires between turns: once every conversation answered turn `after_turn` and
none has sent the next one (a barrier, in every mode and in the baseline), so the
conversations each server holds at that moment are known, and the first turn of each
after the event is the one that shows what the event cost it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bidirkv.bench.stats import Aim, percentile, table
from bidirkv.bench.turns import REUSED

MODES = ("drop", "drain")
RESTART, LEAVE = "restart", "leave"
# The share of the returning turns held on a leaving server that must still reuse with
# the drain.
REUSE_AIM = 0.9


@dataclass(frozen=True)
class Event:
    name: str  # what a cluster would call it
    target: str  # the local stack's server name
    action: str  # RESTART or LEAVE
    after_turn: int  # fires once every conversation answered this turn

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def schedule(turns: int) -> tuple[Event, ...]:
    """The three events, a quarter of the turns apart, each with turns after it. The
    rollout of decode-0 comes first, while decode-1 can take its conversations; decode-1
    then leaves holding every conversation (they all moved to it), and the router restarts
    last, when decode-0 holds them all."""
    if turns < 4:
        raise ValueError(f"turns {turns}: the three events need at least 4 turns "
                         "(one before the first event and one after each)")
    at = [max(k, round(turns * k / 4)) for k in (1, 2, 3)]
    return (Event("rollout of decode-0", "decode-0", RESTART, at[0]),
            Event("scale-down of decode-1 (2 -> 1)", "decode-1", LEAVE, at[1]),
            Event("router restart (in-process store)", "router", RESTART, at[2]))


def pause_turn(events: Sequence[Event]) -> int:
    """The turn a long pause (a tool call) comes before: the first after the scale-down,
    so the leaving replica waits for conversations that are slow to come back."""
    return events[1].after_turn + 1


def next_step(done: Mapping[int, int], due: Mapping[int, float], events: Sequence[Event],
              fired: int, turns: int) -> tuple[str, int] | None:
    """What the trace does next: ("event", i) once every conversation answered the turn
    event i waits for, else ("turn", conversation) for the conversation due first (ties by
    index) among those not held at the barrier, else None (the trace is over).

    `done`: turns answered per conversation; `due`: when each may send its next turn;
    `fired`: how many events have fired."""
    barrier = events[fired].after_turn if fired < len(events) else turns
    if fired < len(events) and all(n >= barrier for n in done.values()):
        return ("event", fired)
    ready = [c for c, n in done.items() if n < min(barrier, turns)]
    if not ready:
        return None
    return ("turn", min(ready, key=lambda c: (due.get(c, 0.0), c)))


@dataclass
class EventRecord:
    """What happened at one event in one run."""
    event: Event
    mode: str  # drop | drain | baseline (nothing is done)
    at_s: float  # since the run's first request
    held: list[int]  # conversations the target held (the router: every one any decode held)
    stop_s: float | None = None  # signal -> its last process gone
    stopped: bool | None = None  # False: it still drained when the wait ran out
    start_s: float | None = None  # a restart: start -> serving again
    drain_end: str | None = None  # the launcher's reason (drained, deadline, ...)
    lines: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "event": self.event.to_json()}


def returning(records: Sequence[Mapping[str, Any]], ev: Mapping[str, Any]
              ) -> list[Mapping[str, Any]]:
    """The first turn after the event of each conversation the target held."""
    want = {(c, ev["event"]["after_turn"] + 1) for c in ev["held"]}
    return [r for r in records if (r["conversation"], r["turn"]) in want]


def _p(values: Sequence[float], q: float) -> float | None:
    return percentile(values, q)


def event_row(run: Mapping[str, Any], ev: Mapping[str, Any],
              baseline: Sequence[Mapping[str, Any]], grace_s: float | None) -> dict[str, Any]:
    """One event of one run against the same turns of the baseline."""
    back = returning(run["records"], ev)
    base_by = {(r["conversation"], r["turn"]): r for r in baseline}
    base = [base_by[(r["conversation"], r["turn"])] for r in back
            if (r["conversation"], r["turn"]) in base_by]
    ttft = [r["ttft_s"] for r in back]
    base_ttft = [r["ttft_s"] for r in base]
    reused = sum(1 for r in back if r.get("reason") in REUSED)
    stop_s = ev.get("stop_s")
    drains = ev["mode"] == "drain" and ev["event"]["target"] != "router"
    return {
        "event": ev["event"]["name"], "mode": ev["mode"], "held": len(ev["held"]),
        "returned": len(back), "reused": reused,
        "reuse_share": reused / len(back) if back else None,
        "ttft_p50_s": _p(ttft, 50), "ttft_p99_s": _p(ttft, 99),
        "base_p50_s": _p(base_ttft, 50), "base_p99_s": _p(base_ttft, 99),
        "failed": sum(r.get("failed_attempts", 0) for r in back),
        "stop_s": stop_s, "start_s": ev.get("start_s"), "drain_end": ev.get("drain_end"),
        "grace_s": grace_s if drains else None,
        "within_grace": (stop_s is not None and stop_s <= grace_s) if drains and grace_s
        else None,
        "reasons": _count(r.get("reason") or "?" for r in back),
    }


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for it in items:
        out[it] = out.get(it, 0) + 1
    return out


def rows(runs: Mapping[str, Mapping[str, Any]], grace_s: float | None) -> list[dict[str, Any]]:
    """Every event of the drop and drain runs, event by event (drop first)."""
    baseline = runs["baseline"]["records"] if "baseline" in runs else []
    out = []
    n = max((len(runs[m]["events"]) for m in MODES if m in runs), default=0)
    for i in range(n):
        for mode in MODES:
            if mode in runs:
                out.append(event_row(runs[mode], runs[mode]["events"][i], baseline, grace_s))
    return out


def outputs_equal(run: Mapping[str, Any], off: Mapping[str, Any]) -> tuple[int, list]:
    """(turns compared, [(conversation, turn) whose output differs from reuse-off])."""
    ref = {(r["conversation"], r["turn"]): r["text_sha"] for r in off["records"]}
    compared, differ = 0, []
    for r in run["records"]:
        key = (r["conversation"], r["turn"])
        if key in ref:
            compared += 1
            if ref[key] != r["text_sha"]:
                differ.append(list(key))
    return compared, differ


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _share(row: Mapping[str, Any]) -> str:
    if not row["returned"]:
        return "-"
    return f"{row['reused']}/{row['returned']} ({row['reuse_share'] * 100:.0f} %)"


COLUMNS = [
    ("event", "event", str),
    ("mode", "mode", str),
    ("held", "held", str),
    ("_share", "returning turns reused", str),
    ("ttft_p50_s", "TTFT p50 ms", _ms),
    ("ttft_p99_s", "TTFT p99 ms", _ms),
    ("base_p50_s", "no event p50", _ms),
    ("base_p99_s", "no event p99", _ms),
    ("failed", "failed", str),
    ("stop_s", "stop s", _s),
    ("drain_end", "drain ended", lambda v: v or "-"),
    ("start_s", "restart s", _s),
]


def table_text(event_rows: Sequence[Mapping[str, Any]]) -> str:
    return table([{**r, "_share": _share(r)} for r in event_rows], COLUMNS)


def verdict(event_rows: Sequence[Mapping[str, Any]], runs: Mapping[str, Mapping[str, Any]]
            ) -> list[Aim]:
    """The benchmark's aims, each met, not met or not measured."""
    aims = []
    drain = [r for r in event_rows if r["mode"] == "drain" and r["returned"]]
    if drain:
        worst = min(drain, key=lambda r: r["reuse_share"])
        aims.append(Aim(f"drain: >= {REUSE_AIM:.0%} of the returning turns held on the "
                        "leaving server reuse, per event",
                        worst["reuse_share"] >= REUSE_AIM,
                        f"lowest {worst['reused']}/{worst['returned']} ({worst['event']})"))
    else:
        aims.append(Aim(f"drain: >= {REUSE_AIM:.0%} of returning turns reuse", None,
                        "no drain run, or no conversation held at its events"))
    for mode in (*MODES, "baseline"):
        if mode not in runs:
            continue
        failed = runs[mode].get("failed_attempts", 0)
        aims.append(Aim(f"{mode}: no failed request", failed == 0,
                        f"{failed} failed attempts"))
        if "off" in runs:
            compared, differ = outputs_equal(runs[mode], runs["off"])
            aims.append(Aim(f"{mode}: outputs equal reuse-off", not differ and compared > 0,
                            f"{compared - len(differ)}/{compared} equal"
                            + (f"; differ: {differ[:5]}" if differ else "")))
    timed = [r for r in event_rows if r.get("within_grace") is not None]
    if timed:
        slow = max(timed, key=lambda r: r["stop_s"])
        aims.append(Aim("drain: each drain within the grace period",
                        all(r["within_grace"] for r in timed),
                        f"longest {slow['stop_s']:.1f} s ({slow['event']}) of "
                        f"{slow['grace_s']:.0f} s"))
    return aims
