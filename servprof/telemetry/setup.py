"""Tracer and meter providers for servprof, chosen from SERVPROF_TELEMETRY_EXPORTER and OTEL_*.

SERVPROF_TELEMETRY_EXPORTER:
  auto (default)  the host's global tracer provider when it installed one (vLLM does);
                  otherwise OTLP when OTEL_EXPORTER_OTLP_ENDPOINT / _TRACES_ENDPOINT is set;
                  otherwise the embedded file exporter.
  otlp            the SDK's OTLP exporter; OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL picks
                  http/protobuf (default) or grpc; endpoint, headers, timeout from OTEL_*.
  file            OTLP JSON lines under <out_dir>/spans/ and <out_dir>/metrics/.
  console         one JSON object per span on stdout, for debugging.
  none            no spans and no metrics from servprof.

servprof's own providers are never installed globally: the host's instrumentation keeps
whatever it had. Spans go through a bounded BatchSpanProcessor with a short export
timeout, so an exporter that is down or slow costs serving nothing; what it loses is
counted (SpanCounts) and shown by servprof.telemetry.status().
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.util.re import parse_env_headers

from servprof.settings import Settings, SettingsError
from servprof.telemetry.otlp_file import OtlpJsonLinesMetricExporter, OtlpJsonLinesSpanExporter
from servprof.telemetry.request_span import PendingServerSpan

_logger = logging.getLogger(__name__)
FULL_QUEUE_LOG_EVERY_S = 60.0
EXPORTER_ENV = "SERVPROF_TELEMETRY_EXPORTER"
EXPORTER_CHOICES = ("auto", "otlp", "file", "console", "none")
PROTOCOL_CHOICES = ("http/protobuf", "grpc")
# The SDK's default (10 s) would hold the export thread long after a backend went away;
# a short timeout lets the queue drain sooner once it is back. OTEL_*_TIMEOUT overrides.
DEFAULT_EXPORT_TIMEOUT_S = 2.0
SPANS_FILE = Path("spans") / "spans.otlp.jsonl"
METRICS_FILE = Path("metrics") / "metrics.otlp.jsonl"


@dataclass
class SpanCounts:
    """What happened to the spans servprof's own processor was given."""

    ended: int = 0
    exported: int = 0
    export_failed: int = 0  # the exporter gave up on them (backend down, timeout, refused)
    dropped_queue_full: int = 0  # never queued: the bounded queue was full
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, count: int) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + count)

    def add_ended(self) -> None:
        with self._lock:  # the request path's count: no name lookups
            self.ended += 1

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {
                "spans_ended": self.ended,
                "spans_exported": self.exported,
                "spans_export_failed": self.export_failed,
                "spans_dropped_queue_full": self.dropped_queue_full,
                "spans_dropped": self.export_failed + self.dropped_queue_full,
            }


class _CountingExporter(SpanExporter):
    def __init__(self, inner: SpanExporter, counts: SpanCounts) -> None:
        self.inner = inner
        self.counts = counts

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        ready: list[ReadableSpan] = []
        for span in spans:
            if isinstance(span, PendingServerSpan):
                try:
                    span = span.build()  # request spans are finished here, off the request path
                except Exception:  # noqa: BLE001 - one bad record must not cost the batch
                    self.counts.add("export_failed", 1)
                    continue
            ready.append(span)
        if not ready:
            return SpanExportResult.SUCCESS
        try:
            result = self.inner.export(ready)
        except Exception:  # an exporter must not take the export thread down with it
            result = SpanExportResult.FAILURE
        self.counts.add("exported" if result is SpanExportResult.SUCCESS else "export_failed", len(ready))
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class CountingBatchSpanProcessor(SpanProcessor):
    """The SDK's BatchSpanProcessor (bounded queue, export thread; OTEL_BSP_* honoured)
    with counts of spans exported, failed and dropped because the queue was full."""

    def __init__(self, exporter: SpanExporter, **batch_options: Any) -> None:
        self.counts = SpanCounts()
        self._batch = BatchSpanProcessor(_CountingExporter(exporter, self.counts), **batch_options)
        # The SDK drops with a warning per span when its deque is full (thousands of log lines
        # a second while a backend hangs); peeking at the deque's length is the only way to
        # count that, and to drop here instead: cheaply, with one log line a minute at most.
        # Without the peek (another SDK layout) only export failures are counted.
        inner = getattr(self._batch, "_batch_processor", None)
        self._queue = getattr(inner, "_queue", None)
        self._max_queue = getattr(self._queue, "maxlen", None)
        self._full_logged_at: float | None = None

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if not span.context.trace_flags.sampled:
            return  # the batch processor ignores it too: nothing to export, nothing lost
        self.counts.add_ended()
        if self._max_queue is not None and len(self._queue) >= self._max_queue:
            # The newest span is the one lost (the SDK would evict the oldest; either way one).
            self.counts.add("dropped_queue_full", 1)
            now = time.monotonic()
            if self._full_logged_at is None or now - self._full_logged_at >= FULL_QUEUE_LOG_EVERY_S:
                self._full_logged_at = now
                _logger.warning(
                    "servprof: span queue full (%d); dropping spans until the exporter catches up "
                    "(counted in /servprof/status)", self._max_queue,
                )
            return
        self._batch.on_end(span)

    def shutdown(self) -> None:
        self._batch.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._batch.force_flush(timeout_millis)


