"""The wire module is the one home of every key router and plugin exchange, and
docs/protocol.md's table says the same as it (names, values, version)."""

from __future__ import annotations

import ast
import pathlib
import re

from bidirkv import wire

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _doc_table() -> tuple[int, dict[str, str]]:
    text = (ROOT / "docs" / "protocol.md").read_text()
    section = text.split("### Wire version and keys", 1)[1].split("\n### ", 1)[0]
    version = int(re.search(r"Wire version: \*\*(\d+)\*\*", section).group(1))
    rows = re.findall(r"^\| `([A-Z_]+)` \| `([^`]+)` \|", section, flags=re.M)
    return version, dict(rows)


def test_protocol_doc_lists_every_key_with_its_value_and_the_version():
    version, rows = _doc_table()
    assert version == wire.VERSION, "docs/protocol.md names another wire version"
    assert rows == wire.KEYS


def test_values_are_distinct():
    assert len(set(wire.KEYS.values())) == len(wire.KEYS)


def test_no_product_module_spells_a_wire_value_itself():
    """A key written as a literal elsewhere would drift from the module on the next change."""
    values = set(wire.KEYS.values()) - {"wire", "bidirkv"}  # common words, checked by use
    wrong = []
    for f in (ROOT / "bidirkv").rglob("*.py"):
        if f.name == "wire.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and node.value in values:
                wrong.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not wrong, wrong


def test_version_problem_names_both_versions():
    assert wire.version_problem(wire.VERSION, "x") is None
    for other in (None, wire.VERSION + 1, str(wire.VERSION), True):
        problem = wire.version_problem(other, "the leg")
        assert problem and repr(other) in problem and str(wire.VERSION) in problem


def test_protocol_doc_gives_the_count_of_patched_and_overridden_targets():
    from bidirkv.connector import plugin

    text = (ROOT / "docs" / "protocol.md").read_text()
    count = int(re.search(r"The plugin patches \*\*(\d+) targets\*\*", text).group(1))
    assert count == len(plugin.REQUIRED_TARGETS) + len(plugin.OPTIONAL_TARGETS)
    count = int(re.search(r"connector overrides or calls \*\*(\d+) targets\*\*",
                          text).group(1))
    assert count == len(plugin.CONNECTOR_TARGETS)
    total = int(re.search(r"by `tests/test_vllm_next.py`: all (\d+) targets", text).group(1))
    assert total == len(plugin.REQUIRED_TARGETS + plugin.OPTIONAL_TARGETS
                        + plugin.CONNECTOR_TARGETS)
