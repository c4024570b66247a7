"""README's headline is written from a run's JSON, never typed in: the renderer on a small
run built by the benchmark's own report code, the markers it writes between, the command
end to end, and README.md and docs/benchmarks.md holding exactly what the command renders
from the JSON they name (docs/headline.json)."""

from __future__ import annotations

import json
import pathlib

import pytest

from bidirkv import cli
from bidirkv.bench import headline, report, stats, turns
from bidirkv.bench.runner import BenchConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
THINK = turns.Think(min_s=1.0, max_s=5.0, pause_s=35.0, pause_turns=(2,))
CPU = {"model": "Test CPU", "arch": "x86_64", "isa": "avx2", "cores": 2, "avx512f": False}
DTYPE = {"dtype": "float32", "picked": True, "reason": "no native bf16"}
STAMP = {"commit": "abc1234", "uncommitted_changes": False, "date": "2026-12-07",
         "started": "2026-12-07T10:00:00+00:00", "wall_s": 300.0, "before_demo_s": 20.0,
         "phases": [{"phase": "tiny model", "wall_s": 5.0}]}


def record(turn: int, ttft: float, *, bound: float | None = None, read: float = 0.0,
           reused: float = 0.0, reason: str = "hit") -> dict:
    return {"conversation": 0, "turn": turn, "ttft_s": ttft, "context_tokens": 1000 * turn,
            "lower_bound_s": bound, "gap_s": None if turn == 1 else 4.2,
            "text_sha": f"t{turn}", "reason": "first turn" if turn == 1 else reason,
            "metrics": {"p_transfer_s": read, "p_external_hit_tokens": reused,
                        "p_transfer_bytes": reused * 4096}}


def run(label: str, records: list[dict], policy: str | None, wall_s: float) -> dict:
    doc = {"kind": report.RUN_KIND, "wall_s": wall_s,
           "config": report.config_json(BenchConfig(url="http://x", label=label, turns=2,
                                                    conversations=1, think=THINK)),
           "reuse_reasons": turns.summary(records, 480), "per_turn": stats.per_turn(records),
           "records": records}
    if policy is not None:
        doc["placement_policy"] = policy
    return doc


def bench(*, stamped: bool = True, policies: bool = True, cost: bool = False) -> dict:
    """A `make demo` comparison, as the demo builds it, through JSON as it is read back."""
    policy = "alwaysDisaggregate" if policies else None
    on = run("on", [record(1, 0.2), record(2, 0.3, read=0.004, reused=1024)], policy, 60.0)
    off = run("off", [record(1, 0.2, bound=0.18), record(2, 0.9, bound=0.28, reason="off")],
              policy, 90.0)
    extra = {"cpu": CPU, "dtype": DTYPE, **({"run": STAMP} if stamped else {})}
    cost_run = (run("cost", [record(1, 0.1), record(2, 0.29, reason="extended")],
                    "cost" if policies else None, 50.0) if cost else None)
    return json.loads(json.dumps(report.compare_document(on, off, extra, cost=cost_run)))


TABLE = (
    "| turn | context | gap | TTFT ON | TTFT OFF | OFF/ON | lower bound | ON/bound "
    "| KV read D->P | tokens reused | read |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|\n"
    "| 1 | 1000 | - | 200 ms | 200 ms | 1.00x | 180 ms | 1.11x | 0 ms | 0 | 0.0 MB |\n"
    "| 2 | 2000 | 4 s | 300 ms | 900 ms | 3.00x | 280 ms | 1.07x | 4 ms | 1024 | 4.2 MB |")
AIMS = (
    "Aims:\n"
    "- OFF/ON >= 3x at >= 8000 tokens: not measured (no turn reached 8000 tokens of context)\n"
    "- ON <= 1.3x lower bound at >= 4000 tokens: not measured (no turn with a lower bound at "
    ">= 4000 tokens)")
EXPECTED = f"""\
**Commit abc1234, 2026-12-07; Test CPU, 2 cores (x86_64: avx2); float32 (picked for this
CPU); ON and OFF under placement `alwaysDisaggregate`:**

{TABLE}

1 conversation x 2 turns, +1000 user tokens and 48 output tokens a turn, 1-5 s think time
+35 s before turn 2 (seeded); median over conversations. Time: `make demo` 320 s: 20 s
before the demo (installing, where it had to), then the demo 300 s, of which the benchmark
runs ON 60 s, OFF with the lower bound 90 s.

{AIMS}

ON reused 1 of the 1 turns that came back within decode's 480 s retention, the longest gap
4 s. ON and OFF outputs token-identical in 2 of 2 turns (float32).

ON runs `alwaysDisaggregate`, not the default `cost`: every returning turn takes both legs
and reads its history back from decode, so the table measures the read itself, where the
default may run a turn whole on the decode replica that holds it.

Written by `make headline` from `out/demo/bench.json`, kept as `docs/headline.json`."""


def test_the_table_is_rendered_from_the_runs_json():
    assert headline.render(headline.extract(bench(), "out/demo/bench.json")) == EXPECTED


