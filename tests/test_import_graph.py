"""The package layout, read from the source (AST): import paths are folder paths,
dependencies run one way between the packages and between the layers inside each, and no
module imports itself back, through any path, inside a package or across packages.

An import counts wherever it is written: function bodies and `if TYPE_CHECKING:` blocks
too. A lazy import still makes the two modules depend on each other, and a type-only one
still makes a reader go both ways (and hides a cycle the next refactor turns real)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRODUCT = ROOT / "bidirkv"

# Inside each component, the layers in order: a module may import its own layer and the
# layers before it, never one after it.
LAYERS = {
    "bidirkv.operator": ["api", "kube", "crd", "render", "reconcile", "main"],
    "bidirkv.router": ["codec", "config", "metrics", "tracing", "request", "store", "pool",
                       "engine", "datapath", "server"],
    "bidirkv.connector": ["core", "settings", "targets", "hooks", "nixl", "patches", "plugin",
                          "identity", "bodyread", "endpoint", "drain", "supervise", "launcher"],
}
# The shared modules (bidirkv/*.py) that both sides of the wire use; they import no
# component.
SHARED = ("bidirkv.wire", "bidirkv.proof", "bidirkv.roleconfig", "bidirkv.otlp", "bidirkv.knobs",
          "bidirkv.returns")


def modules() -> dict[str, pathlib.Path]:
    """Every product module by import name, which is its path under the repository root."""
    out = {}
    for f in PRODUCT.rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def imported_names(path: pathlib.Path) -> set[str]:
    """Dotted names an import statement in `path` names (module, or module.attribute)."""
    out: set[str] = set()

    def visit(nodes: list) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                assert not node.level, f"{path}: relative import (write the absolute path)"
                out.add(node.module or "")
                out.update(f"{node.module}.{a.name}" for a in node.names)
            visit(list(ast.iter_child_nodes(node)))

    visit(ast.parse(path.read_text()).body)
    return out


def edges(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """module -> the product modules it imports (a name resolves to its longest module)."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        for dotted in imported_names(path):
            if not dotted.startswith("bidirkv"):
                continue
            while dotted not in mods and "." in dotted:
                dotted = dotted.rsplit(".", 1)[0]
            if dotted in mods and dotted != name:
                deps.add(dotted)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return None


def component(module: str) -> str | None:
    return next((c for c in LAYERS if module == c or module.startswith(c + ".")), None)


def layer(module: str) -> tuple[str, int] | None:
    comp = component(module)
    if comp is None or module == comp:
        return None
    return comp, LAYERS[comp].index(module[len(comp) + 1:].split(".")[0])


GRAPH = edges(modules())


def test_no_import_cycle_anywhere():
    assert find_cycle(GRAPH) is None, " -> ".join(find_cycle(GRAPH) or [])


def test_the_cycle_finder_sees_one_inside_a_package():
    """The store's old shape: the protocol module made the shared store, which imported
    the protocol module back (a function-body import, inside one package)."""
    old = {"bidirkv.router.handlestore": {"bidirkv.router.redisstore", "bidirkv.router.store"},
           "bidirkv.router.redisstore": {"bidirkv.router.handlestore"},
           "bidirkv.router.store": set()}
    assert find_cycle(old) == ["bidirkv.router.handlestore", "bidirkv.router.redisstore",
                               "bidirkv.router.handlestore"]


def test_an_import_for_type_checking_only_counts(tmp_path):
    typed = tmp_path / "typed.py"
    typed.write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                     "    from bidirkv.router.datapath.turn import Turn\n")
    assert "bidirkv.router.datapath.turn" in imported_names(typed)


def test_every_module_sits_in_a_declared_layer():
    for name in GRAPH:
        if component(name) and name != component(name):
            sub = name[len(component(name)) + 1:].split(".")[0]
            assert sub in LAYERS[component(name)], f"{name}: {sub!r} is in no layer"


@pytest.mark.parametrize("comp", sorted(LAYERS))
def test_layers_inside_a_component_run_one_way(comp):
    wrong = []
    for src, deps in GRAPH.items():
        if component(src) != comp or layer(src) is None:
            continue
        for dst in deps:
            if component(dst) == comp and layer(dst) and layer(dst)[1] > layer(src)[1]:
                wrong.append(f"{src} -> {dst}")
    assert not wrong, f"{comp}: a layer imports a later one: {wrong}"


