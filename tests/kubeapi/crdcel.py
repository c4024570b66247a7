"""CEL evaluation for ``x-kubernetes-validations`` on top of cel-python (``celpy``).

What the apiserver has and this module adds: heterogeneous numeric comparison (``1 == 1.0``,
``int < double``), the Kubernetes string library (``lowerAscii``, ``upperAscii``, ``trim``,
``replace``, ``split``, ``join``, ``indexOf``, ``lastIndexOf``, ``substring``, ``charAt``), the list
library (``isSorted``, ``sum``, ``min``, ``max``, ``indexOf``, ``lastIndexOf``), the regex library
(``find``, ``findAll``), schema-aware typing (``integer`` -> int, ``number`` -> double,
``format: date-time``/``date`` -> timestamp, ``duration`` -> duration, ``byte`` -> bytes) and the
property-name escaping (``__dash__``, ``__dot__``, ``__slash__``, ``__underscores__``,
``__<keyword>__``).

Missing (rules using them are skipped with a warning, or reported with ``strict=True``):
``quantity()``, ``url()``, ``ip()``/``cidr()``, ``format()``, ``semver()``, the authorizer,
optionals (``?.``, ``optional.of``, ``optionalOldSelf``), two-variable comprehensions, and
cost-budget enforcement. Regexes use Python's ``re`` (RE2 and ``re`` agree on common patterns).
"""

from __future__ import annotations

import base64
import logging
import re
from typing import Any

import celpy
import celpy.celtypes as ct
from celpy.evaluation import CELEvalError, base_functions

__all__ = ["CelError", "CelUnsupported", "compile_rule", "evaluate", "to_cel", "uses_old_self"]


class CelError(Exception):
    """Compilation or evaluation failed (the rule itself is broken or hit a runtime error)."""


class CelUnsupported(CelError):
    """The rule needs a function that cel-python and this module do not provide."""


# celpy logs whole activations at DEBUG on every evaluation: slow, and it floods test logs.
logging.getLogger("celpy").setLevel(logging.INFO)
_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}
_OLD_SELF = re.compile(r"\boldSelf\b")


def _num(x: Any) -> bool:
    return isinstance(x, ct.IntType | ct.UintType | ct.DoubleType) and not isinstance(x, bool)


def _cross_numeric(name: str, op):
    base = base_functions[name]

    def plain(x):  # celtypes refuse mixed-type operators; Python numbers compare exactly
        return float(x) if isinstance(x, float) else int(x)

    def compare(a, b):
        if _num(a) and _num(b) and type(a) is not type(b):
            return ct.BoolType(op(plain(a), plain(b)))
        return base(a, b)

    return compare


def _str_fn(fn):
    def wrapped(s, *args):
        if not isinstance(s, str):
            raise TypeError(f"no such overload for {type(s).__name__}")
        return fn(s, *args)

    return wrapped


def _to_list(items) -> ct.ListType:
    return ct.ListType([ct.StringType(i) if isinstance(i, str) else i for i in items])


def _index_of(x, item, start=None):
    if isinstance(x, str):
        return ct.IntType(x.find(item, int(start or 0)))
    try:
        return ct.IntType(list(x).index(item))
    except ValueError:
        return ct.IntType(-1)


def _last_index_of(x, item):
    if isinstance(x, str):
        return ct.IntType(x.rfind(item))
    positions = [i for i, v in enumerate(x) if v == item]
    return ct.IntType(positions[-1] if positions else -1)


def _split(s, sep, limit=None):
    n = int(limit) if limit is not None else -1
    if n == 0:
        return ct.ListType([])
    return _to_list(s.split(sep, n - 1) if n > 0 else s.split(sep))


def _replace(s, old, new, limit=None):
    return ct.StringType(s.replace(old, new, int(limit) if limit is not None else -1))


def _find_all(s, pattern, limit=None):
    found = [m.group(0) for m in re.finditer(pattern, s)]
    if limit is not None and int(limit) >= 0:
        found = found[: int(limit)]
    return _to_list(found)


def _find(s, pattern):
    m = re.search(pattern, s)
    return ct.StringType(m.group(0) if m else "")


