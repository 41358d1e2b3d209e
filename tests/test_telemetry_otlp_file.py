"""The embedded OTLP-JSON-lines file (wire level) and how the exporter is chosen."""

from __future__ import annotations

import base64
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from _telemetry_helpers import ObserverProbe, chat_body, make_app, serve
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from servprof import telemetry
from servprof.settings import Settings, SettingsError
from servprof.telemetry.otlp_file import OtlpJsonLinesSpanExporter, parse_trace_line
from servprof.telemetry.setup import build_pipeline, choose_exporter

HEX32 = re.compile(r"^[0-9a-f]{32}$")
HEX16 = re.compile(r"^[0-9a-f]{16}$")


def _walk_spans(line: dict[str, Any]) -> list[dict[str, Any]]:
    return [span for rs in line["resourceSpans"] for ss in rs["scopeSpans"] for span in ss["spans"]]


def _independent_parse(raw: dict[str, Any]) -> ExportTraceServiceRequest:
    """The OTLP JSON mapping's ids are hex; protobuf's JSON parser wants base64 for bytes."""
    for span in _walk_spans(raw):
        for item in (span, *span.get("links", [])):
            for key in ("traceId", "spanId", "parentSpanId"):
                if key in item:
                    item[key] = base64.b64encode(bytes.fromhex(item[key])).decode()
    return json_format.ParseDict(raw, ExportTraceServiceRequest())


def test_spans_file_follows_the_otlp_json_mapping(tmp_path: Path) -> None:
    observer = telemetry.create_observer(Settings(out_dir=tmp_path, service_name="wire-test"), environ={})
    assert telemetry.status()["exporter"] == "file"
    probe = ObserverProbe(make_app(), observer)
    with serve(probe) as url, httpx.Client() as client:
        assert client.get(url + "/hello").status_code == 200
        assert (
            client.post(
                url + "/v1/chat/completions",
                content=chat_body(stream=True),
                headers={"x-sample": "1", "traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"},
            ).status_code
            == 200
        )
        records = probe.wait_records(2)
    sampled = records[1]
    observer.on_analysis(
        {
            "session_id": "s",
            "trace_file": "t.pt.trace.json.gz",
            "error": None,
            "requests": {
                sampled.request_id: {"phases": [{"name": "prefill", "start_us": 1.0, "end_us": 2.0}]}
            },
            "findings": [
                {
                    "kind": "decode_gap",
                    "severity": "warning",
                    "cost_ms": 2.0,
                    "start_us": 1.5,
                    "end_us": 2.0,
                    "request_ids": [sampled.request_id],
                    "title": "t",
                },
                {  # names no request: the session's, on its own span linked to the request span
                    "kind": "bandwidth_bound_decode",
                    "severity": "info",
                    "cost_ms": 1.0,
                    "start_us": 0.0,
                    "end_us": 0.0,
                    "request_ids": [],
                    "title": "whole trace",
                },
            ],
            "clock": {"trace_us_to_unix_ns_offset": sampled.arrival_ns},
        },
        records,
    )
    telemetry.shutdown()  # flushes

    lines = (tmp_path / "spans" / "spans.otlp.jsonl").read_bytes().splitlines()
    assert lines
    spans = []
    for line in lines:
        raw = orjson.loads(line)
        assert set(raw) == {"resourceSpans"}
        for span in _walk_spans(raw):
            assert HEX32.match(span["traceId"]) and HEX16.match(span["spanId"]), span
            assert "parentSpanId" not in span or HEX16.match(span["parentSpanId"])
            assert isinstance(span["kind"], int)  # enums as integers
            assert span["startTimeUnixNano"].isdigit()  # int64 as a decimal string
            spans.append(span)
        message = _independent_parse(orjson.loads(line))
        assert message == parse_trace_line(line)
        resource = {a.key: a.value.string_value for a in message.resource_spans[0].resource.attributes}
        assert resource["service.name"] == "wire-test"
    names = {span["name"]: span for span in spans}
    assert set(names) == {"GET /hello", "POST /v1/chat/completions", "prefill", "servprof.analysis",
                          "servprof.session_analysis"}
    request = names["POST /v1/chat/completions"]
    assert request["traceId"] == "ab" * 16 and request["parentSpanId"] == "cd" * 8
    assert names["prefill"]["parentSpanId"] == request["spanId"]
    assert names["prefill"]["traceId"] == request["traceId"]
    (event,) = names["servprof.analysis"]["events"]
    assert event["name"] == "servprof.finding"
    assert {a["key"]: a["value"] for a in event["attributes"]}["servprof.finding.kind"] == {
        "stringValue": "decode_gap"
    }
    session = names["servprof.session_analysis"]
    assert session["links"][0]["spanId"] == request["spanId"] and "parentSpanId" not in session
    (event,) = session["events"]
    assert {a["key"]: a["value"] for a in event["attributes"]}["servprof.finding.kind"] == {
        "stringValue": "bandwidth_bound_decode"
    }

    metrics_lines = (tmp_path / "metrics" / "metrics.otlp.jsonl").read_bytes().splitlines()
    metrics = [
        m
        for line in metrics_lines
        for rm in json_format.ParseDict(orjson.loads(line), ExportMetricsServiceRequest()).resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    ]
    duration = next(m for m in metrics if m.name == "gen_ai.server.request.duration")
    assert duration.unit == "s" and duration.histogram.data_points[0].count == 1


