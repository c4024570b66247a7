"""The router's parts declare what they read: no class in the data path reads an
attribute of `self` that it does not define itself (the way mixins share state)."""

from __future__ import annotations

import ast
from pathlib import Path

DATAPATH = Path(__file__).resolve().parents[1] / "bidirkv" / "router" / "datapath"


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
             for p in sorted(DATAPATH.glob("*.py"))
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
