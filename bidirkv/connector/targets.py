"""What of vLLM the connector relies on, and the check that every piece is there.

Every global patch (patches/) and every override of bidir-kv's NIXL classes (nixl/)
names the vLLM attributes it replaces or calls, with their parameters (`PatchSite`), and the
release line they were read against. The launcher checks all of them before vLLM starts
and refuses to start when one is missing or changed (`site_problems`); inside vLLM a
patch that cannot apply stops the process (plugin.py): without them reuse would run on
vLLM's trust, unverified and unauthenticated (fail closed). No vLLM import at module level.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

# Release lines whose internals the patches were read against.
SUPPORTED_VLLM = ("0.32.", "0.33.")
MARK = "__bidirkv_patch__"


class Skip(Exception):
    """A patch cannot apply here; the message says why (logged once)."""


def vllm_supported(version: str) -> bool:
    return version.startswith(SUPPORTED_VLLM)


@dataclass(frozen=True)
class PatchSite:
    """`module:qualname`, and the parameter names a patch relies on (None: not callable,
    or any signature)."""

    module: str
    qualname: str
    params: tuple[str, ...] | None = None

    def __str__(self) -> str:
        return f"{self.module}.{self.qualname}"


def site_problem(t: PatchSite) -> str | None:
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


def site_problems(targets: list[PatchSite]) -> list[str]:
    return [p for t in targets if (p := site_problem(t)) is not None]


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
