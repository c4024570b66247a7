"""README's headline table, written from a `make demo` run's JSON, never typed in.

`make headline` (`bidir-kv bench --headline out/demo/bench.json`) keeps what the table
shows of the run (its stamp, trace, placement policies, per-turn rows and aims) as
SOURCE, which is committed, and writes `render(SOURCE)` between the markers of each of
PAGES; tests/test_headline.py holds the pages equal to it. Given SOURCE itself, the
command only renders again (after a change to this module).

A bench.json from before the demo recorded its run (bidirkv/bench/stamp.py) or its
policies takes them from the command line, and the table says so.
"""

from __future__ import annotations

import json
import pathlib
import re
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any, get_args

from bidirkv.bench import report, stats
from bidirkv.bench.conversation import Appends
from bidirkv.bench.stats import _int, _x
from bidirkv.bench.turns import Think
from bidirkv.knobs import Placement, PlacementPolicy

KIND = "bidirkv-headline"
START = "<!-- headline:start -->"
END = "<!-- headline:end -->"
SOURCE = pathlib.Path("docs/headline.json")
PAGES = (pathlib.Path("README.md"), pathlib.Path("docs/benchmarks.md"))
DEFAULT_POLICY = Placement.model_fields["policy"].default
POLICIES = get_args(PlacementPolicy)
TRACE_KEYS = ("conversations", "turns", "new_tokens", "output_tokens", "think", "appends")
ROW_KEYS = ("turn", "context_tokens", "gap_on_s", "ttft_on_s", "ttft_off_s", "speedup",
            "lower_bound_s", "on_over_lower_bound", "transfer_on_s", "reused_tokens_on",
            "transfer_on_bytes", "ttft_cost_s")
RUN_NAMES = {"on": "ON", "off": "OFF with the lower bound", "cost": "cost"}
WIDTH = 90  # the docs' prose lines
COMMIT = re.compile(r"[0-9a-f]{7,40}")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _need(doc: Mapping[str, Any], path: str, source: str) -> Any:
    """doc[a][b]... for path 'a.b...', or an error naming the field and the file."""
    value: Any = doc
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            raise ValueError(f"{source}: no field {path}: not the JSON `make demo` writes "
                             "(out/demo/bench.json)")
        value = value[key]
    return value


def given_stamp(given: Mapping[str, str | None], source: str) -> dict[str, Any]:
    """The run record of a bench.json written before the demo recorded one."""
    commit, date = given.get("commit"), given.get("date")
    if commit is None or date is None:
        raise ValueError(f"{source} records no run (commit, date): it was written before "
                         "the demo recorded them; give --commit and --date")
    if not COMMIT.fullmatch(commit):
        raise ValueError(f"--commit {commit!r}: a commit is 7-40 lowercase hex digits")
    if not DATE.fullmatch(date):
        raise ValueError(f"--date {date!r}: a date is YYYY-MM-DD")
    return {"commit": commit, "uncommitted_changes": None, "date": date, "wall_s": None,
            "before_demo_s": None, "phases": [], "given": True}


def run_of(bench: Mapping[str, Any], given: Mapping[str, str | None], source: str
           ) -> dict[str, Any]:
    if "run" not in bench:
        return given_stamp(given, source)
    named = [f"--{k}" for k in ("commit", "date") if given.get(k) is not None]
    if named:
        raise ValueError(f"{source} records its run (commit {bench['run'].get('commit')}, "
                         f"{bench['run'].get('date')}): {' and '.join(named)} only stand in "
                         "for a record a bench.json lacks")
    return {**bench["run"], "given": False}


def policy_of(run: Mapping[str, Any], label: str, given: str | None, source: str) -> str:
    """A run's placement policy: its record, or for a bench.json without one, --policy
    (the demo's `cost` run is named for its policy)."""
    if "placement_policy" in run:
        if given is not None:
            raise ValueError(f"{source}: runs.{label} records its policy "
                             f"{run['placement_policy']!r}: --policy only stands in for a "
                             "record a bench.json lacks")
        return run["placement_policy"]
    if label == "cost":
        return "cost"
    if given is None:
        raise ValueError(f"{source}: runs.{label} records no placement policy (written "
                         f"before the demo recorded it): give --policy, one of "
                         f"{', '.join(POLICIES)}")
    if given not in POLICIES:
        raise ValueError(f"--policy {given!r}: one of {', '.join(POLICIES)}")
    return given


