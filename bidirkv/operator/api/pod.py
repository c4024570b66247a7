"""Pod-level parts of the engine spec: environment, resources, scheduling, volumes and the
model cache. Kubernetes objects the operator passes through (volumes, mounts, env
sources, spread constraints) are checked with the official client's models."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import Field, StringConstraints, model_validator

from bidirkv.operator.api.base import Amount, DnsName, EnvName, Quantity, _Model, kube_object

AbsolutePath = Annotated[str, StringConstraints(pattern=r"^/", max_length=4096)]
# Where the official vLLM image (running as root) keeps Hugging Face downloads; HF_HOME is
# set to the mount path as well, so a non-root image caches there too.
DEFAULT_CACHE_PATH = "/root/.cache/huggingface"

EnvVarSource = kube_object("V1EnvVarSource")
EnvFromSource = kube_object("V1EnvFromSource")
Volume = kube_object("V1Volume")
VolumeMount = kube_object("V1VolumeMount")
TopologySpreadConstraint = kube_object("V1TopologySpreadConstraint")


class EnvVar(_Model):
    name: EnvName = Field(description="Environment variable name.")
    value: str | None = Field(default=None, max_length=32768, description="Value.")
    value_from: EnvVarSource | None = Field(
        default=None,
        description="A value from a Secret, ConfigMap or the pod (an EnvVarSource, e.g. "
        "`secretKeyRef: {name: hf-token, key: token}`), instead of `value`.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"env {self.name!r}: set value or valueFrom, not both")
        return self

    def as_env(self) -> dict[str, Any]:
        if self.value_from is not None:
            return {"name": self.name, "valueFrom": dict(self.value_from)}
        return {"name": self.name, "value": self.value or ""}


class LocalObjectReference(_Model):
    name: DnsName = Field(description="Name of the object in the same namespace.")


class ResourceRequirements(_Model):
    requests: dict[str, Amount] = Field(
        default_factory=dict, description="Resource requests, as in a container spec."
    )
    limits: dict[str, Amount] = Field(
        default_factory=dict,
        description="Resource limits, as in a container spec (e.g. `nvidia.com/gpu: 8`).",
    )


class Toleration(_Model):
    key: str | None = Field(default=None, description="Taint key to tolerate.")
    operator: str | None = Field(
        default=None,
        pattern="^(Exists|Equal)$",
        description="`Exists` or `Equal` (default `Equal`).",
    )
    value: str | None = Field(default=None, description="Taint value for `Equal`.")
    effect: str | None = Field(
        default=None,
        pattern="^(NoSchedule|PreferNoSchedule|NoExecute)?$",
        description="Taint effect to tolerate; empty matches all.",
    )
    toleration_seconds: int | None = Field(
        default=None, description="For NoExecute: how long the pod stays bound."
    )


class HostPathType(StrEnum):
    DirectoryOrCreate = "DirectoryOrCreate"
    Directory = "Directory"


class ClaimCache(_Model):
    claim_name: DnsName = Field(
        description="An existing PersistentVolumeClaim; shared by every pod of the role, so "
        "ReadWriteMany (FSx for Lustre, EFS) unless there is one pod, or `readOnly` with a "
        "pre-filled volume.")
    read_only: bool = Field(default=False, description="Mount read-only (a pre-filled cache).")


class HostPathCache(_Model):
    path: AbsolutePath = Field(
        description="A directory on the node, e.g. local NVMe (`/opt/dlami/nvme/models` on "
        "p5/p5en nodes): each node downloads once, pods on it share the copy.")
    type: HostPathType = Field(default=HostPathType.DirectoryOrCreate,
                               description="`DirectoryOrCreate` or `Directory` (must exist).")


class EmptyDirCache(_Model):
    size_limit: Quantity | None = Field(
        default=None, description="Most the cache may hold on the node's disk (e.g. `200Gi`).")


class ModelCacheSpec(_Model):
    persistent_volume_claim: ClaimCache | None = Field(
        default=None, description="Cache on a PersistentVolumeClaim.")
    host_path: HostPathCache | None = Field(default=None, description="Cache on the node.")
    empty_dir: EmptyDirCache | None = Field(
        default=None, description="Cache that lives as long as the pod (survives container "
        "restarts only).")
    mount_path: AbsolutePath = Field(
        default=DEFAULT_CACHE_PATH,
        description="Where the cache is mounted; the engine's HF_HOME points there, so vLLM "
        "downloads into it and finds what an earlier pod downloaded.")

    @model_validator(mode="after")
    def _one_source(self) -> ModelCacheSpec:
        sources = [s for s in ("persistent_volume_claim", "host_path", "empty_dir")
                   if getattr(self, s) is not None]
        if len(sources) != 1:
            raise ValueError("set exactly one of persistentVolumeClaim, hostPath, emptyDir "
                             f"(got {len(sources)})")
        return self

    def volume_source(self) -> dict[str, Any]:
        if self.persistent_volume_claim is not None:
            claim = self.persistent_volume_claim
            return {"persistentVolumeClaim": {"claimName": claim.claim_name,
                                              **({"readOnly": True} if claim.read_only else {})}}
        if self.host_path is not None:
            return {"hostPath": {"path": self.host_path.path, "type": self.host_path.type}}
        assert self.empty_dir is not None
        size = self.empty_dir.size_limit
        return {"emptyDir": {"sizeLimit": size} if size else {}}