_FUNCTIONS = {
    "_==_": _cross_numeric("_==_", lambda a, b: a == b),
    "_!=_": _cross_numeric("_!=_", lambda a, b: a != b),
    "_<_": _cross_numeric("_<_", lambda a, b: a < b),
    "_<=_": _cross_numeric("_<=_", lambda a, b: a <= b),
    "_>_": _cross_numeric("_>_", lambda a, b: a > b),
    "_>=_": _cross_numeric("_>=_", lambda a, b: a >= b),
    "lowerAscii": _str_fn(lambda s: ct.StringType(s.lower())),
    "upperAscii": _str_fn(lambda s: ct.StringType(s.upper())),
    "trim": _str_fn(lambda s: ct.StringType(s.strip())),
    "replace": _str_fn(_replace),
    "split": _str_fn(_split),
    "substring": _str_fn(lambda s, a, b=None: ct.StringType(s[int(a): None if b is None
                                                                  else int(b)])),
    "charAt": _str_fn(lambda s, i: ct.StringType(s[int(i): int(i) + 1])),
    "find": _str_fn(_find),
    "findAll": _str_fn(_find_all),
    "join": lambda lst, sep="": ct.StringType(str(sep).join(str(x) for x in lst)),
    "indexOf": _index_of,
    "lastIndexOf": _last_index_of,
    "isSorted": lambda lst: ct.BoolType(all(a <= b for a, b in zip(lst, list(lst)[1:],
                                                                   strict=False))),
    "sum": lambda lst: sum(lst[1:], lst[0]) if len(lst) else ct.IntType(0),
    "min": lambda lst: min(lst),
    "max": lambda lst: max(lst),
}

_CEL_KEYWORDS = {
    "true", "false", "null", "in", "as", "break", "const", "continue", "else", "for",
    "function", "if", "import", "let", "loop", "package", "namespace", "return", "var",
    "void", "while",
}


def escape_property(name: str) -> str:
    """Kubernetes' escaping of property names so that ``self.some-field`` parses."""
    if name in _CEL_KEYWORDS:
        return f"__{name}__"
    return (name.replace("__", "__underscores__").replace(".", "__dot__")
            .replace("-", "__dash__").replace("/", "__slash__"))


def uses_old_self(rule: str) -> bool:
    return bool(_OLD_SELF.search(rule))


def compile_rule(rule: str):
    program = _PROGRAMS.get(rule)
    if program is None:
        try:
            ast = _ENV.compile(rule)
        except Exception as exc:  # celpy raises lark and CELParseError variants
            raise CelError(f"compilation failed: {str(exc).splitlines()[0]}") from exc
        program = _ENV.program(ast, functions=_FUNCTIONS)
        _PROGRAMS[rule] = program
    return program


def evaluate(rule: str, activation: dict[str, Any]) -> Any:
    program = compile_rule(rule)
    try:
        return program.evaluate(activation)
    except CELEvalError as exc:
        message = str(exc.args[0]) if exc.args else "evaluation error"
        if message.startswith("undeclared reference"):
            name = exc.args[2][0] if len(exc.args) > 2 and exc.args[2] else "?"
            raise CelUnsupported(f"unsupported CEL function or identifier {name!r}") from exc
        if message.startswith("no such member in mapping"):
            message = "no such key: " + message.split(":", 1)[1].strip().strip("'")
        raise CelError(message.split(" (in activation")[0]) from exc
    except RecursionError as exc:
        raise CelError("expression too deep") from exc


def _to_timestamp(value: str) -> Any:
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", value):
        value += "T00:00:00Z"
    return ct.TimestampType(value)


def _string_to_cel(value: str, fmt: str | None) -> Any:
    try:
        if fmt in ("date-time", "date"):
            return _to_timestamp(value)
        if fmt == "duration":
            return ct.DurationType(value)
        if fmt == "byte":
            return ct.BytesType(base64.b64decode(value))
    except Exception:  # an invalid value is already reported by schema validation
        pass
    return ct.StringType(value)


def to_cel(value: Any, schema: dict | None) -> Any:
    """Convert JSON to CEL values following the schema: integral JSON numbers declared
    ``integer`` become CEL ints, ``number`` becomes double even when the JSON was ``3``."""
    schema = schema or {}
    if value is None:
        return None
    if isinstance(value, bool):
        return ct.BoolType(value)
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, int | float) and float(value).is_integer():
            return ct.IntType(int(value))
        return ct.StringType(str(value))
    kind = schema.get("type")
    if kind == "integer" and isinstance(value, int | float):
        return ct.IntType(int(value))
    if kind == "number" and isinstance(value, int | float):
        return ct.DoubleType(float(value))
    if isinstance(value, str):
        return _string_to_cel(value, schema.get("format"))
    if isinstance(value, int):
        return ct.IntType(value)
    if isinstance(value, float):
        return ct.DoubleType(value)
    if isinstance(value, list):
        items = schema.get("items") if isinstance(schema.get("items"), dict) else None
        return ct.ListType([to_cel(v, items) for v in value])
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        extra = extra if isinstance(extra, dict) else None
        out = {}
        for key, item in value.items():
            if key in props:
                out[ct.StringType(escape_property(key))] = to_cel(item, props[key])
            else:
                out[ct.StringType(key)] = to_cel(item, extra)
        return ct.MapType(out)
    return value


def to_python(value: Any) -> Any:
    """CEL results back to plain Python (for messageExpression strings and tests)."""
    if isinstance(value, ct.BoolType):
        return bool(value)
    if isinstance(value, ct.StringType):
        return str(value)
    if isinstance(value, ct.ListType):
        return [to_python(v) for v in value]
    if isinstance(value, ct.MapType):
        return {to_python(k): to_python(v) for k, v in value.items()}
    return value
