"""Table output (``Accept: application/json;as=Table;v=v1;g=meta.k8s.io``), what ``kubectl get``
prints from.

Custom resources get their version's ``additionalPrinterColumns`` after ``Name``, each
evaluated as a simple JSONPath on the object and typed as apiextensions-apiserver's table
convertor does (``date`` becomes an age such as ``5m12s``, a missing value ``null``, which
kubectl prints as ``<none>``); a version without columns gets ``Age``. Built-in kinds get the
generic convertor's ``Name`` and ``Created At`` (their per-kind printers are not modelled).
"""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any

from kubeapi.errors import bad_request
from kubeapi.openapi import upstream_definitions

TABLE_VERSIONS = ("v1", "v1beta1")
_ACCEPT_PARAM = re.compile(r"\s*([^=\s]+)\s*=\s*([^;\s]*)\s*")
_SEGMENT = re.compile(r"\.([^.\[\]]+)|\[(\d+)\]|\['([^']*)'\]")
INCLUDE_OBJECT = ("None", "Metadata", "Object")
_CRD_DEFAULT_COLUMNS = [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]


def table_version(accept: str) -> str | None:
    """The meta.k8s.io version of the Table `accept` asks for first, or None when it asks for
    a plain object first (or only for types served otherwise)."""
    for clause in accept.split(","):
        media, *raw = clause.split(";")
        params = {}
        for p in raw:
            m = _ACCEPT_PARAM.fullmatch(p)
            if m:
                params[m.group(1)] = m.group(2)
        media = media.strip()
        if media not in ("application/json", "application/*", "*/*"):
            continue
        if "as" not in params:
            return None
        if (params.get("as") == "Table" and params.get("g") == "meta.k8s.io"
                and params.get("v") in TABLE_VERSIONS):
            return params["v"]
    return None


def jsonpath(obj: Any, path: str) -> Any:
    """A printer column's JSONPath (``.spec.a``, ``.spec.list[0]``, ``.metadata.labels['a.b']``)
    on `obj`; None where it leads nowhere."""
    pos, value = 0, obj
    while pos < len(path):
        m = _SEGMENT.match(path, pos)
        if m is None:
            raise bad_request(f"additionalPrinterColumns jsonPath {path!r}: unsupported at "
                              f"offset {pos}; allowed: .field, [index], ['key']")
        pos = m.end()
        key, index, quoted = m.groups()
        if index is not None:
            value = value[int(index)] if isinstance(value, list) and int(index) < len(
                value) else None
        else:
            name = key if key is not None else quoted
            value = value.get(name) if isinstance(value, dict) else None
        if value is None:
            return None
    return value


def human_duration(seconds: float) -> str:
    """Kubernetes' short age (``duration.HumanDuration``): ``45s``, ``3m5s``, ``4h12m``, ``9d``."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m" if s % 60 == 0 else f"{minutes}m{s % 60}s"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h" if minutes % 60 == 0 else f"{hours}h{minutes % 60}m"
    if hours < 48:
        return f"{hours}h"
    days = hours // 24
    if hours < 24 * 8:
        return f"{days}d" if hours % 24 == 0 else f"{days}d{hours % 24}h"
    if hours < 24 * 365 * 2:
        return f"{days}d"
    years = days // 365
    if hours < 24 * 365 * 8:
        return f"{years}y" if days % 365 == 0 else f"{years}y{days % 365}d"
    return f"{years}y"


def _age(value: Any, now: dt.datetime) -> str:
    try:
        then = dt.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
    except (TypeError, ValueError):
        return "<invalid>"
    return human_duration((now - then).total_seconds())


def _cell(column_type: str, value: Any, now: dt.datetime) -> Any:
    """As apiextensions-apiserver's convertor: a value of the wrong type is null, except
    in string columns, which print whatever is there."""
    if value is None:
        return None
    if column_type == "string":
        return value if isinstance(value, str) else json.dumps(value)
    if column_type == "integer":
        return int(value) if isinstance(value, int | float) and not isinstance(
            value, bool) else None
    if column_type == "number":
        return value if isinstance(value, int | float) and not isinstance(value, bool) else None
    if column_type == "boolean":
        return value if isinstance(value, bool) else None
    if column_type == "date":
        return _age(value, now) if isinstance(value, str) else None
    return None


def _column(name: str, type_: str, description: str, fmt: str = "",
            priority: int = 0) -> dict:
    return {"name": name, "type": type_, "format": fmt, "description": description,
            "priority": priority}


def _row_object(obj: dict, include: str, version: str) -> dict | None:
    if include == "None":
        return None
    if include == "Object":
        return obj
    return {"kind": "PartialObjectMetadata", "apiVersion": f"meta.k8s.io/{version}",
            "metadata": obj.get("metadata") or {}}


def table(objects: list[dict], printer_columns: list[dict] | None, *, version: str,
          include_object: str | None, metadata: dict, now: dt.datetime) -> dict:
    """The Table of `objects`. `printer_columns`: the CRD version's columns (``[]`` for a
    CRD version without any), or None for a built-in kind."""
    include = include_object or "Metadata"
    if include not in INCLUDE_OBJECT:
        raise bad_request(f"includeObject: unsupported value {include!r}; "
                          f"supported: {', '.join(INCLUDE_OBJECT)}")
    meta_props = upstream_definitions()["io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"][
        "properties"]
    columns = [_column("Name", "string", meta_props["name"]["description"], "name")]
    if printer_columns is None:
        columns.append(_column("Created At", "date",
                               meta_props["creationTimestamp"]["description"]))
        specs = [{"type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    else:
        specs = printer_columns or _CRD_DEFAULT_COLUMNS
        columns += [_column(c["name"], c["type"], c.get("description", ""),
                            c.get("format", ""), c.get("priority", 0)) for c in specs]
    rows = []
    for obj in objects:
        cells = [obj.get("metadata", {}).get("name", "")]
        if printer_columns is None:
            # The generic convertor prints the timestamp itself, not an age.
            cells.append(obj.get("metadata", {}).get("creationTimestamp"))
        else:
            cells += [_cell(c["type"], jsonpath(obj, c["jsonPath"]), now) for c in specs]
        row: dict[str, Any] = {"cells": cells}
        row_object = _row_object(obj, include, version)
        if row_object is not None:
            row["object"] = row_object
        rows.append(row)
    return {"kind": "Table", "apiVersion": f"meta.k8s.io/{version}", "metadata": metadata,
            "columnDefinitions": columns, "rows": rows}
