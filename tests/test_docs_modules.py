"""docs/architecture.md's module list is the tree: every module under bidirkv/ is listed
in its "Where things live" table, and nothing listed is missing from disk.

The parse is kept simple, so that moving a file means editing one row: each row's first
cell names one folder under bidirkv/ (`bidirkv/` for the top), and every `name.py` in
backticks in its second cell is a module of that folder (a path with a `/`, such as a
test's, is a reference, not a module). `__init__.py` files are not listed."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "bidirkv"
DOC = ROOT / "docs" / "architecture.md"
SECTION = "## Where things live"
FOLDER = re.compile(r"`([^`]*/)`")
MODULE = re.compile(r"`([A-Za-z_]\w*\.py)`")


def modules_on_disk(package: pathlib.Path) -> set[str]:
    """Every module under `package`, as its path relative to it."""
    return {p.relative_to(package).as_posix() for p in package.rglob("*.py")
            if p.name != "__init__.py" and "__pycache__" not in p.parts}


def listed_modules(markdown: str) -> set[str]:
    """The modules the section's table lists, as paths relative to bidirkv/."""
    _, found, rest = markdown.partition(SECTION + "\n")
    assert found, f"no heading {SECTION!r}"
    listed: set[str] = set()
    for line in rest.split("\n## ")[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or not cells[0].startswith("`"):
            continue  # prose, the header, the separator
        folders = FOLDER.findall(cells[0])
        assert len(folders) == 1 and FOLDER.fullmatch(cells[0]), (
            f"row {cells[0]!r}: its first cell must name one folder, e.g. `router/pool/`")
        prefix = "" if folders[0] == "bidirkv/" else folders[0]
        listed |= {prefix + name for name in MODULE.findall(cells[1])}
    return listed


def test_architecture_lists_every_module_and_only_those():
    on_disk, listed = modules_on_disk(PACKAGE), listed_modules(DOC.read_text())
    assert sorted(on_disk - listed) == [], "modules docs/architecture.md does not list"
    assert sorted(listed - on_disk) == [], "docs/architecture.md lists modules not on disk"


def test_the_parse_reads_rows_as_written(tmp_path):
    doc = ("# A\n\n## Where things live\n\n| package | modules |\n|---|---|\n"
           "| `bidirkv/` | `cli.py` (the `bidir-kv` command), `knobs.py` |\n"
           "| `router/pool/` | `placement.py` with `Plan`, as `tests/test_x.py` checks |\n"
           "\n## Layers\n\n| `bench/` | `gone.py` |\n")
    assert listed_modules(doc) == {"cli.py", "knobs.py", "router/pool/placement.py"}
    (tmp_path / "router").mkdir()
    for name in ("cli.py", "__init__.py", "router/__init__.py", "router/moved.py"):
        (tmp_path / name).write_text("")
    assert modules_on_disk(tmp_path) == {"cli.py", "router/moved.py"}
    with pytest.raises(AssertionError, match="must name one folder"):
        listed_modules("## Where things live\n| `local/`, `bench/` | `cli.py` |\n")
