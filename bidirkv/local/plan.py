"""Spec -> local process plan (pure): what `bidir-kv local up` will run, before it runs it.

Every server is the container the operator renders (engines.py), with only what a pod
gets from Kubernetes mapped to this machine: pod IPs become 127.0.0.1, each server gets
its own ports, the router's ConfigMap becomes a file, and a model path relative to the
invocation directory becomes absolute (the servers run in the state directory, so the
project's own `operator/` folder never shadows the standard library module).
"""

from __future__ import annotations

import copy
import os
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from bidirkv.local.cpuset import BIND_VAR, CpuChoice, choose_cores
from bidirkv.local.engines import (
    LOCAL_OWNER,
    LOOPBACK,
    LocalPorts,
    LocalSecrets,
    engine_process,
    local_env,
    local_router_config,
    local_secrets,
)
from bidirkv.local.engines import bidirkv_command as _bidirkv_command
from bidirkv.operator.api.spec import KIND, DisaggregatedInferenceSpec, SpecError, parse_spec
from bidirkv.operator.render.children import RouterListen, router_deployment

ROLES = ("prefill", "decode")
# Inherited variables of these namespaces would change the engines behind the spec's
# back (a stray `export VLLM_...` in the shell): only the rendered ones reach them.
ENGINE_ENV_PREFIXES = ("VLLM_", "UCX_", "NIXL_", "FI_", "OMP_", "BIDIRKV_")


def read_spec_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The `.spec` of the first DisaggregatedInference in a YAML file; ValueError if none."""
    path = pathlib.Path(path)
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML: {exc}") from None
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == KIND:
            spec = doc.get("spec")
            if not isinstance(spec, dict):
                raise ValueError(f"{path}: the {KIND} has no spec mapping")
            return spec
    raise ValueError(f"{path}: no document of kind {KIND}")


def merge_patch(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """JSON merge patch (RFC 7386) of plain dicts; None deletes a key."""
    out = copy.deepcopy(dict(base))
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_patch(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def looks_like_path(name: str) -> bool:
    """A model name meant as a local folder rather than a Hugging Face id."""
    return name.startswith(("/", "./", "../", "~"))


def local_spec(spec: Mapping[str, Any], cwd: str | os.PathLike[str]) -> DisaggregatedInferenceSpec:
    """Validate a spec dict for a local run; a model path (explicit, or an existing folder
    relative to cwd) becomes absolute. Anything else stays a Hugging Face id."""
    spec = copy.deepcopy(dict(spec))
    model = spec.get("model")
    if isinstance(model, dict) and isinstance(model.get("name"), str):
        name = model["name"]
        candidate = pathlib.Path(cwd, os.path.expanduser(name))
        if looks_like_path(name) and not candidate.exists():
            raise ValueError(f"spec.model.name: {name!r}: no such folder (relative to "
                             f"{cwd}); `bidir-kv local up --tiny-model` builds the tiny test "
                             "model there")
        if looks_like_path(name) or candidate.exists():
            model["name"] = str(candidate.resolve())
    try:
        return parse_spec(spec)
    except SpecError as exc:
        raise ValueError(str(exc)) from None


@dataclass(frozen=True)
class ServerPlan:
    name: str
    role: str  # prefill | decode | router
    argv: list[str]
    env: dict[str, str]  # the rendered environment, mapped
    http_port: int
    nixl_port: int | None = None
    health_path: str = "/health"
    cpus: frozenset[int] | None = None  # the cores it starts on; None: any

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    @property
    def health_url(self) -> str:
        return self.url + self.health_path


@dataclass(frozen=True)
class StackPlan:
    engines: list[ServerPlan]
    router: ServerPlan
    router_config: dict[str, Any]
    router_config_path: pathlib.Path
    ports: dict[str, int] = field(default_factory=dict)
    cpu_choice: CpuChoice | None = None

    @property
    def servers(self) -> list[ServerPlan]:
        return [*self.engines, self.router]


def engine_names(spec: DisaggregatedInferenceSpec) -> list[tuple[str, str]]:
    """(role, name) of every engine, in start order: prefill-0.., decode-0.."""
    return [(role, f"{role}-{i}") for role in ROLES
            for i in range(getattr(spec, role).initial_replicas())]


def ports_needed(spec: DisaggregatedInferenceSpec) -> list[str]:
    """What each port is for, in allocation order: the router, then http + nixl per engine."""
    out = ["router http"]
    for _, name in engine_names(spec):
        out += [f"{name} http", f"{name} nixl side channel"]
    return out


def router_process(config_path: pathlib.Path, port: int, spec: DisaggregatedInferenceSpec,
                   secrets: LocalSecrets) -> tuple[list[str], dict[str, str]]:
    """The router container rendered for this machine (its config file, the loopback
    address, its own port) as a command and env."""
    where = RouterListen(config_path=str(config_path), bind_host=LOOPBACK, port=port,
                            metrics_port=None)
    c = router_deployment(LOCAL_OWNER, spec, where)["spec"]["template"]["spec"]["containers"][0]
    command = list(c["command"])
    if command[0] == "bidir-kv":
        command[0] = _bidirkv_command()
    return command + list(c["args"]), local_env(c.get("env", []), secrets)


def decode_binds(engines: list[ServerPlan]) -> dict[str, str | None]:
    """Each decode engine's rendered VLLM_CPU_OMP_THREADS_BIND (None: not set)."""
    return {e.name: e.env.get(BIND_VAR) for e in engines if e.role == "decode"}


