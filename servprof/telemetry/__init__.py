"""OpenTelemetry for servprof: a SERVER span per request, GenAI server metrics, and phase
spans plus finding events for sampled requests once their session is analysed.

    observer = create_observer(settings)   # the middleware does this once
    status()                               # exporter and dropped-span counts, for /servprof/status

Where spans go is chosen by SERVPROF_TELEMETRY_EXPORTER and the OTEL_* variables; see
servprof.telemetry.setup.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.trace.export import SpanExporter

from servprof.settings import Settings
from servprof.telemetry.observer import TelemetryObserver
from servprof.telemetry.setup import EXPORTER_ENV, build_pipeline

__all__ = ["create_observer", "status", "shutdown", "TelemetryObserver", "EXPORTER_ENV"]

# The observer created last: what status() reports on. A server makes one.
_current: TelemetryObserver | None = None
_current_exporter: str | None = None
_current_details: dict[str, Any] = {}  # why there is no observer, where a setting says so


def create_observer(
    settings: Settings,
    environ: Mapping[str, str] | None = None,
    span_exporter: SpanExporter | None = None,
    metric_reader: MetricReader | None = None,
) -> TelemetryObserver | None:
    """The telemetry observer for these settings, or None when telemetry is off
    (settings.telemetry false, or SERVPROF_TELEMETRY_EXPORTER=none). Raises
    servprof.settings.SettingsError naming the variable when an OTEL_* / SERVPROF_* value is bad."""
    global _current, _current_exporter, _current_details
    _current_details = {}
    if not settings.telemetry:
        _current, _current_exporter = None, "disabled"
        return None
    pipeline = build_pipeline(settings, environ, span_exporter=span_exporter, metric_reader=metric_reader)
    if pipeline.exporter == "none":
        _current, _current_exporter = None, "none"
        _current_details = dict(pipeline.details)
        return None
    observer = TelemetryObserver(pipeline, capture_content=settings.capture_content)
    _current, _current_exporter = observer, pipeline.exporter
    return observer


def status() -> dict[str, Any]:
    """Telemetry's part of /servprof/status: exporter, span counts (dropped included)."""
    if _current is None:
        return {"exporter": _current_exporter or "not started", **_current_details}
    return _current.status()


def shutdown() -> None:
    """Flush and stop the current observer's exporters (a server's shutdown hook may call it;
    servprof's providers also shut down at interpreter exit). status() still reports the
    final counts afterwards."""
    if _current is not None:
        _current.shutdown()
