"""What every part of the DisaggregatedInference API shares: the model base, quantities,
names and labels, and validation against the Kubernetes client's own models."""

from __future__ import annotations

import re
from typing import Annotated, Any

import kubernetes.client
from kubernetes.utils import parse_quantity
from pydantic import (
    AfterValidator,
    ConfigDict,
    Strict,
    StringConstraints,
    WithJsonSchema,
)

from bidirkv.knobs import Section

# The grammar kube-apiserver accepts (as in its OpenAPI for resource.Quantity); the value
# itself is then read with the Kubernetes client's parser.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?"
    r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_QUANTITY = re.compile(QUANTITY_PATTERN)


def _quantity(value: str) -> str:
    if not _QUANTITY.match(value):
        raise ValueError("not a Kubernetes quantity (e.g. 500m, 2, 16Gi, 1e3)")
    try:
        number = parse_quantity(value)
    except ValueError:
        raise ValueError("not a Kubernetes quantity (e.g. 500m, 2, 16Gi, 1e3)") from None
    if number < 0:
        raise ValueError("must not be negative")
    return value


def _non_negative(value: int) -> int:
    if value < 0:
        raise ValueError("must not be negative")
    return value


Quantity = Annotated[
    str,
    AfterValidator(_quantity),
    WithJsonSchema({"type": "string", "pattern": QUANTITY_PATTERN}),
]
# Resource amounts: a quantity string or a plain integer (`nvidia.com/gpu: 8`); strict, so
# a string that is not a quantity is not read as a number either ("1_000").
Amount = Quantity | Annotated[int, Strict(), AfterValidator(_non_negative)]
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$", max_length=253)]
DnsName = Annotated[str, StringConstraints(
    pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
    max_length=253)]
_LABEL_NAME = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                         r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")


class _Model(Section):
    # The knobs' conventions (camelCase, unknown keys refused: the CRD prunes, the operator
    # and the local stack see the same rule through these models), enums as their values.
    model_config = ConfigDict(use_enum_values=True, validate_default=True)


def label_key_error(key: str) -> str | None:
    if len(key.rsplit("/", 1)[-1]) > 63 or len(key) > 316 or not _LABEL_NAME.match(key):
        return (f"{key!r} is not a valid label key (an optional DNS prefix and '/', then "
                "up to 63 of A-Z a-z 0-9 - _ . starting and ending alphanumeric)")
    return None


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    for key, value in labels.items():
        problem = label_key_error(key)
        if problem:
            raise ValueError(problem)
        if not _LABEL_VALUE.match(value):
            raise ValueError(f"label {key!r}: {value!r} is not a valid label value (up to 63 "
                             "of A-Z a-z 0-9 - _ . starting and ending alphanumeric)")
    return labels


def check_annotations(annotations: dict[str, str]) -> dict[str, str]:
    for key in annotations:
        problem = label_key_error(key)
        if problem:
            raise ValueError(problem.replace("label key", "annotation key"))
    return annotations


def kube_object(model: str) -> Any:
    """A field holding a Kubernetes object of `model` (e.g. "V1Volume"), validated with the
    official client's models (unknown fields and wrong types refused, required fields
    checked); stored as given. The CRD keeps it open (x-kubernetes-preserve-unknown-fields):
    the schema would otherwise copy much of the Kubernetes API into the CRD."""
    cls = getattr(kubernetes.client, model)

    def check(value: dict[str, Any]) -> dict[str, Any]:
        from pydantic import ValidationError

        try:
            cls.model_validate(value)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"not a valid {model[2:]}: {where}: {first['msg']}") from None
        return value

    return Annotated[
        dict[str, Any],
        AfterValidator(check),
        WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                        "description": f"A Kubernetes {model[2:]}."}),
    ]
