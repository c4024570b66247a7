"""The router's parts declare what they read: no class in the data path reads an
attribute of `self` that it does not define itself (the way mixins share state)."""

from __future__ import annotations

import ast
from pathlib import Path

ROUTER = Path(__file__).resolve().parents[1] / "bidirkv" / "router"
DATAPATH = ROUTER / "datapath"
# What the data path was before it split into the turn's modules, the engine client and
# tracing: the rules on its parts hold in all three.
PARTS = [p for folder in ("datapath", "engine", "tracing")
         for p in sorted((ROUTER / folder).glob("*.py"))]


def undeclared_reads(source: str) -> dict[str, set[str]]:
    """For each class: the `self.X` it uses but neither assigns nor defines, nor
    inherits from a base of its own module."""
    tree = ast.parse(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    own: dict[str, set[str]] = {}
    for name, cls in classes.items():
        names = {f.name for f in cls.body
                 if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
        names |= {t.id for a in cls.body if isinstance(a, ast.Assign | ast.AnnAssign)
                  for t in (a.targets if isinstance(a, ast.Assign) else [a.target])
                  if isinstance(t, ast.Name)}
        slots = next((a.value for a in cls.body if isinstance(a, ast.Assign)
                      and any(isinstance(t, ast.Name) and t.id == "__slots__"
                              for t in a.targets)), None)
        if isinstance(slots, ast.Tuple):
            names |= {e.value for e in slots.elts if isinstance(e, ast.Constant)}
        for node in ast.walk(cls):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign)
                       else [])
            for t in targets:
                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                        and t.value.id == "self"):
                    names.add(t.attr)
        own[name] = names
    out: dict[str, set[str]] = {}
    for name, cls in classes.items():
        if any(not isinstance(b, ast.Name) or b.id not in classes for b in cls.bases
               if not (isinstance(b, ast.Name) and b.id in ("Exception", "object"))):
            continue  # a library base (aiohttp's connector): its attributes are its own
        have = set(own[name])
        for b in cls.bases:
            if isinstance(b, ast.Name) and b.id in own:
                have |= own[b.id]
        used = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id == "self"}
        missing = {u for u in used - have if not u.startswith("__")}
        if missing:
            out[name] = missing
    return out


def test_every_datapath_class_defines_what_it_reads():
    found = {f"{p.name}:{cls}": sorted(names)
             for p in PARTS
             for cls, names in undeclared_reads(p.read_text()).items()}
    assert found == {}


def test_the_router_is_no_mixin():
    tree = ast.parse((DATAPATH / "proxy.py").read_text())
    router = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Router")
    assert router.bases == []


def test_a_mixin_is_caught():
    mixin = '''
class Legs:
    def leg(self):
        return self.session, self.cfg

class Router(Legs):
    def __init__(self):
        self.session = None
'''
    assert undeclared_reads(mixin) == {"Legs": {"session", "cfg"}}


ROUTER_CODE = [*PARTS, *sorted((ROUTER / "server").glob("*.py"))]
# Every module of the router and the operator packages: the sizes a reader holds apply
# to all of them.
BIDIRKV = DATAPATH.parents[1]
SIZED = sorted([*(BIDIRKV / "router").rglob("*.py"), *(BIDIRKV / "operator").rglob("*.py")])


def declaration_table(f: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A function that declares the attributes of self in straight lines (assignments
    and calls only, no branch or loop; most of them `self.x = ...`), such as the
    metrics' constructor: read as a table, not as a flow."""
    if not all(isinstance(s, ast.Assign | ast.AnnAssign | ast.Expr) for s in f.body):
        return False
    on_self = sum(isinstance(s, ast.Assign) and any(
        isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
        for t in s.targets) for s in f.body)
    return on_self * 2 > len(f.body)


def oversized(path: Path) -> list[str]:
    """What in `path` is past the sizes a reader holds: the module over 400 lines, a
    class over 250, a function over 60 (a declaration table aside)."""
    source = path.read_text()
    out = [f"{path.name}: {n} lines"] if (n := source.count("\n")) > 400 else []
    for node in ast.walk(ast.parse(source)):
        limit = 250 if isinstance(node, ast.ClassDef) else 60 if isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef) and not declaration_table(
            node) else None
        if limit is not None and (n := node.end_lineno - node.lineno + 1) > limit:
            out.append(f"{path.name}:{node.name}: {n} lines")
    return out


def test_the_router_and_the_operator_are_sized_for_a_reader():
    assert {str(p.relative_to(BIDIRKV)): o for p in SIZED if (o := oversized(p))} == {}


def test_the_size_check_sees_a_long_function(tmp_path):
    long = tmp_path / "long.py"
    long.write_text("def f():\n" + "    x = 1\n" * 60)
    assert oversized(long) == ["long.py:f: 61 lines"]
    table = tmp_path / "table.py"
    table.write_text("def f(self):\n" + "    self.x = g(1)\n" * 60)
    assert oversized(table) == []
    table.write_text("def f(self):\n" + "    self.x = g(1)\n" * 59 + "    if x:\n        y()\n")
    assert oversized(table) == ["table.py:f: 62 lines"]


def forwarding_properties(source: str) -> list[str]:
    """Properties whose whole body returns an attribute of an attribute of self."""
    out = []
    for cls in ast.walk(ast.parse(source)):
        if not isinstance(cls, ast.ClassDef):
            continue
        for f in cls.body:
            if (isinstance(f, ast.FunctionDef)
                    and any(isinstance(d, ast.Name) and d.id == "property"
                            for d in f.decorator_list)
                    and len(f.body) == 1 and isinstance(f.body[0], ast.Return)
                    and isinstance(v := f.body[0].value, ast.Attribute)
                    and isinstance(v.value, ast.Attribute)
                    and isinstance(v.value.value, ast.Name) and v.value.value.id == "self"):
                out.append(f"{cls.name}.{f.name}")
    return out