def test_a_placement_run_adds_its_columns_and_says_which_policy_each_shows():
    text = headline.render(headline.extract(bench(cost=True), "b.json"))
    assert "| read | TTFT cost | cost/bound |" in text
    assert "| 2 | 2000 | 4 s | 300 ms | 900 ms | 3.00x | 280 ms | 1.07x | 4 ms | 1024 | 4.2 MB " \
           "| 290 ms | 1.04x |" in text
    prose = " ".join(text.split())
    assert "TTFT cost: the same trace under placement `cost`" in prose
    assert "placement cost: TTFT p50 within 1.1x of the aggregated bound" in prose


def test_a_run_without_make_or_with_uncommitted_changes_says_so():
    doc = bench()
    doc["run"] = {**STAMP, "before_demo_s": None, "uncommitted_changes": True}
    text = headline.render(headline.extract(doc, "b.json"))
    assert text.startswith("**Commit abc1234 with uncommitted changes, 2026-12-07;")
    assert "Time: the demo 300 s (run without make), of which" in " ".join(text.split())


def test_a_json_without_its_record_takes_it_from_the_command_line_and_says_so():
    old = bench(stamped=False, policies=False)
    with pytest.raises(ValueError, match="records no run .*give --commit and --date"):
        headline.extract(old, "b.json", {"commit": "abc1234"})
    with pytest.raises(ValueError, match="runs.on records no placement policy.*--policy"):
        headline.extract(old, "b.json", {"commit": "abc1234", "date": "2026-12-07"})
    given = {"commit": "abc1234", "date": "2026-12-07", "policy": "alwaysDisaggregate"}
    text = " ".join(headline.render(headline.extract(old, "b.json", given)).split())
    assert text.startswith("**Commit abc1234, 2026-12-07;")
    assert "the demo's whole time is not in this run's JSON" in text
    assert "its commit, date and policy given to the command" in text


@pytest.mark.parametrize(("doc", "given", "message"), [
    ({"kind": "other"}, {}, r"b.json: kind 'other', not a `make demo` comparison"),
    ({"kind": report.COMPARE_KIND}, {}, r"b.json: no field runs: not the JSON"),
    (bench(stamped=False), {"commit": "HEAD", "date": "2026-12-07"},
     r"--commit 'HEAD': a commit is 7-40 lowercase hex digits"),
    (bench(stamped=False), {"commit": "abc1234", "date": "7 Dec"},
     r"--date '7 Dec': a date is YYYY-MM-DD"),
    (bench(), {"date": "2026-12-01"}, r"records its run \(commit abc1234, 2026-12-07\): --date"),
    (bench(), {"policy": "cost"}, r"runs.on records its policy 'alwaysDisaggregate'"),
    (bench(stamped=False, policies=False),
     {"commit": "abc1234", "date": "2026-12-07", "policy": "nearest"},
     r"--policy 'nearest': one of cost, alwaysDisaggregate, thresholds"),
])
def test_bad_input_is_named(doc, given, message):
    with pytest.raises(ValueError, match=message):
        headline.extract(doc, "b.json", given)


def test_the_block_between_the_markers_is_replaced_and_nothing_else():
    page = f"intro\n{headline.START}\nold\nlines\n{headline.END}\noutro\n"
    new = headline.replace_block(page, "new", "page.md")
    assert new == f"intro\n{headline.START}\nnew\n{headline.END}\noutro\n"
    assert headline.block_of(new, "page.md") == "new"
    assert headline.replace_block(new, "new", "page.md") == new
    for bad in ("no markers", f"{headline.START}\n{headline.START}\n{headline.END}",
                f"{headline.END}\nx\n{headline.START}"):
        with pytest.raises(ValueError, match="page.md: needs one line <!-- headline:start -->"):
            headline.replace_block(bad, "new", "page.md")


@pytest.mark.parametrize("page", headline.PAGES, ids=str)
def test_the_pages_hold_what_the_command_renders_from_the_json_they_name(page):
    source = headline.load(ROOT / headline.SOURCE)
    block = headline.block_of((ROOT / page).read_text(), str(page))
    assert block == headline.render(source), (
        f"{page}'s headline differs from what `make headline` renders from "
        f"{headline.SOURCE}: run `bidir-kv bench --headline {headline.SOURCE}`, never edit "
        "the block by hand")


def test_the_command_writes_the_json_and_every_page(tmp_path, monkeypatch, capsys):
    (tmp_path / "docs").mkdir()
    for page in headline.PAGES:
        (tmp_path / page).write_text(f"# {page}\n{headline.START}\n{headline.END}\n")
    (tmp_path / "bench.json").write_text(json.dumps(bench()))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--headline", "bench.json"]) == 0
    kept = json.loads((tmp_path / headline.SOURCE).read_text())
    assert kept["run"]["commit"] == "abc1234" and kept["source"] == "bench.json"
    for page in headline.PAGES:
        assert headline.block_of((tmp_path / page).read_text(), str(page)) == \
            headline.render(kept)
    # Rendering again from the kept JSON changes nothing; a page without markers stops the
    # command before any file is written.
    assert cli.main(["bench", "--headline", str(headline.SOURCE)]) == 0
    (tmp_path / "docs" / "benchmarks.md").write_text("no markers\n")
    readme = (tmp_path / "README.md").read_text()
    capsys.readouterr()
    assert cli.main(["bench", "--headline", "bench.json"]) == 1
    assert "docs/benchmarks.md: needs one line" in capsys.readouterr().err
    assert (tmp_path / "README.md").read_text() == readme
