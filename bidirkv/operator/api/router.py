"""The router of a DisaggregatedInference."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from bidirkv.knobs import HandleStoreUrl, RouterKnobs
from bidirkv.operator.api.base import _Model


class ServiceType(StrEnum):
    ClusterIP = "ClusterIP"
    NodePort = "NodePort"
    LoadBalancer = "LoadBalancer"


class SecretKeyRef(_Model):
    name: str = Field(min_length=1, max_length=253, description="Secret name.")
    key: str = Field(min_length=1, max_length=253, description="Key in the Secret.")


class HandleStoreSpec(_Model):
    url: HandleStoreUrl = Field(
        description="Redis-protocol server shared by the router replicas (Valkey, Redis, "
        "ElastiCache without cluster mode): `redis://HOST:PORT/DB`, `rediss://` for TLS. "
        "No password here: use `passwordSecretRef`.",
    )
    password_secret_ref: SecretKeyRef | None = Field(
        default=None, description="Where the store's password is (read by the router pods)."
    )


class RouterSpec(RouterKnobs, _Model):
    """The knobs the router reads from its ConfigMap (bidirkv/knobs.py), and what only its
    Deployment and Service hold."""

    replicas: int = Field(default=1, ge=1, le=64, description="Router pods.")
    image: str = Field(
        default="bidir-kv:0.1.0",
        min_length=1,
        description="Router image (the bidir-kv image; command `bidir-kv router`).",
    )
    port: int = Field(default=8000, ge=1, le=65535, description="Router service port.")
    service_type: ServiceType = Field(
        default=ServiceType.ClusterIP, description="Kubernetes Service type of the router."
    )
    handle_store: HandleStoreSpec | None = Field(
        default=None,
        description="Share conversation handles between router replicas (and across router "
        "restarts) through a Redis-protocol store. Required when `replicas` > 1.",
    )