def extract(bench: Mapping[str, Any], source: str,
            given: Mapping[str, str | None] | None = None) -> dict[str, Any]:
    """The headline document: what the table shows of a `make demo` comparison."""
    given = given or {}
    if bench.get("kind") != report.COMPARE_KIND:
        raise ValueError(f"{source}: kind {bench.get('kind')!r}, not a `make demo` "
                         f"comparison ({report.COMPARE_KIND}, out/demo/bench.json)")
    runs = _need(bench, "runs", source)
    config = _need(bench, "runs.on.config", source)
    return {
        "kind": KIND,
        "source": source,
        "run": run_of(bench, given, source),
        "cpu": _need(bench, "cpu", source),
        "dtype": _need(bench, "dtype", source),
        "trace": {k: config.get(k) for k in TRACE_KEYS},
        "policies": {label: policy_of(run, label, given.get("policy"), source)
                     for label, run in runs.items()},
        "bench_s": {label: run.get("wall_s") for label, run in runs.items()},
        "reuse": _need(bench, "runs.on.reuse_reasons", source),
        "aims": [*_need(bench, "aims", source),
                 *(bench.get("placement") or {}).get("aims", [])],
        "outputs": {"compared": _need(bench, "outputs.compared", source),
                    "differ": len(_need(bench, "outputs.differ", source))},
        "rows": [{k: row[k] for k in ROW_KEYS if k in row}
                 for row in _need(bench, "rows", source)],
    }


# -- rendering (pure) ----------------------------------------------------------------------
# The README's cells carry their units (stats' formatters leave them to the headers).
def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} s"


def _mb(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e6:.1f} MB"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