def test_no_property_only_forwards():
    found = {p.name: names for p in ROUTER_CODE
             if (names := forwarding_properties(p.read_text()))}
    assert found == {}
    assert forwarding_properties(
        "class R:\n    @property\n    def store(self):\n        return self.ctx.store\n"
    ) == ["R.store"]


def test_no_module_re_exports():
    """A name is imported from the module that defines it: no `__all__` lists names a
    module only imports."""
    assert [p.name for p in ROUTER_CODE if "__all__" in p.read_text()] == []


# The settings a turn's modes are made of (modes.py), read from the config nowhere else.
MODE_SETTINGS = ("bidirectional", "placement", "prefill_only_fallback")


def test_the_modes_are_read_from_the_config_in_one_module():
    readers = sorted(
        f"{p.name}:{node.lineno}" for p in ROUTER_CODE if p.name != "modes.py"
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in MODE_SETTINGS
        and isinstance(node.value, ast.Attribute | ast.Name)
        and (node.value.attr if isinstance(node.value, ast.Attribute)
             else node.value.id) == "cfg")
    assert readers == []


def test_a_reservation_ends_only_in_its_module():
    """The store's single-use ends of a handle are called from reservation.py only."""
    ends = ("consume", "discard", "forget", "release")
    callers = sorted(
        f"{p.name}:{node.lineno}" for p in ROUTER_CODE if p.name != "reservation.py"
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in ends
        and isinstance(node.value, ast.Attribute) and node.value.attr in ("store", "_store"))
    assert callers == []


def turn_writers() -> dict[str, set[str]]:
    """Each field of a `turn` assigned in the data path -> the modules that assign it."""
    out: dict[str, set[str]] = {}
    for p in PARTS:
        for node in ast.walk(ast.parse(p.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign)
                       else [])
            for t in targets:
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if (isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name)
                            and e.value.id == "turn"):
                        out.setdefault(e.attr, set()).add(p.name)
    return out


def test_each_field_of_a_turn_has_one_writer():
    """Past its constructor, a turn's field is written by one module (turn.py says
    which); what its handle holds is changed by reservation.py alone."""
    assert {f: sorted(m) for f, m in turn_writers().items() if len(m) > 1} == {}
    assert turn_writers()["placed"] == {"placing.py"}
    handle_writes = sorted(
        f"{p.name}:{node.lineno}" for p in PARTS
        if p.name != "reservation.py"
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Assign | ast.AugAssign) for t in (
            node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute)
        and t.value.attr == "handle")
    assert handle_writes == []


def modes_readers(source: str) -> list[int]:
    """The lines of `source` that touch an attribute named `modes` (a turn's `Modes`)."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Attribute) and node.attr == "modes")


def test_a_turns_modes_are_read_where_it_is_built_and_where_it_is_placed():
    """A turn's modes are resolved once per turn: admission.py builds the turn from them
    (without reading them back off it: whether its prompt is measured comes before
    placement), turn.py declares the field, conversations.py reads whether the
    conversation is looked up (before placement too), and placing.py makes the turn's
    plan of them. Every other data-path module reads the plan (`turn.plan`) or takes
    what it needs as an argument."""
    found = {p.name for p in PARTS if modes_readers(p.read_text())}
    assert found == {"conversations.py", "placing.py", "turn.py"}
    assert modes_readers("def keeps(turn):\n    return turn.modes.bidirectional\n") == [2]
    # Per turn, modes_of is called where the turn is built; health.py and upkeep.py call
    # it once per round of their loops or probe, never for a turn.
    callers = {p.name for p in PARTS if p.name != "modes.py"
               for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
               and node.func.id == "modes_of"}
    assert callers == {"admission.py", "health.py", "upkeep.py"}


def reuse_writers() -> dict[str, list[str]]:
    """Each module of the data path that assigns an attribute named `reuse` (a turn's
    reuse outcome) -> what it assigns, as written."""
    out: dict[str, list[str]] = {}
    for p in PARTS:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                        if isinstance(e, ast.Attribute) and e.attr == "reuse":
                            out.setdefault(p.name, []).append(ast.unparse(node.value))
    return out


def test_the_reuse_outcome_is_an_enum_written_in_one_module():
    """reservation.py writes a turn's reuse outcome, always a `ReuseOutcome`; its values
    are the labels the metric, the span and the log have always carried."""
    from bidirkv.router.metrics import REUSE_OUTCOMES, Metrics, ReuseOutcome

    writers = reuse_writers()
    assert set(writers) == {"reservation.py"}
    assert sorted(writers["reservation.py"]) == [
        "(entry, LOOKED_UP[status])", "ReuseOutcome.DROPPED", "ReuseOutcome.EXTENDED",
        "ReuseOutcome.OFF", "ReuseOutcome.VERIFIED_PARTIAL"]
    assert [o.value for o in ReuseOutcome] == ["hit", "miss", "expired", "verified-partial",
                                               "dropped", "off", "extended"]
    assert REUSE_OUTCOMES == tuple(ReuseOutcome)
    metrics = Metrics()
    metrics.reuse_outcome(ReuseOutcome.VERIFIED_PARTIAL)
    assert b'bidirkv_router_reuse_total{outcome="verified-partial"} 1.0' in \
        metrics.exposition()[0]
