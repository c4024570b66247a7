"""The router's own JSON answers to the client, and the header naming a turn's placement."""

from __future__ import annotations

from aiohttp import web

from bidirkv.router.pool.placement import Decision
from bidirkv.router.request.validation import error_body

JSON_TYPE = "application/json"
PLACEMENT_HEADER = "X-Bidirkv-Placement"


def placement_header(d: Decision | None, shown: bool) -> dict[str, str]:
    """`decision; reason=...` for the client (benchmarks read it), when one was made and
    the config shows it (`placementHeader`): it tells whoever sent the request whether
    its exact history is stored and how busy decode is, so it is off unless asked for."""
    if d is None or not shown:
        return {}
    return {PLACEMENT_HEADER: f"{d.path}; reason={d.reason}"}


def json_response(status: int, body: bytes, headers: dict[str, str] | None = None
                  ) -> web.Response:
    return web.Response(status=status, body=body, content_type=JSON_TYPE, headers=headers)


def json_error(status: int, message: str, type_: str = "invalid_request_error",
               param: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    return json_response(status, error_body(message, type_, param, status), headers)