Column = tuple[str, Callable[[Mapping[str, Any]], str]]
COLUMNS: list[Column] = [
    ("turn", lambda r: _int(r.get("turn"))),
    ("context", lambda r: _int(r.get("context_tokens"))),
    ("gap", lambda r: _s(r.get("gap_on_s"))),
    ("TTFT ON", lambda r: _ms(r.get("ttft_on_s"))),
    ("TTFT OFF", lambda r: _ms(r.get("ttft_off_s"))),
    ("OFF/ON", lambda r: _x(r.get("speedup"))),
    ("lower bound", lambda r: _ms(r.get("lower_bound_s"))),
    ("ON/bound", lambda r: _x(r.get("on_over_lower_bound"))),
    ("KV read D->P", lambda r: _ms(r.get("transfer_on_s"))),
    ("tokens reused", lambda r: _int(r.get("reused_tokens_on"))),
    ("read", lambda r: _mb(r.get("transfer_on_bytes"))),
]
# The demo's placement run (`make demo-all`), where the JSON has it.
COST_COLUMNS: list[Column] = [
    ("TTFT cost", lambda r: _ms(r.get("ttft_cost_s"))),
    ("cost/bound", lambda r: _x(_ratio(r.get("ttft_cost_s"), r.get("lower_bound_s")))),
]


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    lines = ["| " + " | ".join(title for title, _ in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in rows]
    return "\n".join(lines)


def stamp_line(h: Mapping[str, Any]) -> str:
    run, cpu, dtype = h["run"], h["cpu"], h["dtype"]
    commit = run.get("commit") or "(no git checkout)"
    if run.get("uncommitted_changes"):
        commit += " with uncommitted changes"
    how = "picked for this CPU" if dtype.get("picked") else "from the spec"
    on, off = h["policies"]["on"], h["policies"]["off"]
    runs = (f"ON and OFF under placement `{on}`" if on == off else
            f"ON under placement `{on}`, OFF under `{off}`")
    return (f"**Commit {commit}, {run['date']}; {cpu['model']}, {cpu['cores']} cores "
            f"({cpu.get('arch', '?')}: {cpu.get('isa', '?')}); {dtype['dtype']} ({how}); "
            f"{runs}:**")


def trace_text(trace: Mapping[str, Any]) -> str:
    added = (Appends(**trace["appends"]).describe() if trace.get("appends") else
             f"+{trace['new_tokens']} user tokens")
    think = Think(**{**trace["think"], "pause_turns": tuple(trace["think"]["pause_turns"])})
    n, turns = trace["conversations"], trace["turns"]
    return (f"{n} conversation{'s' * (n != 1)} x {turns} turn{'s' * (turns != 1)}, {added} and "
            f"{trace['output_tokens']} output tokens a turn, {think.describe()} (seeded); "
            "median over conversations")


def time_text(h: Mapping[str, Any]) -> str:
    run, bench = h["run"], h["bench_s"]
    parts = [f"{RUN_NAMES.get(label, label)} {_s(secs)}" for label, secs in bench.items()
             if secs is not None]
    measured = "the benchmark runs " + ", ".join(parts)
    if run.get("wall_s") is None:
        return (f"Time: {measured}; the demo's whole time is not in this run's JSON (later "
                "runs record it).")
    if run.get("before_demo_s") is None:
        return f"Time: the demo {_s(run['wall_s'])} (run without make), of which {measured}."
    whole = run["before_demo_s"] + run["wall_s"]
    return (f"Time: `make demo` {_s(whole)}: {_s(run['before_demo_s'])} before the demo "
            f"(installing, where it had to), then the demo {_s(run['wall_s'])}, of which "
            f"{measured}.")


def reuse_text(h: Mapping[str, Any]) -> str:
    r, out = h["reuse"], h["outputs"]
    cap = f" within decode's {r['cap_s']:g} s retention" if r.get("cap_s") else ""
    gap = f", the longest gap {_s(r['max_gap_s'])}" if r.get("max_gap_s") is not None else ""
    later = (f"; {r['returned_beyond_cap']} came back after it" if r.get("returned_beyond_cap")
             else "")
    same = out["compared"] - out["differ"]
    return (f"ON reused {r['hits_within_cap']} of the {r['returned_within_cap']} turns that "
            f"came back{cap}{gap}{later}. ON and OFF outputs token-identical in {same} of "
            f"{out['compared']} turns ({h['dtype']['dtype']}).")


def policy_text(policies: Mapping[str, str]) -> str:
    on = policies["on"]
    if on == "alwaysDisaggregate":
        text = (f"ON runs `alwaysDisaggregate`, not the default `{DEFAULT_POLICY}`: every "
                "returning turn takes both legs and reads its history back from decode, so "
                "the table measures the read itself, where the default may run a turn whole "
                "on the decode replica that holds it.")
    else:
        text = f"ON runs placement `{on}`."
    if "cost" in policies:
        text += (" TTFT cost: the same trace under placement `cost` (the demo's placement "
                 "run, `make demo-all`).")
    return text


def _fill(text: str) -> str:
    return textwrap.fill(text, WIDTH, break_long_words=False, break_on_hyphens=False)


def render(h: Mapping[str, Any]) -> str:
    """The Markdown between the markers."""
    if h.get("kind") != KIND:
        raise ValueError(f"kind {h.get('kind')!r}: not a headline document ({KIND})")
    columns = [*COLUMNS, *(COST_COLUMNS if "cost" in h["policies"] else [])]
    aims = stats.format_aims([stats.Aim(**a) for a in h["aims"]])
    given = h["run"].get("given")
    source = (f"Written by `make headline` from `{h['source']}`, kept as `{SOURCE}`"
              + ("; its commit, date and policy given to the command, as that bench.json "
                 "predates their record." if given else "."))
    return "\n\n".join([
        _fill(stamp_line(h)),
        table(h["rows"], columns),
        _fill(f"{trace_text(h['trace'])}. {time_text(h)}"),
        "Aims:\n" + aims,
        _fill(reuse_text(h)),
        _fill(policy_text(h["policies"])),
        _fill(source),
    ])


def replace_block(text: str, block: str, name: str) -> str:
    """`text` with what lies between its START and END lines replaced by `block`."""
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line.strip() == START]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ValueError(f"{name}: needs one line {START} and, after it, one line {END}; "
                         f"found {len(starts)} and {len(ends)}")
    return "\n".join([*lines[:starts[0] + 1], block, *lines[ends[0]:]])


def block_of(text: str, name: str) -> str:
    """What lies between the markers of `text` (the inverse of replace_block)."""
    lines = text.split("\n")
    replace_block(text, "", name)  # the same checks
    start = next(i for i, line in enumerate(lines) if line.strip() == START)
    end = next(i for i, line in enumerate(lines) if line.strip() == END)
    return "\n".join(lines[start + 1:end])


def load(path: pathlib.Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a JSON object")
    return doc


def write_pages(source: pathlib.Path, root: pathlib.Path,
                given: Mapping[str, str | None]) -> list[pathlib.Path]:
    """Render `source` (a bench.json, or SOURCE itself) into every page of `root`; every
    page is checked before any is written."""
    doc = load(source)
    if doc.get("kind") == KIND:
        if any(v is not None for v in given.values()):
            raise ValueError(f"{source} is a headline document already: --commit, --date "
                             "and --policy stand in for a bench.json's missing record only")
        headline = doc
    else:
        headline = extract(doc, str(source), given)
    block = render(headline)
    pages = {root / p: replace_block((root / p).read_text(encoding="utf-8"), block, str(p))
             for p in PAGES}
    written = []
    if doc.get("kind") != KIND:
        (root / SOURCE).write_text(json.dumps(headline, indent=2) + "\n", encoding="utf-8")
        written.append(root / SOURCE)
    for path, text in pages.items():
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
