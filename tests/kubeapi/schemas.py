"""Strict validation of built-in Kubernetes objects against the published schemas.

kubernetes-validate reports only the first error; this lists them all, which is what a
test failure should show.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jsonschema
from kubernetes_validate import utils as kv
from referencing import Registry, Resource

KUBE_VERSIONS = ("1.31", "1.33")


@functools.cache
def _validator(kind: str, api_version: str, version: str) -> jsonschema.Validator:
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema_dir = f"v{version}.0-local-strict"
    schema = kv.schema_contents(
        f"kubernetes-json-schema/{schema_dir}/{kind.lower()}-{group_version}.json", version
    )
    defs = kv.schema_contents(f"kubernetes-json-schema/{schema_dir}/_definitions.json", version)
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def schema_errors(obj: dict[str, Any], version: str) -> list[str]:
    """Every strict-schema error of `obj` for Kubernetes `version` ("1.33")."""
    validator = _validator(obj["kind"], obj["apiVersion"], version)
    return [
        f"{obj['kind']}/{obj.get('metadata', {}).get('name')}: "
        f"{'.'.join(str(p) for p in err.absolute_path)}: {err.message}"
        for err in validator.iter_errors(obj)
    ]
