"""What of an extra of the package (pyproject.toml) this install lacks.

The core holds only what every component imports; each command's third-party
dependencies are in its component's extra. A command run without them stops on one line
naming the extra to install, read from the installed package's own metadata, instead of an
ImportError from deep inside the component."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Iterable
from importlib import metadata

DISTRIBUTION = "bidir-kv"
# `bidir-kv serve` runs in vLLM's own image, whose vLLM is that image's build and not the
# `engine` extra's CPU one: what it needs is vLLM, whichever distribution brought it.
ENGINE_EXTRA = "engine"
ENGINE_MODULE = "vllm"

_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")
_EXTRA = re.compile(r"""\bextra\s*==\s*['"]([^'"]+)['"]""")


def normalize(name: str) -> str:
    """A distribution name as packaging compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _parse(line: str) -> tuple[str, list[str], list[str]]:
    """A Requires-Dist line: the name, the extras it asks of that distribution, and the
    extras of this one it belongs to (none: the core)."""
    spec, _, marker = line.partition(";")
    found = _NAME.match(spec)
    if found is None:
        raise ValueError(f"Requires-Dist {line!r}: no distribution name")
    asked = [e.strip() for e in (found.group(2) or "").split(",") if e.strip()]
    return found.group(1), asked, _EXTRA.findall(marker)


def required(requires: Iterable[str], extra: str) -> list[str]:
    """The distributions the core and `extra` bring, in order, following the extras of this
    package an extra names (`bidir-kv[operator,router]`)."""
    parsed = [_parse(line) for line in requires]
    out: list[str] = []
    seen: set[str] = set()
    todo = ["", extra]  # "" is the core: the lines without an extra marker
    while todo:
        current = todo.pop(0)
        if current in seen:
            continue
        seen.add(current)
        for name, asked, extras in parsed:
            if not ((current in extras) if current else not extras):
                continue
            if normalize(name) == normalize(DISTRIBUTION):
                todo.extend(asked)
            elif name not in out:
                out.append(name)
    return out


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def lacking(requires: Iterable[str], extra: str,
            installed: Callable[[str], bool] = _installed) -> list[str]:
    """The distributions of the core and `extra` that are not installed."""
    return [name for name in required(requires, extra) if not installed(name)]


def problem(command: str, extra: str) -> str | None:
    """Why `bidir-kv COMMAND` cannot run in this install, naming the extra to install; None
    when nothing it needs is missing, or when the package has no metadata (run from a
    source tree on PYTHONPATH: its imports then say what is missing)."""
    if extra == ENGINE_EXTRA:
        if importlib.util.find_spec(ENGINE_MODULE) is not None:
            return None
        return (f"bidir-kv {command}: vLLM is not importable here: run it in the engine "
                "image (connector/Dockerfile), or install vLLM's CPU build with the "
                f"'{extra}' extra: pip install 'bidir-kv[{extra}]'")
    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return None
    missing = lacking(requires, extra)
    if not missing:
        return None
    return (f"bidir-kv {command}: needs the '{extra}' extra, and this install lacks "
            f"{', '.join(missing)}: pip install 'bidir-kv[{extra}]' (from a source tree: "
            f"pip install '.[{extra}]')")
