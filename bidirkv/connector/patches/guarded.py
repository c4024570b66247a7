"""Guarded monkeypatching of vLLM internals, and the check that every target is there.

Every patch names the vLLM release line it was written against and the attributes it
replaces, with their parameters (`Target`). The launcher checks all of them before vLLM
starts and refuses to start when one is missing or changed (`target_problems`); inside
vLLM a patch that cannot apply stops the process (plugin.py): without them reuse would
run on vLLM's trust, unverified and unauthenticated (fail closed).
"""

from __future__ import annotations

import importlib
import importlib.abc
import inspect
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("vllm.bidirkv")

# Release lines whose internals the patches were read against.
SUPPORTED_VLLM = ("0.32.",)
MARK = "__bidirkv_patch__"


class Skip(Exception):
    """A patch cannot apply here; the message says why (logged once)."""


def vllm_supported(version: str) -> bool:
    return version.startswith(SUPPORTED_VLLM)


@dataclass(frozen=True)
class Target:
    """`module:qualname`, and the parameter names a patch relies on (None: not callable,
    or any signature)."""

    module: str
    qualname: str
    params: tuple[str, ...] | None = None

    def __str__(self) -> str:
        return f"{self.module}.{self.qualname}"


def target_problem(t: Target) -> str | None:
    """Why this target cannot be patched as written (None: it can)."""
    try:
        _, _, obj = resolve(t.module, t.qualname)
    except Skip as exc:
        return str(exc)
    if t.params is None:
        return None
    try:
        names = tuple(inspect.signature(inspect.unwrap(obj)).parameters)
    except (TypeError, ValueError):
        return f"{t}: no inspectable signature"
    if names[: len(t.params)] != t.params:
        return f"{t}: parameters ({', '.join(names)}) are not ({', '.join(t.params)})"
    return None


def target_problems(targets: list[Target]) -> list[str]:
    return [p for t in targets if (p := target_problem(t)) is not None]


def resolve(module: str, qualname: str) -> tuple[Any, str, Any]:
    """(owner, attribute name, current value) of `module:qualname`, or Skip."""
    try:
        owner: Any = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure means: not here
        raise Skip(f"cannot import {module} ({type(exc).__name__}: {exc})") from None
    *path, attr = qualname.split(".")
    for name in path:
        owner = getattr(owner, name, None)
        if owner is None:
            raise Skip(f"{module}.{qualname} not found")
    if not hasattr(owner, attr):
        raise Skip(f"{module}.{qualname} not found")
    return owner, attr, getattr(owner, attr)


def wrap(module: str, qualname: str, make: Callable[[Any], Any]) -> bool:
    """Replace `module:qualname` by `make(original)`; False if it was already patched."""
    owner, attr, orig = resolve(module, qualname)
    if getattr(orig, MARK, False):
        return False
    new = make(orig)
    setattr(new, MARK, True)
    if not hasattr(new, "__wrapped__"):
        new.__wrapped__ = orig
    setattr(owner, attr, new)
    return True


def unwrap(module: str, qualname: str) -> None:
    """Undo `wrap` (tests)."""
    owner, attr, cur = resolve(module, qualname)
    if getattr(cur, MARK, False):
        setattr(owner, attr, cur.__wrapped__)


# Patches wait for their module: a process that never imports the NIXL connector (the
# API server) or the serving layer (the engine core) never pays for importing them.
_pending: dict[str, list[Callable[[], None]]] = {}
_lock = threading.RLock()


def _run(name: str) -> None:
    with _lock:
        hooks = _pending.pop(name, [])
    for hook in hooks:
        hook()


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, name: str) -> None:
        self.inner, self.name = inner, name

    def create_module(self, spec):  # noqa: ANN001 - importlib protocol
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:  # noqa: ANN001 - importlib protocol
        self.inner.exec_module(module)
        _run(self.name)

    def __getattr__(self, attr: str) -> Any:  # get_source, is_package, ...
        return getattr(self.inner, attr)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # noqa: ANN001, ANN201
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


_finder = _Finder()


def when_imported(module: str, hook: Callable[[], None]) -> None:
    """Run `hook` once `module` is imported: now if it already is."""
    if module in sys.modules:
        hook()
        return
    with _lock:
        _pending.setdefault(module, []).append(hook)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