@dataclass
class Pipeline:
    """The providers servprof's observer uses, and what it needs to report and shut down."""

    tracer_provider: trace.TracerProvider
    meter_provider: metrics.MeterProvider
    exporter: str  # host | otlp | file | console | none
    details: dict[str, Any] = field(default_factory=dict)
    span_processor: CountingBatchSpanProcessor | None = None
    owned: list[Any] = field(default_factory=list)  # providers servprof created and must shut down

    def status(self) -> dict[str, Any]:
        data: dict[str, Any] = {"exporter": self.exporter, **self.details}
        if self.span_processor is not None:
            data.update(self.span_processor.counts.as_dict())
        return data

    def force_flush(self, timeout_millis: int = 5000) -> None:
        """Export what is queued, within about `timeout_millis` in all. On a host's providers (vLLM's)
        too: at shutdown servprof's last spans are queued there."""
        providers = self.owned if self.exporter != "host" else [self.tracer_provider, self.meter_provider]
        deadline = time.monotonic() + timeout_millis / 1000
        for provider in providers:
            flush = getattr(provider, "force_flush", None)
            left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            if flush is not None and left_ms > 0:
                flush(left_ms)

    def shutdown(self) -> None:
        for provider in self.owned:
            provider.shutdown()
        self.owned.clear()


