"""Quantities as kube-apiserver stores them (apimachinery's `resource.Quantity`).

The API server parses every quantity field and writes it back in canonical form, keeping
the format family the client used: binary suffixes (`Ki`..`Ei`), decimal suffixes (`n`..
`E`, none) or a decimal exponent (`e3`). So "1024Mi" reads back as "1Gi", "0.5" as "500m",
"2000m" as "2", "1.5e3" as "1500", while "1e3" stays "1e3". Written independently of the
operator's own comparison (which only parses), so a test that passes proves the operator
copes with the server, not with itself.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_GRAMMAR = re.compile(
    r"^(?P<sign>[+-]?)(?P<int>[0-9]*)(?:\.(?P<frac>[0-9]*))?"
    r"(?P<suffix>[KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
)
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15,
            "E": 18}
_DECIMAL_SUFFIX = {e: s for s, e in _DECIMAL.items()}


class QuantityError(ValueError):
    pass


def parse(text: str | int | float) -> tuple[Fraction, str]:
    """(value, format) with format one of "binary", "decimal", "exponent"."""
    if isinstance(text, bool):
        raise QuantityError(f"quantities must match the regular expression: {text!r}")
    if isinstance(text, int):
        return Fraction(text), "decimal"
    if isinstance(text, float):
        return Fraction(str(text)), "decimal"
    m = _GRAMMAR.match(text)
    if m is None or not (m["int"] or m["frac"]):
        raise QuantityError(
            "quantities must match the regular expression "
            r"'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'")
    number = Fraction(f"{m['int'] or '0'}.{m['frac'] or '0'}")
    if m["sign"] == "-":
        number = -number
    suffix = m["suffix"] or ""
    if suffix in _BINARY:
        return number * 1024 ** _BINARY[suffix], "binary"
    if suffix[:1] in ("e", "E"):
        return number * Fraction(10) ** int(suffix[1:]), "exponent"
    return number * Fraction(10) ** _DECIMAL[suffix], "decimal"


def _round_to_nano(value: Fraction) -> Fraction:
    # Precision below 10^-9 is rounded up (away from zero), as the API server does.
    scaled = value * 10**9
    if scaled.denominator == 1:
        return value
    rounded = math.ceil(abs(scaled))
    return Fraction(rounded if value > 0 else -rounded, 10**9)


def _decimal(value: Fraction, fmt: str) -> str:
    sign = "-" if value < 0 else ""
    value = abs(value)
    exponent = 0
    while value.denominator != 1:
        value *= 10
        exponent -= 1
    mantissa = value.numerator
    while mantissa % 10 == 0:
        mantissa //= 10
        exponent += 1
    rest = exponent % 3
    mantissa *= 10**rest
    exponent -= rest
    if fmt == "exponent":
        return f"{sign}{mantissa}" + (f"e{exponent}" if exponent else "")
    if exponent in _DECIMAL_SUFFIX:
        return f"{sign}{mantissa}{_DECIMAL_SUFFIX[exponent]}"
    return f"{sign}{mantissa}e{exponent}"


def canonical(text: str | int | float) -> str:
    value, fmt = parse(text)
    value = _round_to_nano(value)
    if value == 0:
        return "0"
    if fmt == "binary":
        if -1024 < value < 1024 or value.denominator != 1:
            return _decimal(value, "decimal")  # exact, not rounded to a binary suffix
        sign, n, power = ("-" if value < 0 else ""), abs(value.numerator), 0
        while n % 1024 == 0 and power < 6:
            n //= 1024
            power += 1
        suffix = {v: k for k, v in _BINARY.items()}.get(power, "")
        return f"{sign}{n}{suffix}"
    return _decimal(value, fmt)