def test_file_rotates_and_both_halves_parse(tmp_path: Path) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    exporter = OtlpJsonLinesSpanExporter(tmp_path / "spans.otlp.jsonl", max_bytes=2000)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("rotation")
    for index in range(30):
        tracer.start_span(f"span-{index}").end()
    provider.shutdown()
    current, older = tmp_path / "spans.otlp.jsonl", tmp_path / "spans.otlp.jsonl.1"
    assert current.stat().st_size <= 2000 and older.stat().st_size <= 2000
    names = [
        s.name
        for path in (older, current)
        for line in path.read_bytes().splitlines()
        for rs in parse_trace_line(line).resource_spans
        for ss in rs.scope_spans
        for s in ss.spans
    ]
    assert names == [f"span-{index}" for index in range(30 - len(names), 30)]


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, "file"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, "otlp"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, "otlp"),
        (
            {"SERVPROF_TELEMETRY_EXPORTER": "console", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"},
            "console",
        ),
        ({"SERVPROF_TELEMETRY_EXPORTER": " OTLP "}, "otlp"),
        ({"SERVPROF_TELEMETRY_EXPORTER": "none"}, "none"),
        # OpenTelemetry's own choice (its first entry) where servprof's is auto
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, "none"),
        ({"OTEL_TRACES_EXPORTER": "console,otlp"}, "console"),
        ({"OTEL_TRACES_EXPORTER": " OTLP "}, "otlp"),
        ({"OTEL_TRACES_EXPORTER": "none", "SERVPROF_TELEMETRY_EXPORTER": "file"}, "file"),
        ({"OTEL_TRACES_EXPORTER": "zipkin", "SERVPROF_TELEMETRY_EXPORTER": "otlp"}, "otlp"),
    ],
)
def test_exporter_choice(environ: dict[str, str], expected: str) -> None:
    assert choose_exporter(environ) == expected


