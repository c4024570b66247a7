"""`kubectl get disaggregatedinference` without kubectl: the CRD's printer columns."""

from __future__ import annotations

import datetime as dt
from typing import Any

from bidirkv.operator.crd.schema import build_crd


def _lookup(obj: Any, json_path: str) -> Any:
    for part in json_path.strip(".").split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def _age(timestamp: str | None, now: dt.datetime) -> str:
    if not timestamp:
        return "<unknown>"
    then = dt.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
    seconds = max(0, int((now - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def rows(objects: list[dict[str, Any]], now: dt.datetime | None = None) -> list[list[str]]:
    """Header and one row per object, evaluated like the API server's table output."""
    now = now or dt.datetime.now(dt.UTC)
    columns = build_crd()["spec"]["versions"][0]["additionalPrinterColumns"]
    out = [["NAME"] + [c["name"].upper() for c in columns]]
    for obj in objects:
        row = [obj["metadata"]["name"]]
        for col in columns:
            value = _lookup(obj, col["jsonPath"])
            if col["type"] == "date":
                row.append(_age(value, now))
            elif isinstance(value, bool):
                row.append(str(value).lower())
            else:
                row.append("" if value is None else str(value))
        out.append(row)
    return out


def table(objects: list[dict[str, Any]], now: dt.datetime | None = None) -> str:
    data = rows(objects, now)
    widths = [max(len(r[i]) for r in data) for i in range(len(data[0]))]
    return "\n".join("   ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
                     for r in data)
