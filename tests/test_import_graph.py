"""Dependencies run one way: operator -> role config <- connector; the router depends on
neither; no cycle between the product's packages. Read from the source (AST), so an
import added anywhere at module level is seen, except under `if TYPE_CHECKING:`."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {  # import name -> folder
    "bidirkv.operator": ROOT / "operator",
    "bidirkv.connector": ROOT / "connector",
    "bidirkv.router": ROOT / "router",
}
GROUPS = ("bidirkv.operator", "bidirkv.connector", "bidirkv.router")


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in folder.glob("*.py"):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    for f in (ROOT / "bidirkv").glob("*.py"):
        out["bidirkv" if f.stem == "__init__" else f"bidirkv.{f.stem}"] = f
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(name: str, path: pathlib.Path) -> set[str]:
    """Modules `name` imports at run time (function bodies included, TYPE_CHECKING not)."""
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    out: set[str] = set()

    def visit(nodes: list[ast.stmt] | list[ast.AST]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _type_checking(node):
                continue
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    mod = f"{base}.{node.module}" if node.module else base
                else:
                    mod = node.module or ""
                out.add(mod)
                out.update(f"{mod}.{a.name}" for a in node.names)
            visit(list(ast.iter_child_nodes(node)))

    visit(ast.parse(path.read_text()).body)
    return {m for m in out if m.startswith("bidirkv")}


def group_of(module: str) -> str:
    for g in GROUPS:
        if module == g or module.startswith(g + "."):
            return g
    return module  # a bidirkv.* module is its own node


def edges() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        src = group_of(name)
        for dep in imports(name, path):
            dst = group_of(dep if dep in mods or group_of(dep) in GROUPS
                           else dep.rsplit(".", 1)[0])
            if dst != src:
                graph.setdefault(src, set()).add(dst)
    return graph


def test_the_connector_and_the_router_never_import_the_operator():
    g = edges()
    assert "bidirkv.operator" not in g.get("bidirkv.connector", set())
    assert not {"bidirkv.operator", "bidirkv.connector"} & g.get("bidirkv.router", set())
    # The role's server configuration is owned by neither side.
    assert not {"bidirkv.operator", "bidirkv.connector"} & g.get("bidirkv.roleconfig", set())


def test_no_cycle_between_the_packages():
    g = edges()
    seen: dict[str, int] = {}  # 1: on the stack, 2: done

    def walk(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(g.get(node, ())):
            if seen.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path, node, nxt]))
            if nxt not in seen:
                walk(nxt, [*path, node])
        seen[node] = 2

    for node in sorted(g):
        if node not in seen:
            walk(node, [])


def test_the_test_api_server_is_not_in_the_product():
    """tests/kubeapi is test code: no product module imports it at module level, and the
    package list of the wheel does not name it (`make demo` borrows it from the clone)."""
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]
    assert not [p for p in packages if "testing" in p or "kubeapi" in p]
    for name, path in modules().items():
        top = [n for n in ast.parse(path.read_text()).body
               if isinstance(n, ast.Import | ast.ImportFrom)]
        mods = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module or "" for n in top if isinstance(n, ast.ImportFrom)}
        assert not any(m.split(".")[0] == "kubeapi" for m in mods), name
