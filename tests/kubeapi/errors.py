"""Kubernetes ``Status`` errors as the apiserver reports them."""

from __future__ import annotations

from typing import Any

from kubeapi.crdschema import FieldError
from kubeapi.patch import APPLY_PATCH, JSON_PATCH, MERGE_PATCH, STRATEGIC_PATCH
from kubeapi.resources import ResourceType


class ApiError(Exception):
    """An error the apiserver reports as a ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict:
        body = {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def resource_details(rt: ResourceType, name: str, **more: Any) -> dict:
    details = {"name": name, "kind": rt.plural, **more}
    if rt.group:
        details["group"] = rt.group
    return details


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.group_resource} "{name}" not found',
                    resource_details(rt, name))


def already_exists(rt: ResourceType, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{rt.group_resource} "{name}" already exists',
                    resource_details(rt, name))


def conflict(rt: ResourceType, name: str, why: str = "") -> ApiError:
    why = why or ("the object has been modified; please apply your changes to the latest "
                  "version and try again")
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {rt.group_resource} '
                                     f'"{name}": {why}', resource_details(rt, name))


def invalid(rt: ResourceType, name: str, errors: list[FieldError]) -> ApiError:
    qualified = f"{rt.kind}.{rt.group}" if rt.group else rt.kind
    summary = str(errors[0]) if len(errors) == 1 else f"[{', '.join(map(str, errors))}]"
    details = {"name": name, "kind": rt.kind, "causes": [e.cause() for e in errors]}
    if rt.group:
        details["group"] = rt.group
    return ApiError(422, "Invalid", f'{qualified} "{name}" is invalid: {summary}', details)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def method_not_allowed() -> ApiError:
    return ApiError(405, "MethodNotAllowed",
                    "the server does not allow this method on the requested resource")


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(415, "UnsupportedMediaType",
                    f"the body of the request was in an unknown format ({content_type}) - "
                    f"accepted media types include: {JSON_PATCH}, {MERGE_PATCH}, {APPLY_PATCH}, "
                    f"{STRATEGIC_PATCH} (built-in resources only)")


def expired(since: int, oldest: int) -> ApiError:
    return ApiError(410, "Expired", f"too old resource version: {since} ({oldest})")
