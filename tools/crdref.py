"""The CRD reference (docs/crd-reference.md), generated from the same schema as the CRD.

A development tool (`make crds` runs it), not part of the package."""

from __future__ import annotations

import pathlib
import re
import sys
from typing import Any

from bidirkv.operator.crd.schema import build_crd

# Where the reference lives, relative to the repository root (tests/test_crd.py reads it).
PAGE = "docs/crd-reference.md"
START, END = "<!-- crd-reference:start -->", "<!-- crd-reference:end -->"


def _type(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "int or string"
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"])
    if node.get("type") == "array":
        return f"list of {_type(node.get('items', {}))}"
    if node.get("type") == "object" and "additionalProperties" in node:
        return f"map of {_type(node['additionalProperties'])}"
    return node.get("type", "object")


def _bounds(node: dict[str, Any]) -> str:
    parts = []
    if "minimum" in node:
        parts.append(f">= {node['minimum']}")
    if "maximum" in node:
        parts.append(f"<= {node['maximum']}")
    if "maxItems" in node:
        parts.append(f"at most {node['maxItems']} items")
    return ", ".join(parts)


def _default(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return '`""`' if value == "" else f"`{value}`"


def _walk(node: dict[str, Any], path: str, required: set[str], out: list[list[str]]) -> None:
    for name, child in node.get("properties", {}).items():
        here = f"{path}.{name}"
        if child.get("type") == "object" and "properties" in child:
            _walk(child, here, set(child.get("required", [])), out)
            continue
        if child.get("type") == "array" and "properties" in child.get("items", {}):
            out.append([f"`{here}`", "list", "", "", child.get("description", "")])
            item = child["items"]
            _walk(item, here + "[]", set(item.get("required", [])), out)
            continue
        shown = "required" if name in required else _default(child.get("default"))
        desc = re.sub(r"\s+", " ", child.get("description", "")).replace("|", "\\|")
        out.append([f"`{here}`", _type(child), shown, _bounds(child), desc])


def _rules(node: dict[str, Any], path: str) -> list[str]:
    """Every CEL rule of the schema, nested ones named by the field they sit on: a rule
    kept beside its fields (e.g. on `spec.router.placement`) is as binding as one on spec."""
    out = [m if path == "spec" else f"`{path}`: {m}"
           for m in (v["message"] for v in node.get("x-kubernetes-validations", []))]
    for name, child in node.get("properties", {}).items():
        out += _rules(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += _rules(node["items"], f"{path}[]")
    return out


def reference_markdown() -> str:
    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rows: list[list[str]] = []
    _walk(spec, "spec", set(spec.get("required", [])), rows)
    lines = ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "## Cross-field rules", "", "Enforced by the API server (CEL):", ""]
    lines += [f"- {rule}" for rule in _rules(spec, "spec")]
    return "\n".join(lines) + "\n"


def splice(page: str) -> str:
    """The page's text with its reference section replaced by the generated one."""
    if START not in page or END not in page:
        raise ValueError(f"the page has no {START} ... {END} section")
    head, rest = page.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{reference_markdown()}{END}{tail}"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: tools/crdref.py {PAGE}", file=sys.stderr)
        return 2
    path = pathlib.Path(argv[0])
    path.write_text(splice(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
