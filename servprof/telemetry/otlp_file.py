"""Spans and metrics as OTLP JSON lines: the OpenTelemetry Collector file exporter's format.

Each line is one ExportTraceServiceRequest (or ExportMetricsServiceRequest) in the OTLP
JSON mapping: lowerCamelCase field names, enums as integers, and trace/span ids as hex
strings (protobuf's own JSON mapping would write bytes as base64, so ids are rewritten).
The messages come from the SDK's OTLP encoders, the same bytes an OTLP exporter sends.
Writes happen on the SDK's export thread, never on the serving event loop.
"""

from __future__ import annotations

import base64
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

# A file that grows past this is renamed to "<name>.1" (replacing an older one) and a new
# one is started, so a long-running server keeps at most twice this on disk per signal.
DEFAULT_MAX_FILE_BYTES = 64 * 1024 * 1024

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _ids_to_hex(node: Any) -> None:
    """Rewrite base64 id fields to hex in place, wherever they sit (spans, links, exemplars)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _ID_FIELDS and isinstance(value, str):
                node[key] = base64.b64decode(value).hex()
            else:
                _ids_to_hex(value)
    elif isinstance(node, list):
        for item in node:
            _ids_to_hex(item)


def _ids_to_base64(node: Any) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _ID_FIELDS and isinstance(value, str):
                node[key] = base64.b64encode(bytes.fromhex(value)).decode("ascii")
            else:
                _ids_to_base64(value)
    elif isinstance(node, list):
        for item in node:
            _ids_to_base64(item)


def message_to_otlp_json(message: Any) -> bytes:
    """One OTLP protobuf message as one line of OTLP JSON (with the trailing newline)."""
    data = json_format.MessageToDict(message, use_integers_for_enums=True)
    _ids_to_hex(data)
    return orjson.dumps(data) + b"\n"


def parse_trace_line(line: bytes | str) -> ExportTraceServiceRequest:
    """Parse one line written by OtlpJsonLinesSpanExporter back into the protobuf message;
    raises ValueError (json_format.ParseError) if the line does not follow the mapping."""
    data = orjson.loads(line)
    _ids_to_base64(data)
    return json_format.ParseDict(data, ExportTraceServiceRequest())


def parse_metrics_line(line: bytes | str) -> ExportMetricsServiceRequest:
    data = orjson.loads(line)
    _ids_to_base64(data)
    return json_format.ParseDict(data, ExportMetricsServiceRequest())


class _JsonLinesFile:
    """Appends whole lines under a lock, rotating once the file passes max_bytes."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()

    def append(self, line: bytes) -> None:
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                size = 0
            if size and size + len(line) > self.max_bytes:
                self.path.replace(self.path.with_name(self.path.name + ".1"))
            # 0600: spans can carry prompts (SERVPROF_CAPTURE_CONTENT) and always carry routes and ids.
            with os.fdopen(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as handle:
                handle.write(line)


class OtlpJsonLinesSpanExporter(SpanExporter):
    """Writes each exported batch of spans as one ExportTraceServiceRequest JSON line."""

    def __init__(self, path: Path, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> None:
        self._file = _JsonLinesFile(Path(path), max_bytes)

    @property
    def path(self) -> Path:
        return self._file.path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        try:
            self._file.append(message_to_otlp_json(encode_spans(spans)))
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class OtlpJsonLinesMetricExporter(MetricExporter):
    """Writes each metrics collection as one ExportMetricsServiceRequest JSON line."""

    def __init__(self, path: Path, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> None:
        super().__init__()
        self._file = _JsonLinesFile(Path(path), max_bytes)

    @property
    def path(self) -> Path:
        return self._file.path

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        if not metrics_data.resource_metrics:
            return MetricExportResult.SUCCESS
        try:
            self._file.append(message_to_otlp_json(encode_metrics(metrics_data)))
        except OSError:
            return MetricExportResult.FAILURE
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        pass
