"""A Swagger 2.0 document in gnostic's OpenAPIv2 protobuf encoding.

kube-apiserver serves ``/openapi/v2`` as
``application/com.github.proto-openapi.spec.v2@v1.0+protobuf`` and kubectl asks for it that
way (validation, ``explain``). The messages are encoded by hand from the field numbers of
gnostic's ``openapiv2/OpenAPIv2.proto`` (message ``openapi.v2.Document``): the info, the
definitions, and the paths' operations with their parameters and responses (kubectl reads
which query parameters a PATCH takes), with vendor extensions. Values without a
message of their own (defaults, enums, extensions) travel as gnostic's ``Any`` with the
value written as YAML (JSON is YAML).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from typing import Any

CONTENT_TYPE = "application/com.github.proto-openapi.spec.v2@v1.0+protobuf"

_VARINT, _FIXED64, _LEN = 0, 1, 2


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64: negatives as ten-byte two's complement
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _tag(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _message(field: int, body: bytes) -> bytes:
    return _tag(field, _LEN) + _varint(len(body)) + body


def _string(field: int, value: str | None) -> bytes:
    return _message(field, value.encode()) if value else b""


def _strings(field: int, values: Iterable[str]) -> bytes:
    return b"".join(_message(field, v.encode()) for v in values)


def _bool(field: int, value: bool | None) -> bytes:
    return _tag(field, _VARINT) + b"\x01" if value else b""


def _int(field: int, value: int | None) -> bytes:
    return _tag(field, _VARINT) + _varint(int(value)) if value is not None else b""


def _double(field: int, value: float | None) -> bytes:
    return _tag(field, _FIXED64) + struct.pack("<d", float(value)) if value is not None else b""


def _any(value: Any) -> bytes:
    """gnostic ``Any``: ``yaml`` = 2."""
    return _string(2, json.dumps(value, separators=(",", ":")))


def _named_any(field: int, name: str, value: Any) -> bytes:
    """``NamedAny``: ``name`` = 1, ``value`` = 2."""
    return _message(field, _string(1, name) + _message(2, _any(value)))


def _extensions(field: int, node: dict) -> bytes:
    return b"".join(_named_any(field, k, v) for k, v in node.items() if k.startswith("x-"))


def schema(s: dict) -> bytes:
    """``Schema``; field numbers as in OpenAPIv2.proto."""
    out = [_string(1, s.get("$ref")), _string(2, s.get("format")), _string(3, s.get("title")),
           _string(4, s.get("description"))]
    if "default" in s:
        out.append(_message(5, _any(s["default"])))
    out += [_double(6, s.get("multipleOf")), _double(7, s.get("maximum")),
            _bool(8, s.get("exclusiveMaximum")), _double(9, s.get("minimum")),
            _bool(10, s.get("exclusiveMinimum")), _int(11, s.get("maxLength")),
            _int(12, s.get("minLength")), _string(13, s.get("pattern")),
            _int(14, s.get("maxItems")), _int(15, s.get("minItems")),
            _bool(16, s.get("uniqueItems")), _int(17, s.get("maxProperties")),
            _int(18, s.get("minProperties")), _strings(19, s.get("required") or ())]
    out += [_message(20, _any(v)) for v in s.get("enum") or ()]
    extra = s.get("additionalProperties")
    if isinstance(extra, dict):
        out.append(_message(21, _message(1, schema(extra))))  # AdditionalPropertiesItem.schema
    elif isinstance(extra, bool):
        # proto3 oneof: a false boolean is still present, so its tag is written.
        out.append(_message(21, _tag(2, _VARINT) + _varint(int(extra))))
    if "type" in s:
        types = s["type"] if isinstance(s["type"], list) else [s["type"]]
        out.append(_message(22, _strings(1, types)))  # TypeItem.value
    if "items" in s:
        items = s["items"] if isinstance(s["items"], list) else [s["items"]]
        out.append(_message(23, b"".join(_message(1, schema(i)) for i in items)))
    out += [_message(24, schema(sub)) for sub in s.get("allOf") or ()]
    if "properties" in s:
        out.append(_message(25, b"".join(  # Properties.additional_properties: NamedSchema
            _message(1, _string(1, name) + _message(2, schema(sub)))
            for name, sub in s["properties"].items())))
    out += [_string(26, s.get("discriminator")), _bool(27, s.get("readOnly"))]
    if "example" in s:
        out.append(_message(30, _any(s["example"])))
    out.append(_extensions(31, s))
    return b"".join(out)


def _parameter(p: dict) -> bytes:
    """``ParametersItem``: a ``$ref`` (JsonReference), or a ``Parameter``: the body, or a
    query or path parameter (the API serves no header or form-data parameters)."""
    if "$ref" in p:
        return _message(2, _string(1, p["$ref"]) + _string(2, p.get("description")))
    if p.get("in") == "body":
        body = (_string(1, p.get("description")) + _string(2, p.get("name"))
                + _string(3, "body") + _bool(4, p.get("required"))
                + _message(5, schema(p.get("schema") or {})) + _extensions(6, p))
        return _message(1, _message(1, body))  # Parameter.body_parameter
    where = p.get("in")
    if where not in ("query", "path"):
        raise ValueError(f"parameter {p.get('name')!r}: in={where!r} is not encoded; "
                         "allowed: body, query, path")
    # QueryParameterSubSchema has allow_empty_value = 5 where PathParameterSubSchema has
    # type; after it the query message's numbers are one higher.
    query = where == "query"
    shift = int(query)
    fields = (_bool(1, p.get("required")) + _string(2, where) + _string(3, p.get("description"))
              + _string(4, p.get("name")) + (_bool(5, p.get("allowEmptyValue")) if query else b"")
              + _string(5 + shift, p.get("type")) + _string(6 + shift, p.get("format"))
              + _bool(19 + shift, p.get("uniqueItems")) + _extensions(22 + shift, p))
    # Parameter.non_body_parameter: NonBodyParameter.query_... = 3, .path_... = 4
    return _message(1, _message(2, _message(3 if query else 4, fields)))


def _operation(op: dict) -> bytes:
    out = [_strings(1, op.get("tags") or ()), _string(2, op.get("summary")),
           _string(3, op.get("description")), _string(5, op.get("operationId")),
           _strings(6, op.get("produces") or ()), _strings(7, op.get("consumes") or ())]
    out += [_message(8, _parameter(p)) for p in op.get("parameters") or ()]
    responses = b"".join(  # Responses.response_code: NamedResponseValue{name, value.response}
        _message(1, _string(1, code) + _message(2, _message(1, _response(r))))
        for code, r in (op.get("responses") or {}).items())
    out += [_message(9, responses), _strings(10, op.get("schemes") or ()),
            _bool(11, op.get("deprecated")), _extensions(13, op)]
    return b"".join(out)


def _response(r: dict) -> bytes:
    out = _string(1, r.get("description"))
    if "schema" in r:
        out += _message(2, _message(1, schema(r["schema"])))  # SchemaItem.schema
    return out + _extensions(5, r)


_METHODS = {"get": 2, "put": 3, "post": 4, "delete": 5, "options": 6, "head": 7, "patch": 8}


def _path_item(item: dict) -> bytes:
    out = [_message(field, _operation(item[m])) for m, field in _METHODS.items() if m in item]
    out += [_message(9, _parameter(p)) for p in item.get("parameters") or ()]
    out.append(_extensions(10, item))
    return b"".join(out)


def document(doc: dict) -> bytes:
    """``Document``: swagger = 1, info = 2, paths = 8, definitions = 9."""
    info = doc.get("info") or {}
    paths = b"".join(_message(2, _string(1, path) + _message(2, _path_item(item)))
                     for path, item in (doc.get("paths") or {}).items())
    definitions = b"".join(_message(1, _string(1, name) + _message(2, schema(s)))
                           for name, s in (doc.get("definitions") or {}).items())
    return (_string(1, doc.get("swagger", "2.0"))
            + _message(2, _string(1, info.get("title")) + _string(2, info.get("version")))
            + _message(8, paths) + _message(9, definitions) + _extensions(16, doc))
