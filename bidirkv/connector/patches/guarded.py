"""Guarded monkeypatching of vLLM internals: a patch waits for its module, applies once,
and can be undone (tests). What a patch may name is a `PatchSite` (connector/targets.py)."""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

from bidirkv.connector.targets import MARK, resolve

log = logging.getLogger("vllm.bidirkv")


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
