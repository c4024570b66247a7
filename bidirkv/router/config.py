"""Router configuration: the keys the operator renders into the router's ConfigMap.

The file is JSON (YAML accepted too). Keys are camelCase like the CRD's; CLI flags
override the file where both exist. Validation errors name the key, the value and what
is allowed, so a bad ConfigMap is diagnosable from one log line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from bidirkv.knobs import (
    LEASE_OUTLIVES_RENEWALS,
    TTL_SAFETY_MARGIN_SECONDS,
    HandleStoreUrl,
    KvKnobs,
    Placement,
    RouterKnobs,
    Section,
    Timeouts,
    TracingKnobs,
    check_rule,
    shown_input,
)


class ConfigError(ValueError):
    """A configuration the router refuses; the message is meant for a human."""


class _Model(Section):
    # The knobs' conventions (camelCase, a misspelt key refused), and strict throughout:
    # "true" or "5" in a ConfigMap is a rendering bug, not something to coerce.
    model_config = ConfigDict(strict=True, frozen=True)


class Tracing(TracingKnobs, _Model):
    """Where the router's spans go (bidirkv/router/tracing/spans.py): the knobs shared
    with the CRD (bidirkv/knobs.py), or a file. Neither exporter set: no span is recorded,
    and a client's `traceparent` is still passed on upstream."""

    # Spans as JSON lines appended to this file, for a machine without a collector (the
    # local stack). A relative path is relative to the router's working directory.
    file: str | None = Field(default=None, min_length=1, max_length=4096)
    service_name: str = Field(default="bidir-kv-router", min_length=1, max_length=128)

    @field_validator("file")
    @classmethod
    def _file(cls, value: str | None) -> str | None:
        if value is not None and ("\0" in value or value.endswith("/")):
            raise ValueError("expected the path of a file (no NUL byte, no trailing slash)")
        return value

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None or self.file is not None


def normalise_url(value: str) -> str:
    """`http(s)://host[:port][/path]` without a trailing slash, or ConfigError."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{value!r} is not a URL; expected http://host:port")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{value!r} is not a URL; expected http://host:port or https://host:port")
    if parts.query or parts.fragment:
        raise ConfigError(f"{value!r} must not have a query or fragment")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ConfigError(f"{value!r} has an invalid port: {exc}") from None
    return value.rstrip("/")


def _urls(value: list[str], key: str) -> list[str]:
    out: list[str] = []
    for item in value:
        try:
            url = normalise_url(item)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        if url in out:
            raise ValueError(f"{item!r} is listed twice in {key}")
        out.append(url)
    return out


class RouterConfig(RouterKnobs, KvKnobs, _Model):
    """The knobs shared with the CRD (bidirkv/knobs.py: their types, bounds, defaults and
    rules), and what the operator derives or fixes (bidirkv/operator/render/router.py)."""

    prefill: list[str] = Field(default_factory=list)
    decode: list[str] = Field(default_factory=list)
    model: str | None = Field(default=None, min_length=1)
    # decoderKvBlocksTtlSeconds minus this bounds how long a handle is handed out.
    safety_margin_seconds: float = Field(default=float(TTL_SAFETY_MARGIN_SECONDS), ge=0,
                                         le=3600)
    tracing: Tracing = Field(default_factory=Tracing)
    # Shared handle store (bidirkv/router/store/shared.py): redis://HOST:PORT/DB or rediss://...;
    # None keeps handles in this process. The password comes from the environment.
    handle_store: HandleStoreUrl | None = None
    # Hash of what P and D must share, as stamped on the engine pods by the operator;
    # carried so a router can refuse engines of another fingerprint.
    kv_fingerprint: str | None = Field(default=None, max_length=64)

    @field_validator("prefill", "decode")
    @classmethod
    def _engine_urls(cls, value: list[str], info: ValidationInfo) -> list[str]:
        return _urls(value, info.field_name)

    @model_validator(mode="after")
    def _ttl_positive(self) -> RouterConfig:
        if self.decoder_kv_blocks_ttl_seconds - self.safety_margin_seconds <= 0:
            raise ValueError(
                f"decoderKvBlocksTtlSeconds ({self.decoder_kv_blocks_ttl_seconds}) minus "
                f"safetyMarginSeconds ({self.safety_margin_seconds}) must be positive: it "
                "bounds how long a decode handle is kept"
            )
        return self

    @model_validator(mode="after")
    def _lease_outlives_renewals(self) -> RouterConfig:
        check_rule(LEASE_OUTLIVES_RENEWALS, "", self, "owner_lease_seconds",
                   "health_check_interval_seconds")
        return self

    @property
    def handle_ttl_seconds(self) -> float:
        """How long a stored handle is handed out: never past D's deadline minus margin."""
        return min(
            self.conversation_ttl_seconds,
            self.decoder_kv_blocks_ttl_seconds - self.safety_margin_seconds,
        )


# The nested sections, by key: an unknown key inside one lists that section's keys.
_SECTIONS: dict[Any, type[_Model]] = {"timeouts": Timeouts, "placement": Placement,
                                      "tracing": Tracing}


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def format_errors(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors(include_url=False):
        where = _loc(err["loc"])
        value = err.get("input")
        if where in ("handleStore", "handle_store"):
            value = "<not shown: it may hold a password>"
        else:
            value = shown_input(value)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            model = _SECTIONS.get(err["loc"][0], RouterConfig) if len(err["loc"]) > 1 \
                else RouterConfig
            allowed = ", ".join(sorted(f.alias or n for n, f in model.model_fields.items()))
            msg = f"unknown key; allowed keys: {allowed}"
        elif err["type"] == "missing":
            lines.append(f"{source}: {where}: required")
            continue
        lines.append(f"{source}: {where}: value {value!r} not allowed: {msg}")
    return "\n".join(lines)


def parse_config(data: Any, source: str = "config") -> RouterConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, source)) from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The file's mapping (JSON, or YAML when it is not JSON); ConfigError if unreadable."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as json_exc:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as yaml_exc:
            raise ConfigError(
                f"{path}: neither JSON ({json_exc}) nor YAML ({yaml_exc})"
            ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> RouterConfig:
    """File (if any) with CLI overrides on top, validated as one document."""
    data: dict[str, Any] = read_config_file(path) if path is not None else {}
    data = {**data, **(overrides or {})}
    cfg = parse_config(data, str(path) if path is not None else "command line")
    if not cfg.prefill:
        raise ConfigError("prefill: no prefill URL; give --prefill URL or `prefill` in the file")
    if not cfg.decode:
        raise ConfigError("decode: no decode URL; give --decode URL or `decode` in the file")
    return cfg
