"""What an OTLP/HTTP traces endpoint must look like: one rule for the operator, which
renders it, and the router, which exports to it (a spec the operator takes must never be
a config the router refuses)."""

from __future__ import annotations

from urllib.parse import urlsplit

EXAMPLE = "http://otel-collector:4318/v1/traces"


def endpoint_problem(value: str) -> str | None:
    """None for an http(s) URL with a host, a valid port and no credentials."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"expected the http(s) URL of an OTLP/HTTP traces receiver, e.g. {EXAMPLE}"
    if parts.username is not None or parts.password is not None:
        # The URL lands in a ConfigMap and in pod arguments, readable by many.
        return ("no credentials in the URL: a collector's token goes in "
                "OTEL_EXPORTER_OTLP_TRACES_HEADERS")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        return f"invalid port: {exc}"
    return None
