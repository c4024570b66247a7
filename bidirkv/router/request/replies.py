"""The router's own JSON answers to the client."""

from __future__ import annotations

from aiohttp import web

from bidirkv.router.request.validation import error_body

JSON_TYPE = "application/json"


def json_response(status: int, body: bytes, headers: dict[str, str] | None = None
                  ) -> web.Response:
    return web.Response(status=status, body=body, content_type=JSON_TYPE, headers=headers)


def json_error(status: int, message: str, type_: str = "invalid_request_error",
               param: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    return json_response(status, error_body(message, type_, param, status), headers)
