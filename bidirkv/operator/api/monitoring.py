"""What a DisaggregatedInference offers to a cluster's monitoring: a PodMonitor for its
engines and where the router and the engines send their traces."""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import ConfigDict, Field, field_validator, model_validator

from bidirkv.knobs import TracingKnobs
from bidirkv.operator.api.base import _Model, check_labels
from bidirkv.operator.api.router import SecretKeyRef

# prometheus-operator's Duration grammar (its CRDs validate intervals with it).
DURATION_PATTERN = (r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                    r"(([0-9]+)s)?(([0-9]+)ms)?)$")


class PodMonitorSpec(_Model):
    enabled: bool = Field(
        default=False,
        description="Create a prometheus-operator PodMonitor (monitoring.coreos.com/v1) "
        "that scrapes this resource's prefill and decode pods: vLLM's `/metrics` on the "
        "`http` port, with bidir-kv's `vllm:bidirkv_*` counters. The cluster needs "
        "prometheus-operator's CRDs; without them the resource is not Ready and its "
        "Reconciled condition says why (reason `KindMissing`; retried until they are "
        "installed). Turned off again, the operator deletes the PodMonitor it created.",
    )
    interval: str = Field(
        default="30s", pattern=DURATION_PATTERN, max_length=32,
        description="Scrape interval (a Prometheus duration, e.g. 15s, 1m).",
    )
    scrape_timeout: str | None = Field(
        default=None, pattern=DURATION_PATTERN, max_length=32,
        description="Scrape timeout; unset: Prometheus' own (at most the interval).",
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="Extra labels on the PodMonitor, e.g. the one your Prometheus selects "
        "PodMonitors by (`release: prometheus`).",
    )

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        return check_labels(value)


class TracingSpec(TracingKnobs, _Model):
    # The knobs the router reads too (bidirkv/knobs.py), and the collector's headers (no
    # docstring: it would become the schema's description). The headers are usually a
    # bearer token: over plain HTTP anyone on the path reads it.
    model_config = ConfigDict(
        **_Model.model_config,
        json_schema_extra={"x-kubernetes-validations": [{
            "rule": "!has(self.headersSecretRef) || !has(self.otlpEndpoint) || "
            "!self.otlpEndpoint.lowerAscii().startsWith('http://') || "
            "self.allowInsecureHeaders",
            "message": "headersSecretRef is refused with a plain http:// otlpEndpoint (the "
            "headers would travel in clear text): use https://, or set "
            "allowInsecureHeaders: true", "fieldPath": ".headersSecretRef"}]},
    )

    headers_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="A Secret key holding the headers the collector wants (`key=value` "
        "pairs separated by commas, e.g. `authorization=Bearer TOKEN`), given to the "
        "router and both engines as OTEL_EXPORTER_OTLP_TRACES_HEADERS: a token never "
        "sits in the URL, the ConfigMap or pod arguments. They go to `otlpEndpoint`, "
        "wherever it points: whoever writes this resource can send any Secret key of the "
        "namespace there. Refused with a plain `http://` endpoint unless "
        "`allowInsecureHeaders` is true.",
    )
    allow_insecure_headers: bool = Field(
        default=False,
        description="Send `headersSecretRef`'s headers to a plain `http://` endpoint, in "
        "clear text to anyone on the path (e.g. a collector on the node or behind a "
        "mesh that encrypts). Off: only `https://` endpoints get them.",
    )

    @model_validator(mode="after")
    def _headers_in_clear(self) -> TracingSpec:
        problem = insecure_headers_problem(self)
        if problem:
            raise ValueError(problem)
        return self


def insecure_headers_problem(tracing: TracingSpec) -> str | None:
    """The CEL rule on TracingSpec, in Python, with the values."""
    if tracing.headers_secret_ref is None or tracing.otlp_endpoint is None:
        return None
    if urlsplit(tracing.otlp_endpoint).scheme != "http" or tracing.allow_insecure_headers:
        return None
    return (f"headersSecretRef: {tracing.headers_secret_ref.name!r} would be sent in clear "
            f"text to otlpEndpoint {tracing.otlp_endpoint!r}: use an https:// endpoint, or "
            "set allowInsecureHeaders: true")


class MonitoringSpec(_Model):
    pod_monitor: PodMonitorSpec = Field(
        default_factory=PodMonitorSpec, description="Scraping the engine pods."
    )
    tracing: TracingSpec = Field(
        default_factory=TracingSpec, description="OpenTelemetry traces of the router and "
        "the engines.",
    )
