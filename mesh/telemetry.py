"""Tracing across every hop (OpenTelemetry spans, W3C trace context carried in gRPC metadata) and metrics.

`setup_tracing(spec, service)` configures this process once: `none` (default),
`console`, `otlp` (the OTLP/gRPC exporter, from the `otlp` extra; endpoint from
the standard OTEL_EXPORTER_OTLP_* variables; sent in batches off the request's path) or `file:PATH` (each finished span
appended to PATH as one JSON line; every process of a mesh may share the file).
Clients put `outgoing_metadata()` on their calls; servers open their span with
`server_span(grpc_context, name)`, which continues the caller's trace, and `child_span(name)` opens one inside it.
A process with `none` makes no span at all (each would be OpenTelemetry's no-op, a few µs of Python apiece
on a request's path, tens with cold caches): the caller's context still goes on to the next hop.

`push_metrics_reader(spec)` is the reader that pushes an instance's metrics (same specs; `file:PATH`
appends one JSON line per data point at each export), or None for `none`; `mesh.metrics` adds it next
to the Prometheus endpoint every instance serves.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
from typing import Iterator, Sequence

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    MetricExportResult,
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)


def _append_lines(path: str, records: Sequence[dict]) -> None:
    """Append JSON lines under an exclusive lock: lines of several processes stay whole."""
    lines = "".join(json.dumps(r) + "\n" for r in records)
    with open(path, "a", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(lines)
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)


class JsonLinesExporter(SpanExporter):
    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        _append_lines(self.path, [span_record(s) for s in spans])
        return SpanExportResult.SUCCESS


class JsonLinesMetricExporter(MetricExporter):
    """One line per data point: name, attributes, value, service, pid, time_ns."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        records = []
        for resource in metrics_data.resource_metrics:
            service = resource.resource.attributes.get("service.name")
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        records.append({"name": metric.name, "attributes": dict(point.attributes or {}),
                                        "value": getattr(point, "value", None), "service": service,
                                        "pid": os.getpid(), "time_ns": point.time_unix_nano})
        _append_lines(self.path, records)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        pass


def span_record(span: ReadableSpan) -> dict:
    ctx = span.get_span_context()
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
        "service": span.resource.attributes.get("service.name"),
        "pid": os.getpid(),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
    }


def _exporter(spec: str, setting: str, console, to_file, otlp: tuple[str, str]):
    """The exporter `spec` names (none | console | otlp | file:PATH), or None for none."""
    if spec == "none":
        return None
    if spec == "console":
        return console()
    if spec.startswith("file:") and len(spec) > 5:
        return to_file(spec[5:])
    if spec == "otlp":
        module, name = otlp
        try:
            return getattr(importlib.import_module(module), name)()
        except ImportError:
            raise ValueError(f"{setting} 'otlp' needs the OTLP exporter: pip install 'infermesh[otlp]'") from None
    raise ValueError(f"{setting} must be none, console, otlp or file:PATH, got {spec!r}")


def setup_tracing(spec: str, service: str) -> TracerProvider | None:
    exporter = _exporter(spec, "trace", ConsoleSpanExporter, JsonLinesExporter,
                         ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "OTLPSpanExporter"))
    if exporter is None:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(span_processor(spec, exporter))
    trace.set_tracer_provider(provider)
    return provider


def span_processor(spec: str, exporter: SpanExporter) -> SpanProcessor:
    """Local exporters (console, file) write each span as it ends, so none is lost at exit; OTLP sends them in
    batches from a thread of its own: a collector that is slow or gone must not hold up the request that ended
    a span (in the router, the event loop every stream is relayed on). Its queue is flushed at shutdown."""
    return BatchSpanProcessor(exporter) if spec == "otlp" else SimpleSpanProcessor(exporter)


def push_metrics_reader(spec: str, interval_s: float = 10.0) -> MetricReader | None:
    """The reader that pushes metrics where `spec` says every `interval_s` (none: None; Prometheus pulls
    them from `mesh.metrics` whatever this says)."""
    exporter = _exporter(spec, "metrics", ConsoleMetricExporter, JsonLinesMetricExporter,
                         ("opentelemetry.exporter.otlp.proto.grpc.metric_exporter", "OTLPMetricExporter"))
    return None if exporter is None else PeriodicExportingMetricReader(exporter,
                                                                         export_interval_millis=interval_s * 1000)


def tracer() -> trace.Tracer:
    return trace.get_tracer("infermesh")


def recording() -> bool:
    """Whether this process records spans (`setup_tracing` gave it an exporter). When not, a span would be
    OpenTelemetry's no-op, the current one handed back: callers skip making it, off every request's path."""
    return isinstance(trace.get_tracer_provider(), TracerProvider)


def child_span(name: str, **options) -> contextlib.AbstractContextManager[trace.Span]:
    """A span inside the current one (the current one itself when this process records none); `options` go to
    `start_as_current_span` (kind, attributes)."""
    if not recording():
        return contextlib.nullcontext(trace.get_current_span())
    return tracer().start_as_current_span(name, **options)


def outgoing_metadata(extra: Sequence[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """gRPC metadata carrying the current trace context (W3C traceparent/tracestate)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(extra) + sorted(carrier.items())


@contextlib.contextmanager
def server_span(grpc_context, name: str, **attributes) -> Iterator[trace.Span]:
    """A span continuing the trace the caller sent in its metadata."""
    carrier = {k: v for k, v in (grpc_context.invocation_metadata() or ())}
    token = otel_context.attach(propagate.extract(carrier))
    try:
        with child_span(name, kind=trace.SpanKind.SERVER, attributes=attributes) as current:
            yield current  # (with no span of ours, the caller's context still goes on to the next hop)
    finally:
        otel_context.detach(token)
