"""What a demo run records of itself in bench.json (bidirkv/bench/stamp.py), and the spec
settings each run's JSON names (bidirkv/demo.py): what README's headline is written from."""

from __future__ import annotations

import json
import subprocess

import pytest

from bidirkv import demo
from bidirkv.bench import stamp
from bidirkv.local.plan import local_spec, merge_patch, read_spec_file


def test_make_started_is_read_from_the_environment():
    assert stamp.make_started({}) is None
    assert stamp.make_started({stamp.MAKE_STARTED_ENV: ""}) is None
    assert stamp.make_started({stamp.MAKE_STARTED_ENV: "1796564233"}) == 1796564233.0
    for bad in ("yesterday", "-5"):
        with pytest.raises(ValueError, match=f"BIDIRKV_MAKE_STARTED='{bad}': not a time in "
                           "seconds since the epoch"):
            stamp.make_started({stamp.MAKE_STARTED_ENV: bad})


def test_the_record_has_the_commit_date_and_times():
    clock = stamp.Clock(started=1796564240.0, make_started=1796564233.0,
                        phases=[("tiny model", 4.04)])
    rec = stamp.run_stamp(clock, "abc1234", False)
    assert rec["commit"] == "abc1234" and rec["uncommitted_changes"] is False
    assert rec["date"] == "2026-12-06" and rec["started"] == "2026-12-06T13:37:20+00:00"
    assert rec["before_demo_s"] == 7.0 and rec["wall_s"] >= 0
    assert rec["phases"] == [{"phase": "tiny model", "wall_s": 4.0}]
    assert stamp.run_stamp(stamp.Clock(), None, None)["before_demo_s"] is None


def git(cwd, *args):
    subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True,
                   timeout=30)


def test_the_commit_and_uncommitted_changes_are_read_from_git(tmp_path):
    assert stamp.git_commit(tmp_path) == (None, None)
    git(tmp_path, "init", "-q")
    (tmp_path / "f").write_text("a\n")
    git(tmp_path, "add", "f")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "f")
    commit, changed = stamp.git_commit(tmp_path)
    assert len(commit) == 7 and changed is False
    (tmp_path / "new").write_text("untracked files are not the run's code\n")
    assert stamp.git_commit(tmp_path) == (commit, False)
    (tmp_path / "f").write_text("b\n")
    assert stamp.git_commit(tmp_path) == (commit, True)


def test_restamp_replaces_the_record_only(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": [1], "run": {"wall_s": 1}}))
    stamp.restamp(path, {"wall_s": 2})
    assert json.loads(path.read_text()) == {"rows": [1], "run": {"wall_s": 2}}


def test_each_run_records_the_policy_and_transfer_its_stack_ran(tmp_path):
    raw = read_spec_file(demo.SPEC)
    raw["model"]["name"] = str(tmp_path)
    assert demo.run_settings(local_spec(raw, tmp_path)) == {
        "placement_policy": "cost", "bidirectional": True}
    off = merge_patch(raw, {"kvTransfer": {"bidirectional": False}, **demo.ALWAYS_DISAGGREGATE})
    assert demo.run_settings(local_spec(off, tmp_path)) == {
        "placement_policy": "alwaysDisaggregate", "bidirectional": False}


def test_a_phase_is_announced_and_timed_however_it_ends():
    clock = stamp.Clock()
    said: list[str] = []
    assert clock.timed("tiny model: build", lambda: 7, said.append) == 7

    def fails():
        raise ValueError("no stack")

    with pytest.raises(ValueError):
        clock.timed("bidirectional ON", fails, said.append)
    assert said == ["tiny model: build", "bidirectional ON"]
    assert [name for name, _ in clock.phases] == ["tiny model", "bidirectional ON"]
    assert clock.done().startswith("done in ") and "tiny model 0 s" in clock.done()
