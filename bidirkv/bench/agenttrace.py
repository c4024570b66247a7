"""An agent's trace (pure, seeded): a parent conversation that spawns sub-agents and forks,
its JSON file form, and the tokens each request shares with a history sent before it.

The parent is a coding agent: a system message (its prompt and the tools' JSON schemas,
about 2k tokens), then 8 turns, each a user message (its task, then tool results) and the
model's answer, growing to about 8k tokens. After its turns 3 and 6 it spawns
- 3 sub-agents: the same system message, then a task of their own;
- 2 forks: the parent's whole history, its last answer included, then a different next
  user message (a branch of a plan, one of best-of-n);
and each child has 1-2 later turns of its own (a tool result). Requests go one at a time
in the trace's order: the spawning turn, the children's first turns, their later turns
round-robin, then the parent's next turn.

The tools are JSON in the system message's text, not in the body's `tools`: the tiny
model's chat template renders only the messages (tools in the body would share nothing),
and vLLM takes `tools` with the default tool_choice only from a server started with a
tool parser.

Headers: the parent sends `X-Session-ID`; a sub-agent its own `X-Session-ID` and a parent
header naming the parent's session (`parent_header`, by default
x-claude-code-parent-agent-id); a fork its own `X-Session-ID` only (the router is to find
its parent by its history). The file names sessions by their trace names; a run prefixes
each with its own id, so two runs never share a session.

Tokens: with the tiny model's word-level tokenizer and chat template
(bidirkv/local/model.py) a prompt is `<s>`, then per message its role marker and its
content's whitespace-separated words, then `<|assistant|>`; each answer is exactly
`output_tokens` tokens (min_tokens = max_tokens, ignore_eos). So the counts here are the
server's (a run checks them against usage.prompt_tokens), the tools' JSON included (each
of its pieces is one `<unk>` token).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from bidirkv.bench.conversation import Conversation
from bidirkv.bench.histories import tool_definitions
from bidirkv.local.model import random_text

TRACE_KIND = "bidirkv-agent-trace"
TRACE_VERSION = 1
SESSION_HEADER = "X-Session-ID"
# The parent headers agent clients send (Dynamo's, Claude Code's, Codex's).
PARENT_HEADERS = ("X-Dynamo-Parent-Session-ID", "x-claude-code-parent-agent-id",
                  "x-codex-parent-thread-id")
PARENT, SUBAGENT, FORK = "parent", "subagent", "fork"  # a session's role
# A request's kind, in the order the report gives them.
PARENT_TURN = "parent turn"  # the parent's turns but those right after a spawn
PARENT_AFTER = "parent after spawn"  # the parent's next turn after its children's
SUB_FIRST = "sub-agent first turn"
FORK_FIRST = "fork first turn"
CHILD_LATER = "child later turn"
KINDS = (PARENT_AFTER, SUB_FIRST, FORK_FIRST, CHILD_LATER, PARENT_TURN)
FIRST_OF = {SUBAGENT: SUB_FIRST, FORK: FORK_FIRST}
# Each parent turn's user words are drawn within this share of their mean.
SPREAD = 0.2


def _need(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {value!r}: {allowed}")


def _range(name: str, value: Any, low: int) -> None:
    _need(isinstance(value, tuple) and len(value) == 2
          and all(isinstance(v, int) for v in value) and low <= value[0] <= value[1],
          name, value, f"a pair [min, max] of integers with {low} <= min <= max")


def tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    return json.dumps(list(tools))


@dataclass(frozen=True)
class Shape:
    """The trace's sizes; FULL is the benchmark's, QUICK a smoke run's."""

    parent_turns: int = 8
    parent_tokens: int = 8192  # the parent's last prompt, about
    system_tokens: int = 2048  # the system message's content: its prompt and the tools
    tools: int = 12  # tool schemas in the system message (bench/histories.py's)
    spawn_after: tuple[int, ...] = (3, 6)  # the parent's turns that spawn children
    subagents: int = 3  # per spawn
    forks: int = 2  # per spawn
    later_turns: tuple[int, int] = (1, 2)  # a child's turns after its first, drawn
    task_words: tuple[int, int] = (200, 400)  # a child's first user message
    later_words: tuple[int, int] = (200, 600)  # a child's later one (a tool result)
    output_tokens: int = 32
    parent_header: str = PARENT_HEADERS[1]

    def __post_init__(self) -> None:
        for name in ("parent_turns", "parent_tokens", "system_tokens", "output_tokens"):
            value = getattr(self, name)
            _need(isinstance(value, int) and value >= 1, name, value, "an integer >= 1")
        for name in ("subagents", "forks"):
            value = getattr(self, name)
            _need(isinstance(value, int) and value >= 0, name, value, "an integer >= 0")
        _need(isinstance(self.tools, int) and 0 <= self.tools <= len(tool_definitions()),
              "tools", self.tools, f"an integer from 0 to {len(tool_definitions())}")
        turns = self.spawn_after
        _need(isinstance(turns, tuple) and all(isinstance(t, int) for t in turns)
              and list(turns) == sorted(set(turns))
              and all(1 <= t < self.parent_turns for t in turns), "spawn_after", turns,
              f"distinct parent turns in increasing order, each from 1 to "
              f"{self.parent_turns - 1} (a spawn is followed by the parent's next turn)")
        _range("later_turns", self.later_turns, 0)
        _range("task_words", self.task_words, 1)
        _range("later_words", self.later_words, 1)
        _need(self.parent_header in PARENT_HEADERS, "parent_header", self.parent_header,
              f"one of {', '.join(PARENT_HEADERS)}")
        tools = len(tools_text(tool_definitions()[:self.tools]).split())
        _need(self.system_tokens > tools, "system_tokens", self.system_tokens,
              f"more than the {tools} tokens of the {self.tools} tools' schemas")
        _need(self.parent_mean_words() >= 1, "parent_tokens", self.parent_tokens,
              f"room for at least one user word a turn beside the system message and "
              f"{self.parent_turns - 1} answers")

    def parent_mean_words(self) -> float:
        """A parent turn's mean user words: what its last prompt leaves after `<s>`, the
        system message, the role markers and the answers."""
        fixed = (2 + self.system_tokens + self.parent_turns
                 + (self.parent_turns - 1) * (1 + self.output_tokens) + 1)
        return (self.parent_tokens - fixed) / self.parent_turns

    @classmethod
    def from_json(cls, doc: Any) -> Shape:
        _need(isinstance(doc, dict), "shape", doc, "an object")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - names)
        _need(not unknown, "shape", unknown, f"unknown keys; known: {', '.join(sorted(names))}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in doc.items()})


FULL = Shape()
QUICK = Shape(parent_turns=3, parent_tokens=1000, system_tokens=256, tools=3,
              spawn_after=(2,), subagents=1, forks=1, later_turns=(1, 1),
              task_words=(60, 120), later_words=(60, 120), output_tokens=16)


@dataclass(frozen=True)
class Session:
    name: str
    role: str  # PARENT, SUBAGENT or FORK
    parent: str | None = None
    after_turn: int | None = None  # a child's: the parent's turn whose answer it follows
    # The request headers, each naming a session of the trace (a run prefixes its id).
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    """One request: a session's turn, and the user message it adds."""

    session: str
    turn: int  # the session's, 1-based
    kind: str  # KINDS
    user: str


@dataclass(frozen=True)
class Trace:
    seed: int
    shape: Shape
    system_prompt: str
    tools: list[dict[str, Any]]
    sessions: tuple[Session, ...]
    steps: tuple[Step, ...]

    def system_message(self) -> dict[str, str]:
        return {"role": "system",
                "content": f"{self.system_prompt}\n\n# tools\n{tools_text(self.tools)}"}

    def session(self, name: str) -> Session:
        for s in self.sessions:
            if s.name == name:
                return s
        raise KeyError(name)


def _mix(seed: int, *parts: object) -> int:
    text = "/".join(str(p) for p in ("agents", seed, *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _text(seed: int, session: str, turn: int, words: int) -> str:
    return random_text(words, _mix(seed, session, turn))


def _children(shape: Shape, parent: str, turn: int) -> list[Session]:
    """A spawn's sub-agents (their own session and the parent's by header), then its
    forks (their own session only)."""
    subs = [Session(f"t{turn}-sub{i}", SUBAGENT, parent, turn,
                    {SESSION_HEADER: f"t{turn}-sub{i}", shape.parent_header: parent})
            for i in range(1, shape.subagents + 1)]
    forks = [Session(f"t{turn}-fork{i}", FORK, parent, turn, {SESSION_HEADER: f"t{turn}-fork{i}"})
             for i in range(1, shape.forks + 1)]
    return subs + forks


def build_trace(seed: int, shape: Shape = FULL) -> Trace:
    """The seeded trace: the same seed and shape give the same trace."""
    rng = random.Random(_mix(seed, "sizes"))
    mean = shape.parent_mean_words()
    parent = Session(PARENT, PARENT, headers={SESSION_HEADER: PARENT})
    sessions, steps = [parent], []
    for t in range(1, shape.parent_turns + 1):
        words = max(1, round(mean * rng.uniform(1 - SPREAD, 1 + SPREAD)))
        kind = PARENT_AFTER if t - 1 in shape.spawn_after else PARENT_TURN
        steps.append(Step(PARENT, t, kind, _text(seed, PARENT, t, words)))
        if t not in shape.spawn_after:
            continue
        kids = _children(shape, PARENT, t)
        sessions += kids
        steps += [Step(k.name, 1, FIRST_OF[k.role],
                       _text(seed, k.name, 1, rng.randint(*shape.task_words))) for k in kids]
        later = {k.name: rng.randint(*shape.later_turns) for k in kids}
        for turn in range(2, max(later.values(), default=0) + 2):
            steps += [Step(k.name, turn, CHILD_LATER,
                           _text(seed, k.name, turn, rng.randint(*shape.later_words)))
                      for k in kids if later[k.name] >= turn - 1]
    tools = tool_definitions()[:shape.tools]
    prompt_words = shape.system_tokens - len(tools_text(tools).split()) - 2  # "# tools"
    return Trace(seed, shape, _text(seed, "system", 0, max(1, prompt_words)), tools,
                 tuple(sessions), tuple(steps))


# -- the file ---------------------------------------------------------------------------

def trace_json(trace: Trace) -> dict[str, Any]:
    return {"kind": TRACE_KIND, "version": TRACE_VERSION, "seed": trace.seed,
            "shape": asdict(trace.shape), "system_prompt": trace.system_prompt,
            "tools": trace.tools, "sessions": [asdict(s) for s in trace.sessions],
            "steps": [asdict(s) for s in trace.steps]}


def _record(cls: type, doc: Any, where: str) -> Any:
    names = [f.name for f in fields(cls)]
    _need(isinstance(doc, dict) and set(doc) <= set(names), where, doc,
          f"an object with keys from {', '.join(names)}")
    try:
        return cls(**doc)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _check_order(trace: Trace) -> None:
    """Every step's session is known, its turns come in order from 1, and a child starts
    after the parent's turn it follows."""
    done: dict[str, int] = {}
    for i, step in enumerate(trace.steps):
        where = f"steps[{i}]"
        _need(step.kind in KINDS, f"{where}.kind", step.kind, f"one of {', '.join(KINDS)}")
        try:
            s = trace.session(step.session)
        except KeyError:
            raise ValueError(f"{where}.session: {step.session!r}: not a session of the "
                             "trace") from None
        _need(step.turn == done.get(s.name, 0) + 1, f"{where}.turn", step.turn,
              f"turn {done.get(s.name, 0) + 1} of {s.name} comes next")
        if step.turn == 1 and s.parent is not None:
            _need(done.get(s.parent, 0) >= (s.after_turn or 0), f"{where}.session",
                  s.name, f"a child starts after its parent's turn {s.after_turn}")
        _need(isinstance(step.user, str) and step.user.strip() != "", f"{where}.user",
              step.user, "a non-empty user message")
        done[s.name] = step.turn


def trace_from_json(doc: Any) -> Trace:
    """The trace a file holds; ValueError naming the field at fault."""
    _need(isinstance(doc, dict) and doc.get("kind") == TRACE_KIND, "kind",
          doc.get("kind") if isinstance(doc, dict) else doc, f"must be {TRACE_KIND!r}")
    _need(doc.get("version") == TRACE_VERSION, "version", doc.get("version"),
          f"this benchmark reads version {TRACE_VERSION}")
    for key, kind in (("seed", int), ("system_prompt", str), ("tools", list),
                      ("sessions", list), ("steps", list)):
        _need(isinstance(doc.get(key), kind), key, doc.get(key), f"a {kind.__name__}")
    sessions = tuple(_record(Session, s, f"sessions[{i}]")
                     for i, s in enumerate(doc["sessions"]))
    for i, s in enumerate(sessions):
        _need(s.role in (PARENT, SUBAGENT, FORK), f"sessions[{i}].role", s.role,
              f"one of {PARENT}, {SUBAGENT}, {FORK}")
        _need((s.parent is None) == (s.role == PARENT) and (s.parent is None or any(
            p.name == s.parent for p in sessions)), f"sessions[{i}].parent", s.parent,
            "a child names a session of the trace; the parent names none")
    _need(len({s.name for s in sessions}) == len(sessions), "sessions",
          [s.name for s in sessions], "distinct names")
    trace = Trace(doc["seed"], Shape.from_json(doc.get("shape")), doc["system_prompt"],
                  doc["tools"], sessions,
                  tuple(_record(Step, s, f"steps[{i}]") for i, s in enumerate(doc["steps"])))
    _check_order(trace)
    return trace


def write_trace(path: pathlib.Path, trace: Trace) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace_json(trace), indent=1) + "\n", encoding="utf-8")
    return path


def read_trace(path: pathlib.Path) -> Trace:
    try:
        doc = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the trace {path}: {exc}") from None
    try:
        return trace_from_json(doc)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


# -- tokens and the replay ---------------------------------------------------------------

def tokens(messages: Sequence[Mapping[str, str]], generation_prompt: bool = True
           ) -> list[str]:
    """The prompt as the tiny model's chat template renders it, a word a token."""
    out = ["<s>"]
    for m in messages:
        out.append(f"<|{m['role']}|>")
        out += m["content"].split()
    return out + (["<|assistant|>"] if generation_prompt else [])


def common_prefix(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Replay:
    """The trace's sessions as conversations while a run goes: what each step sends, with
    which headers, and the history before it that it extends (its own previous turn, or
    for a child's first turn its parent's history after the turn that spawned it)."""

    def __init__(self, trace: Trace, run_id: str) -> None:
        self.trace = trace
        self.run_id = run_id
        self.convs: dict[str, Conversation] = {}
        self.after: dict[tuple[str, int], list[dict[str, str]]] = {}

    def session_id(self, name: str) -> str:
        return f"{self.run_id}-{name}"

    def headers(self, step: Step) -> dict[str, str]:
        return {h: self.session_id(v) for h, v in self.trace.session(step.session)
                .headers.items()}

    def conversation(self, step: Step) -> Conversation:
        if step.session not in self.convs:
            s = self.trace.session(step.session)
            index = self.trace.sessions.index(s)
            opening = ([dict(m) for m in self.after[(s.parent, s.after_turn)]]
                       if s.role == FORK and s.parent is not None
                       else [self.trace.system_message()])
            self.convs[s.name] = Conversation(index, self.session_id(s.name), opening)
        return self.convs[step.session]

    def prompt(self, step: Step) -> list[dict[str, str]]:
        """The messages `step` sends (its conversation as it stands, and its user message)."""
        return [*self.conversation(step).messages, {"role": "user", "content": step.user}]

    def source(self, step: Step) -> tuple[str, int] | None:
        """(session, turn) whose history `step` extends; None for the parent's first."""
        if step.turn > 1:
            return step.session, step.turn - 1
        s = self.trace.session(step.session)
        return None if s.parent is None else (s.parent, s.after_turn or 0)

    def shared_tokens(self, step: Step) -> int:
        """Tokens the prompt of `step` shares with its source's history, answer included."""
        src = self.source(step)
        if src is None:
            return 0
        return common_prefix(tokens(self.prompt(step)), tokens(self.after[src], False))

    def answered(self, step: Step) -> None:
        """Keep the history after `step`'s answer (its conversation has it)."""
        self.after[(step.session, step.turn)] = [dict(m) for m in
                                                 self.convs[step.session].messages]


def plan(trace: Trace) -> list[dict[str, Any]]:
    """Each step's prompt and shared tokens, with stand-in answers of output_tokens words
    (the counts a run gets, whatever the model answers)."""
    replay, out = Replay(trace, "plan"), []
    for i, step in enumerate(trace.steps):
        row = {"step": i, "session": step.session, "turn": step.turn, "kind": step.kind,
               "prompt_tokens": len(tokens(replay.prompt(step))),
               "shared_tokens": replay.shared_tokens(step)}
        conv = replay.conversation(step)
        conv.ask(step.user)
        conv.answer(" ".join(f"answer-{i}-{k}" for k in range(trace.shape.output_tokens)))
        replay.answered(step)
        out.append(row)
    return out
