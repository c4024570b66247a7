"""What the benchmarks that print tables of aims share: the machine they ran on, a table of
rows run in order with each row's aims recorded, the command line's --out (and --rows), and
the JSON and PNG written at the end.

A row is anything with a `name` and its `aims`: (the aim's name, its test of the row's
figures, the figure shown for it). The result is one JSON document: `machine`, then what the
script measured (`rows` for a table), then `aims` (name -> met), which also decide the exit
status.
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from bidirkv.bench import plots
from bidirkv.local.cpu import read_cpu

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "out" / "bench"

Figures = dict[str, Any]
Aim = tuple[str, Callable[[Figures], bool], Callable[[Figures], str]]


class Aimed(Protocol):
    name: str
    aims: list[Aim]


R = TypeVar("R", bound=Aimed)


def machine() -> dict[str, Any]:
    return {**read_cpu().to_json(), "python": platform.python_version()}


def cpu_line(m: dict[str, Any]) -> str:
    """The first line of every printed report: what the figures were taken on."""
    return f"CPU: {m['model']} ({m['arch']}, {m['isa']}), {m['cores']} cores"


def run_rows(rows: Sequence[R], measure: Callable[[R], Figures],
             only: Sequence[str] | None = None) -> dict[str, Any]:
    """Each row (of `only`'s names, when given) measured in the table's order, its figures
    and whether each of its aims holds recorded under the row's name."""
    result: dict[str, Any] = {"machine": machine(), "rows": {}, "aims": {}}
    for row in rows:
        if only and row.name not in only:
            continue
        print(f"{row.name} ...", flush=True)
        figures = measure(row)
        result["rows"][row.name] = figures
        for aim, holds, _ in row.aims:
            result["aims"][f"{row.name}: {aim}"] = holds(figures)
    return result


def parser(doc: str, rows: Sequence[Aimed] = ()) -> argparse.ArgumentParser:
    """The script's parser, its description `doc`'s first line, with --out and, for a
    table of `rows`, --rows (checked against the rows' names by `parse`)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    if rows:
        ap.add_argument("--rows", nargs="+", metavar="NAME",
                        help="run only these rows (their names as printed): "
                             + "; ".join(repr(r.name) for r in rows))
    ap.add_argument("--out", type=Path, default=OUT, help="where the JSON (and PNG) go")
    return ap


def parse(ap: argparse.ArgumentParser, rows: Sequence[Aimed] = ()) -> argparse.Namespace:
    args = ap.parse_args()
    names = [r.name for r in rows]
    for name in getattr(args, "rows", None) or ():
        if name not in names:
            ap.error(f"--rows {name!r}: no such row; the rows are "
                     + ", ".join(repr(n) for n in names))
    return args


def pyplot() -> Any | None:
    """matplotlib's pyplot drawing to files only, or None where matplotlib is not
    installed (the figures are still printed and written as JSON)."""
    try:
        return plots._pyplot()
    except ImportError:
        return None


def finish(result: dict[str, Any], text: str, out: Path, stem: str,
           plot: Callable[[Path], bool], png: Path | None = None) -> int:
    """Print the report `text`, write `stem`.json under `out` and draw the PNG (beside
    it unless `png` names another path); the exit status: 0 when every aim was met."""
    print()
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    doc = out / f"{stem}.json"
    doc.write_text(json.dumps(result, indent=2) + "\n")
    png = png or doc.with_suffix(".png")
    if plot(png):
        print(f"\nwrote {doc} and {png}")
    else:
        why = "matplotlib is missing" if pyplot() is None else "no figure for the rows run"
        print(f"\nwrote {doc} (no PNG: {why})")
    return 0 if all(result["aims"].values()) else 1
