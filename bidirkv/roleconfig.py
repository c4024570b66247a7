"""vLLM arguments, environment and kv-transfer config of one role, from a spec.

The one place these are built: the operator puts them in pod templates and the local
stack runs them as processes, so a laptop and a cluster get the same settings. Owned by
neither side: the operator and the engine side (connector/) import it, it imports
neither, so dependencies run one way (tests/test_import_graph.py). What it reads of a
spec is declared below (`Spec`); the operator's DisaggregatedInferenceSpec is one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

ROLES = ("prefill", "decode")
# bidir-kv's NIXL connector: vLLM's name (its configuration checks compare it), loaded
# from bidir-kv's module (bidirkv/connector/nixl/connector.py).
KV_CONNECTOR = "NixlConnector"
KV_CONNECTOR_MODULE = "bidirkv.connector.nixl.connector"
ENGINE_PORT = 8000
# Set by the downward API in a pod; the local stack substitutes the loopback address.
POD_IP = {"valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}

# Arguments derived from spec fields; accepting them in extraArgs too would give two
# sources of truth (and, for kv-transfer-config, a way to split the pool's flags).
MANAGED_ARGS = (
    "--model", "--served-model-name", "--host", "--port", "--tensor-parallel-size", "-tp",
    "--dtype", "--max-model-len", "--enable-prefix-caching", "--no-enable-prefix-caching",
    "--kv-transfer-config",
)
# Managed only while spec.monitoring.tracing sets them: before that field existed they
# were the only way, and a spec that still passes them keeps working.
TRACING_ARGS = ("--otlp-traces-endpoint",)
# The arguments a role may set alone (spec.prefill/decode.extraArgs), with whether each
# takes a value: how much work a server takes on, how it schedules it and what it logs,
# never which tokens a prompt becomes or what KV they get. A role-only tokenizer, chat
# template, model override, LoRA or KV scale would have decode read KV computed for other
# tokens, keep it under its own hashes and hand it on. An allowlist, so a flag vLLM adds
# later lands in engine.extraArgs (both roles, the fingerprint) until it is listed here.
# Spelled as vLLM prints them: its parser also takes prefixes and underscores, which an
# exact match refuses.
ROLE_ARGS: dict[str, bool] = {  # flag -> takes a value
    **dict.fromkeys((
        "--max-num-seqs", "--max-num-batched-tokens", "--long-prefill-token-threshold",
        "--scheduling-policy", "--stream-interval", "--gpu-memory-utilization",
        "--kv-cache-memory-bytes", "--num-gpu-blocks-override", "--cpu-offload-gb",
        "--uvicorn-log-level", "--max-log-len"), True),
    **dict.fromkeys((
        "--enforce-eager", "--no-enforce-eager", "--enable-chunked-prefill",
        "--no-enable-chunked-prefill", "--disable-log-stats", "--enable-log-requests",
        "--no-enable-log-requests", "--disable-uvicorn-access-log",
        "--no-disable-uvicorn-access-log"), False),
}
# CEL's form of ROLE_ARGS on the CRD (an item starting with '-' must match it).
ROLE_ARG_PATTERN = "^(" + "|".join(ROLE_ARGS) + ")(=|$)"
# The environment a role may set alone (spec.prefill/decode.extraEnv), by exact name: on
# which cores or devices a server runs, how much memory its KV cache takes, what it logs;
# never where its weights come from (HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE,
# VLLM_USE_MODELSCOPE), nor kernels or KV layouts (VLLM_ATTENTION_BACKEND). A role that
# loads other weights under the same name computes other KV for the same tokens, and the
# other role would read it. An allowlist, as ROLE_ARGS: a name not listed goes in
# engine.extraEnv (both roles, the fingerprint).
ROLE_ENV = (
    "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE",
    "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "VLLM_LOGGING_LEVEL", "VLLM_LOG_STATS_INTERVAL",
)
# CEL's form of ROLE_ENV on the CRD (a list literal).
ROLE_ENV_CEL = "[" + ", ".join(f"'{name}'" for name in ROLE_ENV) + "]"
# The operator's fingerprint of what both roles share, for the engines' digest seed.
FINGERPRINT_ENV = "BIDIRKV_KV_FINGERPRINT"
MANAGED_ENV_PREFIXES = (
    "VLLM_NIXL_SIDE_CHANNEL_", "FI_", "VLLM_PLUGINS", "BIDIRKV_HANDLE_KEY", FINGERPRINT_ENV,
)


class EnvEntry(Protocol):
    name: str

    def as_env(self) -> dict[str, Any]: ...


class ModelCache(Protocol):
    def model_dump(self, *, by_alias: bool, mode: str) -> dict[str, Any]: ...


class Engine(Protocol):
    image: str
    extra_args: Sequence[str]
    extra_env: Sequence[EnvEntry]
    model_cache: ModelCache | None


class Role(Protocol):
    extra_args: Sequence[str]
    extra_env: Sequence[EnvEntry]
    tensor_parallel_size: int
    enable_prefix_caching: bool
    model_cache: ModelCache | None


class Model(Protocol):
    name: str
    served_name: str | None
    dtype: str
    max_model_len: int | None


class KvTransfer(Protocol):
    """The knobs of bidirkv/knobs.py's KvKnobs, and what only the engines' command line
    holds; the fingerprint hashes all of it as the CRD writes it."""

    bidirectional: bool
    decoder_kv_blocks_ttl_seconds: int
    kv_recompute_threshold: int
    retention_watermark: float
    owner_lease_seconds: int
    backend: str
    kv_buffer_device: str | None
    load_failure_policy: str
    side_channel_port: int

    def model_dump(self, *, by_alias: bool, mode: str) -> dict[str, Any]: ...


class SecretKey(Protocol):
    name: str
    key: str


class Tracing(Protocol):
    otlp_endpoint: str | None
    headers_secret_ref: SecretKey | None


class Monitoring(Protocol):
    tracing: Tracing


class Efa(Protocol):
    enabled: bool
    hugepages_2mi: str | None


class Spec(Protocol):
    """What of a DisaggregatedInference's spec the roles' configuration reads."""

    model: Model
    engine: Engine
    prefill: Role
    decode: Role
    kv_transfer: KvTransfer
    monitoring: Monitoring
    efa: Efa


@dataclass(frozen=True)
class Listen:
    """Where a server listens and how peers reach it. In a pod: every address, the engine
    port and, for NIXL's side channel, the pod IP (downward API); the local stack gives
    each process the loopback address and ports of its own."""

    bind_host: str = "0.0.0.0"
    http_port: int = ENGINE_PORT
    side_channel_host: str | None = None  # None: the pod IP
    side_channel_port: int | None = None  # None: spec.kvTransfer.sideChannelPort


POD = Listen()


class RoleConfigError(ValueError):
    """A spec this module cannot turn into a server's configuration (the message names
    the field); the operator reports it as an invalid spec."""


@dataclass(frozen=True)
class RoleConfig:
    role: str
    args: list[str]
    env: list[dict[str, Any]]
    kv_transfer_config: dict[str, Any]
    ports: dict[str, int] = field(default_factory=dict)


def kv_transfer_config(spec: Spec, role: str) -> dict[str, Any]:
    kv = spec.kv_transfer
    extra: dict[str, Any] = {
        "backends": [kv.backend],
        "bidirectional_kv_xfer": kv.bidirectional,
    }
    if kv.bidirectional:
        extra["decoder_kv_blocks_ttl"] = kv.decoder_kv_blocks_ttl_seconds
        extra["kv_recompute_threshold"] = kv.kv_recompute_threshold
    cfg = {
        "kv_connector": KV_CONNECTOR,
        "kv_connector_module_path": KV_CONNECTOR_MODULE,
        # With bidirectional transfer both roles read and are read from; kv_both is the
        # role that was measured to work for that on vLLM 0.32.
        "kv_role": "kv_both" if kv.bidirectional else (
            "kv_producer" if role == "prefill" else "kv_consumer"
        ),
        "kv_load_failure_policy": kv.load_failure_policy,
        "kv_connector_extra_config": extra,
    }
    if kv.kv_buffer_device is not None:
        cfg["kv_buffer_device"] = kv.kv_buffer_device
    return cfg


def _flag(arg: str) -> str:
    """The option an item names, as vLLM reads it (it turns `_` into `-` in `--` options)."""
    flag = arg.split("=", 1)[0]
    return flag.replace("_", "-") if flag.startswith("--") else flag


def role_args_errors(where: str, args: Sequence[str]) -> list[str]:
    """What of a role's own extraArgs is not on ROLE_ARGS: an option not listed, or a
    value that follows no option taking one (vLLM would read it as the model)."""
    errors = []
    wants_value = False
    for i, arg in enumerate(args):
        field = f"spec.{where}.extraArgs[{i}]"
        if arg.startswith("-"):
            flag, inline = arg.split("=", 1)[0], "=" in arg
            if flag not in ROLE_ARGS:
                errors.append(
                    f"{field}: {arg!r} is not one a role may set alone (it could change "
                    "the tokens or the KV one role computes for the other); set it in "
                    f"spec.engine.extraArgs, for both roles, or use one of "
                    f"{', '.join(ROLE_ARGS)}")
            wants_value = ROLE_ARGS.get(flag, True) and not inline
        elif wants_value:
            wants_value = False
        else:
            errors.append(
                f"{field}: {arg!r} is a value after no option that takes one; a role's "
                "extraArgs are options of ROLE_ARGS, each value right after its option "
                "(e.g. '--max-num-seqs', '8' or '--max-num-seqs=8')")
    return errors


def extra_args_errors(spec: Spec) -> list[str]:
    errors = []
    arg_lists = [("engine", spec.engine.extra_args)] + [
        (role, getattr(spec, role).extra_args) for role in ROLES
    ]
    for where, args in arg_lists:
        managed = []
        for i, arg in enumerate(args):
            flag = _flag(arg)
            if flag in MANAGED_ARGS or (
                    flag in TRACING_ARGS and spec.monitoring.tracing.otlp_endpoint is not None):
                managed.append(i)
                errors.append(
                    f"spec.{where}.extraArgs[{i}]: {arg!r} is managed by the operator; set "
                    "the matching spec field instead"
                )
        if where != "engine":
            errors += [e for e in role_args_errors(where, args)
                       if not any(e.startswith(f"spec.{where}.extraArgs[{i}]:")
                                  for i in managed)]
    env_lists = [("engine", spec.engine.extra_env)] + [
        (role, getattr(spec, role).extra_env) for role in ROLES
    ]
    for where, env_list in env_lists:
        for i, env in enumerate(env_list):
            if env.name.startswith(MANAGED_ENV_PREFIXES):
                errors.append(
                    f"spec.{where}.extraEnv[{i}].name: {env.name!r} is managed by the "
                    f"operator (names starting with {', '.join(MANAGED_ENV_PREFIXES)} are "
                    "not allowed)"
                )
            elif where != "engine" and env.name not in ROLE_ENV:
                errors.append(
                    f"spec.{where}.extraEnv[{i}].name: {env.name!r} is not one a role may "
                    "set alone (it could change the weights, tokens or KV one role computes "
                    "for the other); set it in spec.engine.extraEnv, for both roles, or use "
                    f"one of {', '.join(ROLE_ENV)}")
    return errors


def _env(name: str, value: str | dict[str, Any]) -> dict[str, Any]:
    return {"name": name, **(value if isinstance(value, dict) else {"value": value})}


def otlp_headers_env(spec: Spec) -> list[dict[str, Any]]:
    """The collector's headers from their Secret, for every process that exports spans."""
    ref = spec.monitoring.tracing.headers_secret_ref
    if ref is None or spec.monitoring.tracing.otlp_endpoint is None:
        return []
    return [_env("OTEL_EXPORTER_OTLP_TRACES_HEADERS",
                 {"valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})]


def build_role_config(spec: Spec, role: str,
                      listen: Listen = POD) -> RoleConfig:
    if role not in ROLES:
        raise ValueError(f"role {role!r}: must be one of {', '.join(ROLES)}")
    errors = extra_args_errors(spec)
    if errors:
        raise RoleConfigError("; ".join(errors))
    role_spec = getattr(spec, role)
    kvt = kv_transfer_config(spec, role)
    args = [
        "--model", spec.model.name,
        "--served-model-name", spec.model.served_name or spec.model.name,
        "--host", listen.bind_host,
        "--port", str(listen.http_port),
        "--tensor-parallel-size", str(role_spec.tensor_parallel_size),
        "--dtype", spec.model.dtype,
    ]
    if spec.model.max_model_len is not None:
        args += ["--max-model-len", str(spec.model.max_model_len)]
    args.append(
        "--enable-prefix-caching" if role_spec.enable_prefix_caching
        else "--no-enable-prefix-caching"
    )
    args += ["--kv-transfer-config", json.dumps(kvt, sort_keys=True, separators=(",", ":"))]
    tracing = spec.monitoring.tracing.otlp_endpoint
    if tracing is not None:
        args += ["--otlp-traces-endpoint", tracing]
    # Role arguments come last: vLLM takes the last value of a repeated flag.
    args += [*spec.engine.extra_args, *role_spec.extra_args]

    nixl_port = listen.side_channel_port or spec.kv_transfer.side_channel_port
    env = [
        _env("VLLM_NIXL_SIDE_CHANNEL_HOST", listen.side_channel_host or POD_IP),
        _env("VLLM_NIXL_SIDE_CHANNEL_PORT", str(nixl_port)),
        _env("BIDIRKV_ROLE", role),
        # Endpoint plugins load only when named here; the general plugin is named too, as
        # the list is an allowlist for every plugin group.
        _env("VLLM_PLUGINS", "bidirkv"),
    ]
    if spec.kv_transfer.bidirectional:
        # Decode's own bounds on retained KV (bidirkv/connector/core/residency.py); the router gets
        # the same values in its config.
        env += [
            _env("BIDIRKV_RETENTION_WATERMARK", str(spec.kv_transfer.retention_watermark)),
            _env("BIDIRKV_OWNER_LEASE_SECONDS", str(spec.kv_transfer.owner_lease_seconds)),
        ]
    env.append(_env(FINGERPRINT_ENV, kv_fingerprint(spec)))
    if tracing is not None:
        # vLLM's exporter speaks gRPC unless told otherwise; the endpoint is the router's,
        # an OTLP/HTTP URL. The service name tells the roles apart in a trace.
        env += [
            _env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
            _env("OTEL_SERVICE_NAME", f"bidir-kv-{role}"),
            *otlp_headers_env(spec),
        ]
    if spec.efa.enabled:
        env += [
            _env("FI_PROVIDER", "efa"),
            _env("FI_EFA_USE_DEVICE_RDMA", "1"),
            _env("FI_EFA_ENABLE_SHM_TRANSFER", "0"),
            _env("FI_EFA_USE_HUGE_PAGE", "1" if spec.efa.hugepages_2mi else "0"),
        ]
    # Role entries come last so they win over engine-wide ones of the same name.
    extra = {e.name: e.as_env() for e in [*spec.engine.extra_env, *role_spec.extra_env]}
    env += list(extra.values())
    return RoleConfig(
        role=role,
        args=args,
        env=env,
        kv_transfer_config=kvt,
        ports={"http": listen.http_port, "nixl": nixl_port},
    )


def model_caches(spec: Spec) -> dict[str, Any] | None:
    """Each role's model cache (its own, else the engine's), as the CRD writes it; None
    when neither role has one."""
    caches = {role: getattr(spec, role).model_cache or spec.engine.model_cache
              for role in ROLES}
    if all(c is None for c in caches.values()):
        return None
    return {role: c.model_dump(by_alias=True, mode="json") if c is not None else None
            for role, c in caches.items()}


def kv_fingerprint(spec: Spec) -> str:
    """Hash of everything prefill and decode must share for their KV to be interchangeable:
    all that shapes tokens or KV, since a role may set alone only what ROLE_ARGS and
    ROLE_ENV list. The engines seed their block digests with it (FINGERPRINT_ENV), so pods
    of two versions of it, as in a rollout, never reuse each other's KV."""
    shared = {
        "model": spec.model.name,
        "dtype": spec.model.dtype,
        "maxModelLen": spec.model.max_model_len,
        "image": spec.engine.image,
        "extraArgs": spec.engine.extra_args,
        # Engine-wide env can choose kernels and KV layouts (VLLM_ATTENTION_BACKEND).
        "extraEnv": [e.as_env() for e in spec.engine.extra_env],
        "kvTransfer": spec.kv_transfer.model_dump(by_alias=True, mode="json"),
    }
    # Where each role reads its weights from: a cache can hold another snapshot of the
    # model under the same name (pre-filled, or read offline). Any change of one rolls
    # both roles, and pods of two caches never reuse each other's KV. Only when set, so
    # a spec without a cache keeps the fingerprint it had.
    caches = model_caches(spec)
    if caches is not None:
        shared["modelCache"] = caches
    blob = json.dumps(shared, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
