"""The router's TracerProvider: who decides sampling, and how long a span's strings may be
(bidirkv/router/tracing/spans.py records the spans)."""

from __future__ import annotations

import random
from typing import Any

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import get_current_span

from bidirkv.router.config import Tracing
from bidirkv.router.tracing.spanfile import SpanFileExporter

# Longest string attribute value kept, in characters: a model name or an id is far
# shorter, and 2,000,000 characters from a client must not become 2 MB per span queued.
MAX_ATTRIBUTE_CHARS = 256


def bounded(value: Any) -> Any:
    """`value`, a string cut to MAX_ATTRIBUTE_CHARS."""
    if isinstance(value, str) and len(value) > MAX_ATTRIBUTE_CHARS:
        return value[:MAX_ATTRIBUTE_CHARS]
    return value


class OwnDraw(Sampler):
    """Sampled at `ratio` by a draw of the router's own: for a client's trace, whose
    sampled flag and trace id the client chose."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio

    def should_sample(self, parent_context: Any, trace_id: int, name: str,
                      kind: Any = None, attributes: Any = None, links: Any = None,
                      trace_state: Any = None) -> SamplingResult:
        sampled = self.ratio >= 1.0 or random.random() < self.ratio
        parent = _parent_span_context(parent_context)
        return SamplingResult(Decision.RECORD_AND_SAMPLE if sampled else Decision.DROP,
                              attributes if sampled else None,
                              parent.trace_state if parent is not None else None)

    def get_description(self) -> str:
        return f"OwnDraw{{{self.ratio}}}"


def _parent_span_context(parent_context: Any) -> Any:
    ctx = get_current_span(parent_context).get_span_context()
    return ctx if ctx is not None and ctx.is_valid else None


def router_sampler(ratio: float) -> Sampler:
    """The router decides: its own traces by their id at `ratio`, a client's by its own
    draw at `ratio`; a leg follows its request."""
    own = OwnDraw(ratio)
    return ParentBased(TraceIdRatioBased(ratio), remote_parent_sampled=own,
                       remote_parent_not_sampled=own)


def make_provider(cfg: Tracing) -> TracerProvider:
    """A TracerProvider exporting to what `cfg` names; ConfigError when the file cannot
    be opened."""
    # OTEL_RESOURCE_ATTRIBUTES (a pod's name, its namespace) adds to the resource;
    # serviceName wins over OTEL_SERVICE_NAME.
    provider = TracerProvider(
        sampler=router_sampler(cfg.sample_ratio),
        span_limits=SpanLimits(max_attribute_length=MAX_ATTRIBUTE_CHARS),
        resource=Resource.create({SERVICE_NAME: cfg.service_name}),
        shutdown_on_exit=False,  # the router shuts it down; atexit would keep it alive
    )
    if cfg.file is not None:
        provider.add_span_processor(BatchSpanProcessor(SpanFileExporter(cfg.file)))
    if cfg.otlp_endpoint is not None:
        # Imported only when used: it brings protobuf and requests along.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=cfg.otlp_endpoint)))
    return provider
