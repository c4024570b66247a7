"""A Swagger 2.0 document in gnostic's OpenAPIv2 protobuf encoding.

kube-apiserver serves ``/openapi/v2`` as
``application/com.github.proto-openapi.spec.v2@v1.0+protobuf`` and kubectl asks for it that
way (validation, ``explain``). The messages are encoded by hand from the field numbers of
gnostic's ``openapiv2/OpenAPIv2.proto`` (message ``openapi.v2.Document``): the info, the
definitions and vendor extensions, which is what kubectl reads of it. Values without a
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


def document(doc: dict) -> bytes:
    """``Document``: swagger = 1, info = 2, definitions = 9 (paths are not encoded)."""
    info = doc.get("info") or {}
    definitions = b"".join(_message(1, _string(1, name) + _message(2, schema(s)))
                           for name, s in (doc.get("definitions") or {}).items())
    return (_string(1, doc.get("swagger", "2.0"))
            + _message(2, _string(1, info.get("title")) + _string(2, info.get("version")))
            + _message(9, definitions) + _extensions(16, doc))