def plan_stack(spec: DisaggregatedInferenceSpec, ports: list[int],
               state_dir: pathlib.Path, secrets: LocalSecrets | None = None,
               available_cores: frozenset[int] | None = None) -> StackPlan:
    """The processes of a local stack on the given ports (in `ports_needed` order); a fresh
    handle key unless `secrets` are given. `available_cores`: the cores the stack may use
    (None: unknown, nothing is pinned); the router gets those decode leaves."""
    secrets = local_secrets() if secrets is None else secrets
    labels = ports_needed(spec)
    if len(ports) != len(labels):
        raise ValueError(f"{len(labels)} ports needed ({', '.join(labels)}), got {len(ports)}")
    if len(set(ports)) != len(ports):
        raise ValueError(f"ports must be distinct, got {ports}")
    engines: list[ServerPlan] = []
    by_role: dict[str, list[LocalPorts]] = {role: [] for role in ROLES}
    it = iter(ports[1:])
    for role, name in engine_names(spec):
        lp = LocalPorts(http=next(it), nixl=next(it))
        argv, env = engine_process(spec, role, lp, secrets)
        engines.append(ServerPlan(name, role, argv, env, lp.http, lp.nixl))
        by_role[role].append(lp)
    cfg = local_router_config(spec, by_role["prefill"], by_role["decode"])
    cfg_path = state_dir / "router.json"
    router_argv, router_env = router_process(cfg_path, ports[0], spec, secrets)
    choice = choose_cores(decode_binds(engines), available_cores)
    # Only the router: pinning the engines' API servers too gained nothing measured
    # (docs/local-stack.md), and their workers inherit the API server's cores unless the
    # engine core moves itself onto its VLLM_CPU_OMP_THREADS_BIND cores
    # (connector/patches/cpu.py, which can be switched off).
    router = ServerPlan("router", "router", router_argv, router_env, ports[0],
                        health_path="/ready", cpus=choice.cores)
    return StackPlan(engines, router, cfg, cfg_path, dict(zip(labels, ports, strict=True)),
                     choice)


def cpu_line(plan: StackPlan) -> str:
    """Where the router runs, in one line: 'router on cores 0 (decode binds 1)'."""
    return (plan.cpu_choice or CpuChoice(None, frozenset(), "not planned")).line("router")


def process_env(rendered: Mapping[str, str], base: Mapping[str, str]) -> dict[str, str]:
    """The host environment (PATH, HOME, ...) without engine variables, plus the rendered env."""
    env = {k: v for k, v in base.items() if not k.startswith(ENGINE_ENV_PREFIXES)}
    env.update(rendered)
    return env