def test_an_otel_traces_exporter_servprof_lacks_is_named() -> None:
    with pytest.raises(SettingsError, match="OTEL_TRACES_EXPORTER='zipkin': servprof's own spans go to otlp, console"):
        choose_exporter({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_otlp_protocols_and_bad_values(tmp_path: Path) -> None:
    settings = Settings(out_dir=tmp_path)
    grpc = build_pipeline(
        settings,
        {
            "SERVPROF_TELEMETRY_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1",
        },
    )
    http = build_pipeline(settings, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1/v1/traces"})
    base = build_pipeline(
        settings,
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/",
            "OTEL_EXPORTER_OTLP_HEADERS": "x-api-key=s3cret",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "0.5",
        },
    )
    try:
        assert grpc.status()["protocol"] == "grpc" and http.status()["protocol"] == "http/protobuf"
        assert grpc.status()["endpoint"] == "http://127.0.0.1:1"  # gRPC takes the base as is
        assert http.status()["endpoint"] == "http://127.0.0.1:1/v1/traces"
        assert base.status()["endpoint"] == "http://collector:4318/v1/traces"  # the signal path is added
        assert base.status()["export_timeout_s"] == 0.5 and http.status()["export_timeout_s"] == 2.0
        assert "s3cret" not in str(base.status())  # headers may hold credentials: never shown
    finally:
        for pipeline in (grpc, http, base):
            pipeline.shutdown()
    with pytest.raises(SettingsError, match="OTEL_EXPORTER_OTLP_TIMEOUT='soon'"):
        build_pipeline(
            settings, {"SERVPROF_TELEMETRY_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TIMEOUT": "soon"}
        )
    with pytest.raises(SettingsError, match="SERVPROF_TELEMETRY_EXPORTER='jaeger'"):
        telemetry.create_observer(settings, environ={"SERVPROF_TELEMETRY_EXPORTER": "jaeger"})
    with pytest.raises(SettingsError, match="OTEL_EXPORTER_OTLP_PROTOCOL='http/json'"):
        build_pipeline(
            settings, {"SERVPROF_TELEMETRY_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
        )
    assert telemetry.create_observer(settings, environ={"SERVPROF_TELEMETRY_EXPORTER": "none"}) is None
    assert telemetry.status() == {"exporter": "none"}
    assert telemetry.create_observer(Settings(out_dir=tmp_path, telemetry=False), environ={}) is None
    assert telemetry.status() == {"exporter": "disabled"}
    assert not (tmp_path / "spans").exists()


@pytest.mark.parametrize("value", ["true", "TRUE", " True "])
def test_otel_sdk_disabled_turns_servprofs_own_telemetry_off(tmp_path: Path, value: str) -> None:
    """OpenTelemetry's switch for every SDK signal (OTEL_SDK_DISABLED=true) holds for servprof's own
    providers too (before: servprof built its own and wrote spans); status says why. An exporter named
    for servprof alone (SERVPROF_TELEMETRY_EXPORTER) is a deliberate choice and still runs."""
    settings = Settings(out_dir=tmp_path)
    assert telemetry.create_observer(settings, environ={"OTEL_SDK_DISABLED": value}) is None
    assert telemetry.status() == {"exporter": "none", "why": "OTEL_SDK_DISABLED=true turns OpenTelemetry's SDK off"}
    assert not (tmp_path / "spans").exists()
    assert telemetry.create_observer(settings, environ={"OTEL_SDK_DISABLED": "false"}) is not None
    assert telemetry.status()["exporter"] == "file"
    chosen = telemetry.create_observer(settings, environ={"OTEL_SDK_DISABLED": "true",
                                                          "SERVPROF_TELEMETRY_EXPORTER": "file"})
    assert chosen is not None and telemetry.status()["exporter"] == "file"
    telemetry.shutdown()


def _run_python(code: str, tmp_path: Path, **env: str) -> str:
    """Global providers can be set once per process, so these run in a fresh interpreter."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", **env},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


HOST_CODE = """
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from servprof import telemetry
    from servprof.observers import RequestRecord
    from servprof.settings import Settings

    host_exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(host_exporter))
    trace.set_tracer_provider(provider)  # as vLLM does
    observer = telemetry.create_observer(Settings(out_dir="out"))
    record = RequestRecord("r1", "GET", "/x", route="/x", arrival_ns=1, arrival_perf_ns=1, end_ns=2, status=200)
    observer.on_request_end(record, observer.on_request_start(record, {"headers": []}))
    print(telemetry.status()["exporter"], observer.dropped_spans, [s.name for s in host_exporter.get_finished_spans()])
"""


def test_host_tracer_provider_is_used_not_replaced(tmp_path: Path) -> None:
    out = _run_python(HOST_CODE, tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:1")
    assert out.split() == ["host", "None", "['GET", "/x']"]
    assert not (tmp_path / "out").exists()


CONSOLE_CODE = """
    from servprof import telemetry
    from servprof.observers import RequestRecord
    from servprof.settings import Settings

    observer = telemetry.create_observer(Settings(out_dir="out"))
    record = RequestRecord("r1", "GET", "/x", route="/x", arrival_ns=1, arrival_perf_ns=1, end_ns=2, status=200)
    observer.on_request_end(record, observer.on_request_start(record, {"headers": []}))
    telemetry.shutdown()
"""


def test_console_exporter_prints_spans(tmp_path: Path) -> None:
    out = _run_python(
        CONSOLE_CODE, tmp_path, SERVPROF_TELEMETRY_EXPORTER="console", OTEL_METRICS_EXPORTER="none"
    )
    assert '"name": "GET /x"' in out and '"servprof.request_id": "r1"' in out


@pytest.mark.parametrize(("environ", "name"), [
    ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=llm%20gateway,deployment.environment=prod"}, "llm gateway"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes", "OTEL_SERVICE_NAME": "from-name"}, "from-name"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod"}, "servprof"),
    ({}, "servprof"),
])
def test_the_service_is_named_as_opentelemetry_orders_its_variables(
        tmp_path: Path, monkeypatch: Any, environ: dict[str, str], name: str) -> None:
    """OTEL_SERVICE_NAME, then service.name in OTEL_RESOURCE_ATTRIBUTES (before: servprof's own name
    replaced the latter, so a service named only there showed in Jaeger as "servprof"), and the
    resource's other attributes kept."""
    for variable in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in environ.items():
        monkeypatch.setenv(variable, value)
    settings = Settings(out_dir=tmp_path)
    assert settings.service_name == name
    exporter = InMemorySpanExporter()
    pipeline = build_pipeline(settings, {"SERVPROF_TELEMETRY_EXPORTER": "file"}, span_exporter=exporter)
    try:
        pipeline.tracer_provider.get_tracer("test").start_span("probe").end()
        pipeline.tracer_provider.force_flush()
    finally:
        for provider in pipeline.owned:
            provider.shutdown()
    (span,) = exporter.get_finished_spans()
    assert span.resource.attributes["service.name"] == name
    if "deployment.environment" in environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        assert span.resource.attributes["deployment.environment"] == "prod"