def test_the_components_never_import_each_other():
    """Operator, router and connector meet only in the shared modules."""
    wrong = [f"{src} -> {dst}" for src, deps in GRAPH.items() for dst in deps
             if component(src) and component(dst) and component(src) != component(dst)]
    assert not wrong, wrong


def test_the_shared_modules_import_no_component():
    for name in SHARED:
        assert not [d for d in GRAPH[name] if component(d)], name


def test_package_inits_hold_a_docstring_and_nothing_else():
    """Importing any module runs its packages' __init__ first: empty ones add no edge,
    so the graph above is the whole story. Each says what it owns and must not import."""
    for f in PRODUCT.rglob("__init__.py"):
        tree = ast.parse(f.read_text())
        assert ast.get_docstring(tree), f"{f.relative_to(ROOT)}: no docstring"
        assert len(tree.body) == 1, f"{f.relative_to(ROOT)}: code in a package __init__"


# The classes vLLM loads through kv_connector_module_path: the only product modules that
# import vLLM at module level (its connector factory imports them, inside vLLM).
VLLM_CLASSES = {f"bidirkv.connector.nixl.{m}" for m in ("connector", "scheduler", "worker",
                                                         "stats", "notifs")}


def _top_imports(path: pathlib.Path) -> set[str]:
    top = ast.parse(path.read_text()).body
    mods = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
    for n in top:
        if isinstance(n, ast.ImportFrom):
            mods.add(n.module or "")
            mods |= {f"{n.module}.{a.name}" for a in n.names}  # a submodule, maybe
    return mods


def test_only_the_connector_classes_import_vllm_at_module_level():
    """The rules (core/, hooks/), the plugin, the launcher and everything else import
    without the engine stack; vLLM is touched in patches/ when its module is imported."""
    for name, path in modules().items():
        if name in VLLM_CLASSES:
            continue
        mods = _top_imports(path)
        assert not [m for m in mods if m.split(".")[0] in ("vllm", "torch")], name
        # Nor through the classes: importing the plugin must not import vLLM.
        assert not mods & VLLM_CLASSES, name


def test_the_test_api_server_and_dev_tools_are_not_in_the_product():
    """tests/kubeapi is test code and tools/ development tools: no product module imports
    them at module level (`make demo` borrows the API server from the clone when it runs),
    and the package list of the wheel names only bidirkv."""
    import tomllib

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]
    assert find["include"] == ["bidirkv", "bidirkv.*"]
    for name, path in modules().items():
        top = [n for n in ast.parse(path.read_text()).body
               if isinstance(n, ast.Import | ast.ImportFrom)]
        tops = {a.name.split(".")[0] for n in top if isinstance(n, ast.Import) for a in n.names}
        tops |= {(n.module or "").split(".")[0] for n in top if isinstance(n, ast.ImportFrom)}
        assert not tops & {"kubeapi", "crdref", "tests", "tools"}, name


def test_no_python_file_outside_the_package_shadows_a_module_it_names():
    """The card's folders (operator/, router/, connector/) hold images and docs, no code:
    run from the repository root, `import operator` is the standard library's."""
    for folder in ("operator", "router", "connector"):
        assert not list((ROOT / folder).rglob("*.py")), folder


# The demo, the benchmarks and the local stack: in the package, their third-party imports
# in the `tools` extra. The product runs without them, so none of its modules imports them;
# the command line reaches them only inside the commands that run them.
TOOLS = ("bidirkv.local", "bidirkv.bench", "bidirkv.demo", "bidirkv.democoncurrency",
         "bidirkv.demolong", "bidirkv.demoagents")


def is_tool(module: str) -> bool:
    return any(module == t or module.startswith(t + ".") for t in TOOLS)


def tool_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a tool by a module of the product (the command line aside)."""
    return [f"{src} -> {dst}" for src, deps in sorted(graph.items())
            if not is_tool(src) and src != "bidirkv.cli" for dst in sorted(deps) if is_tool(dst)]


def test_no_product_module_imports_the_tools():
    assert not tool_imports(GRAPH), tool_imports(GRAPH)
    cli = {n for n in _top_imports(PRODUCT / "cli.py") if n.startswith("bidirkv")}
    assert not [n for n in cli if is_tool(n)], cli


def test_the_tools_check_sees_a_product_module_importing_one():
    graph = {**GRAPH, "bidirkv.router.config": GRAPH["bidirkv.router.config"]
             | {"bidirkv.bench.stats"}}
    assert tool_imports(graph) == ["bidirkv.router.config -> bidirkv.bench.stats"]