def _env(environ: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return value
    return None


def _host_tracer_provider() -> trace.TracerProvider | None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    return provider


def _host_meter_provider() -> metrics.MeterProvider | None:
    provider = metrics.get_meter_provider()
    # Until a host sets one, the API hands out a proxy that forwards to nothing.
    if type(provider).__name__ == "_ProxyMeterProvider" or isinstance(provider, metrics.NoOpMeterProvider):
        return None
    return provider


def choose_exporter(environ: Mapping[str, str]) -> str:
    choice = (environ.get(EXPORTER_ENV) or "auto").strip().lower()
    if choice not in EXPORTER_CHOICES:
        raise SettingsError(f"{EXPORTER_ENV}={choice!r} is not one of {', '.join(EXPORTER_CHOICES)}")
    if choice != "auto":
        return choice
    if sdk_disabled(environ):  # OpenTelemetry's own switch for every SDK signal: servprof's too
        return "none"
    if _host_tracer_provider() is not None:
        return "host"
    named = _traces_exporter(environ)
    if named is not None:
        return named
    if _env(environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        return "otlp"
    return "file"


_OTEL_TRACES_EXPORTERS = ("otlp", "console", "none")  # (servprof's names for them are the same)


def _traces_exporter(environ: Mapping[str, str]) -> str | None:
    """OTEL_TRACES_EXPORTER, OpenTelemetry's own choice of span exporter (its first entry), where
    servprof has that exporter; None when unset."""
    value = _env(environ, "OTEL_TRACES_EXPORTER")
    if value is None:
        return None
    first = value.split(",")[0].strip().lower()
    if first not in _OTEL_TRACES_EXPORTERS:
        raise SettingsError(
            f"OTEL_TRACES_EXPORTER={value!r}: servprof's own spans go to {', '.join(_OTEL_TRACES_EXPORTERS)} "
            f"(or a host's tracer provider, which takes any); set {EXPORTER_ENV} to choose another for servprof"
        )
    return first


def sdk_disabled(environ: Mapping[str, str]) -> bool:
    """OTEL_SDK_DISABLED=true, as the SDK reads it (case-insensitive "true"; anything else is false)."""
    return (environ.get("OTEL_SDK_DISABLED") or "").strip().lower() == "true"


def _protocol(environ: Mapping[str, str], signal: str) -> str:
    name = f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL"
    protocol = _env(environ, name, "OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    if protocol not in PROTOCOL_CHOICES:
        raise SettingsError(
            f"{name} / OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: servprof exports OTLP as "
            f"{' or '.join(PROTOCOL_CHOICES)}"
        )
    return protocol


def _exporter_options(environ: Mapping[str, str], signal: str, protocol: str) -> dict[str, Any]:
    """Endpoint, headers and timeout from `environ` (passed explicitly, so a mapping other than
    os.environ is honoured too); TLS files and compression the SDK reads from os.environ."""
    options: dict[str, Any] = {}
    endpoint = _env(environ, f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
    base = _env(environ, "OTEL_EXPORTER_OTLP_ENDPOINT")
    if endpoint:
        options["endpoint"] = endpoint
    elif base:
        # The per-signal path is added to the generic endpoint for HTTP only (OTLP exporter spec).
        options["endpoint"] = base if protocol == "grpc" else f"{base.rstrip('/')}/v1/{signal.lower()}"
    headers = _env(environ, f"OTEL_EXPORTER_OTLP_{signal}_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS")
    if headers:
        options["headers"] = parse_env_headers(headers, liberal=True)
    timeout_name = f"OTEL_EXPORTER_OTLP_{signal}_TIMEOUT"
    timeout = _env(environ, timeout_name, "OTEL_EXPORTER_OTLP_TIMEOUT")
    try:
        options["timeout"] = float(timeout) if timeout else DEFAULT_EXPORT_TIMEOUT_S
    except ValueError:
        raise SettingsError(
            f"{timeout_name} / OTEL_EXPORTER_OTLP_TIMEOUT={timeout!r} is not a number"
        ) from None
    if options["timeout"] <= 0:
        raise SettingsError(f"{timeout_name} / OTEL_EXPORTER_OTLP_TIMEOUT must be > 0 (got {timeout!r})")
    return options


def _otlp_span_exporter(environ: Mapping[str, str]) -> tuple[SpanExporter, dict[str, Any]]:
    protocol = _protocol(environ, "TRACES")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    options = _exporter_options(environ, "TRACES", protocol)
    exporter = OTLPSpanExporter(**options)
    details = {
        "protocol": protocol,
        "endpoint": options.get("endpoint", "(SDK default)"),
        "export_timeout_s": options["timeout"],
    }
    return exporter, details


def _otlp_metric_exporter(environ: Mapping[str, str]) -> MetricExporter | None:
    # Metrics only go out where a metrics endpoint is configured: a trace-only backend
    # (Jaeger) would answer every collection with an error.
    if (environ.get("OTEL_METRICS_EXPORTER") or "").strip().lower() == "none":
        return None
    if not _env(environ, "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        return None
    protocol = _protocol(environ, "METRICS")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    return OTLPMetricExporter(**_exporter_options(environ, "METRICS", protocol))


def build_pipeline(
    settings: Settings,
    environ: Mapping[str, str] | None = None,
    span_exporter: SpanExporter | None = None,
    metric_reader: MetricReader | None = None,
) -> Pipeline:
    """Providers for the chosen exporter. span_exporter / metric_reader replace the configured
    ones (for tests and embedders that bring their own); raises SettingsError on bad values."""
    environ = os.environ if environ is None else environ
    choice = "custom" if span_exporter is not None else choose_exporter(environ)
    if choice == "none":
        why = {"why": "OTEL_SDK_DISABLED=true turns OpenTelemetry's SDK off"} if sdk_disabled(environ) else {}
        return Pipeline(trace.NoOpTracerProvider(), metrics.NoOpMeterProvider(), "none", why)
    if choice == "host":
        meter_provider = _host_meter_provider() or metrics.NoOpMeterProvider()
        return Pipeline(trace.get_tracer_provider(), meter_provider, "host")

    details: dict[str, Any] = {}
    metric_exporter: MetricExporter | None = None
    if choice == "custom":
        pass
    elif choice == "otlp":
        span_exporter, details = _otlp_span_exporter(environ)
        metric_exporter = _otlp_metric_exporter(environ)
    elif choice == "file":
        out_dir = Path(settings.out_dir)
        span_exporter = OtlpJsonLinesSpanExporter(out_dir / SPANS_FILE)
        metric_exporter = OtlpJsonLinesMetricExporter(out_dir / METRICS_FILE)
        details = {"spans_file": str(out_dir / SPANS_FILE), "metrics_file": str(out_dir / METRICS_FILE)}
    else:  # console
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        span_exporter, metric_exporter = ConsoleSpanExporter(), ConsoleMetricExporter()

    resource = Resource.create({"service.name": settings.service_name})
    processor = CountingBatchSpanProcessor(span_exporter)
    tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=True)
    tracer_provider.add_span_processor(processor)
    owned: list[Any] = [tracer_provider]
    meter_provider: metrics.MeterProvider = _host_meter_provider() or metrics.NoOpMeterProvider()
    if metric_exporter is not None and metric_reader is None:
        metric_reader = PeriodicExportingMetricReader(metric_exporter)
    if metric_reader is not None:
        meter_provider = MeterProvider(resource=resource, metric_readers=[metric_reader])
        owned.append(meter_provider)
    return Pipeline(tracer_provider, meter_provider, choice, details, processor, owned)
