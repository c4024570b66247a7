"""The README stays a front door, and every relative link of the docs leads somewhere: the
file exists and, for a `#section` of a Markdown file, so does a heading with that anchor."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                *(ROOT / name / "README.md" for name in ("router", "operator", "connector"))])
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`]*`")
# [text](target) and ![alt](target); the text may wrap onto the next line.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def prose(markdown: str) -> str:
    """The text links and headings can be in: fenced blocks and code spans dropped."""
    return CODE_SPAN.sub("", FENCE.sub("", markdown))


def anchors(markdown: str) -> set[str]:
    """The ids GitHub gives the headings of a Markdown file (repeats get -1, -2, ...)."""
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", markdown)):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def relative_links(page: pathlib.Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def shown(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken(page: pathlib.Path, target: str) -> str | None:
    """Why the link is broken, or None when it resolves."""
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
        return f"{target}: no file {shown(dest)}"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
        return f"{target}: {shown(dest)} has no heading with anchor #{anchor}"
    return None


def test_readme_is_a_front_door():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, at most {README_MAX_LINES}: the rest belongs in docs/")


@pytest.mark.parametrize("page", PAGES, ids=shown)
def test_relative_links_resolve(page):
    problems = [why for t in relative_links(page) if (why := broken(page, t))]
    assert problems == [], f"{shown(page)}: " + "; ".join(problems)


def test_the_checks_catch_what_they_guard(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Set-up: two `make` targets\n\n```sh\n# not a heading\n```\n"
                    "[ok](#set-up-two-make-targets) [gone](missing.md) [bad](#not-a-heading)"
                    " `[code](nowhere.md)` [web](https://example.com/x.md)\n")
    links = relative_links(page)
    assert links == ["#set-up-two-make-targets", "missing.md", "#not-a-heading"]
    assert [broken(page, t) is None for t in links] == [True, False, False]
