"""How the request span is made when servprof owns the tracer provider: ids picked at arrival
by the provider's sampler (servprof decides itself only for the SDK's default sampler), and
the span built on the export thread from the finished record. Spans go through servprof's
real batch processor to the SDK's in-memory exporter."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import TraceState

from servprof.observers import RequestRecord
from servprof.settings import Settings
from servprof.telemetry import attributes as attrs
from servprof.telemetry import create_observer
from servprof.telemetry.request_span import DirectServerSpans
from servprof.telemetry.setup import CountingBatchSpanProcessor

TRACEPARENT_SAMPLED = b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01"
TRACEPARENT_UNSAMPLED = b"00-" + b"3" * 32 + b"-" + b"4" * 16 + b"-00"


def _record(request_id: str = "r-1", **fields: Any) -> RequestRecord:
    fields = {"route": "/x", "arrival_ns": 1_000, "arrival_perf_ns": 10, "end_ns": 510, "status": 200, **fields}
    return RequestRecord(request_id, "GET", "/x", **fields)


def _observe(observer: Any, record: RequestRecord, headers: list[tuple[bytes, bytes]]) -> bytes:
    """One request through the observer; the traceparent the app would have seen."""
    scope: dict[str, Any] = {"headers": list(headers), "http_version": "1.1"}
    state = observer.on_request_start(record, scope)
    observer.on_request_end(record, state)
    return dict(scope["headers"])[b"traceparent"]


@pytest.mark.parametrize(
    ("sampler", "arg", "incoming", "exported", "flag"),
    [
        ("parentbased_always_on", None, TRACEPARENT_UNSAMPLED, False, b"00"),  # the default's rule
        ("always_on", None, TRACEPARENT_UNSAMPLED, True, b"01"),  # ignores the parent
        ("always_off", None, TRACEPARENT_SAMPLED, False, b"00"),
        ("traceidratio", "0", None, False, b"00"),
        ("parentbased_traceidratio", "1.0", None, True, b"01"),
    ],
)
def test_the_configured_sampler_decides(
    tmp_path: Path, monkeypatch: Any, sampler: str, arg: str | None, incoming: bytes | None, exported: bool,
    flag: bytes,
) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    if arg is not None:
        monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    exporter = InMemorySpanExporter()
    observer = create_observer(Settings(out_dir=tmp_path), environ={}, span_exporter=exporter)
    headers = [(b"host", b"h")] + ([(b"traceparent", incoming)] if incoming else [])
    seen = _observe(observer, _record(), headers)
    observer.force_flush()
    spans = exporter.get_finished_spans()
    assert len(spans) == (1 if exported else 0)
    assert seen.endswith(b"-" + flag)
    if incoming:  # the trace continues whatever the decision
        assert seen[3:35] == incoming[3:35]
    if spans:
        assert seen == b"00-%032x-%016x-01" % (spans[0].context.trace_id, spans[0].context.span_id)
    observer.shutdown()


class _TaggingSampler(Sampler):
    """A user's own sampler: samples, adds an attribute and a trace-state entry."""

    def should_sample(
        self, parent_context: Any, trace_id: int, name: str, kind: Any = None, attributes: Any = None,
        links: Sequence[Any] | None = None, trace_state: Any = None,
    ) -> SamplingResult:
        return SamplingResult(Decision.RECORD_AND_SAMPLE, {"sampled.by": "tagger"}, TraceState([("tag", "1")]))

    def get_description(self) -> str:
        return "TaggingSampler"


def test_a_custom_samplers_attributes_and_trace_state_reach_the_span() -> None:
    exporter = InMemorySpanExporter()
    processor = CountingBatchSpanProcessor(exporter)
    provider = TracerProvider(sampler=_TaggingSampler())
    direct = DirectServerSpans(provider, processor, InstrumentationScope("servprof"))
    record = _record()
    state = (*direct.start("GET", None), attrs.connection_of({"http_version": "1.1", "headers": []}))
    direct.end(record, state, 1_000, 1_500, None, None)
    processor.force_flush()
    (span,) = exporter.get_finished_spans()
    assert span.attributes["sampled.by"] == "tagger"
    assert span.context.trace_state.get("tag") == "1"
    assert (span.start_time, span.end_time) == (1_000, 1_500)
    assert span.attributes["network.protocol.version"] == "1.1"
    processor.shutdown()


def test_the_span_is_what_the_request_was_when_it_ended(tmp_path: Path) -> None:
    """The span is built later, on the export thread: annotations the app makes after the
    response was complete do not reach it, and nothing is read from the app's dict then."""
    exporter = InMemorySpanExporter()
    observer = create_observer(Settings(out_dir=tmp_path), environ={}, span_exporter=exporter)
    record = _record()
    record.attributes["gen_ai.usage.output_tokens"] = 7
    _observe(observer, record, [])
    record.attributes["gen_ai.usage.output_tokens"] = 999  # too late
    record.attributes["late"] = "x"
    observer.force_flush()
    (span,) = exporter.get_finished_spans()
    assert span.attributes["gen_ai.usage.output_tokens"] == 7 and "late" not in span.attributes
    observer.shutdown()


def test_a_span_that_cannot_be_built_is_counted_and_the_batch_still_goes(
    tmp_path: Path, monkeypatch: Any
) -> None:
    exporter = InMemorySpanExporter()
    observer = create_observer(Settings(out_dir=tmp_path), environ={}, span_exporter=exporter)
    real = attrs.server_span_attributes

    def broken_for_one(record: RequestRecord, *args: Any) -> dict[str, Any]:
        if record.request_id == "bad":
            raise ValueError("a bug in building one span")
        return real(record, *args)

    monkeypatch.setattr(attrs, "server_span_attributes", broken_for_one)
    for request_id in ("a", "bad", "c"):
        _observe(observer, _record(request_id), [])
    observer.force_flush()
    assert [s.attributes["servprof.request_id"] for s in exporter.get_finished_spans()] == ["a", "c"]
    counts = observer.status()
    assert (counts["spans_ended"], counts["spans_exported"], counts["spans_export_failed"]) == (3, 2, 1)
    assert counts["spans_dropped"] == 1
    observer.shutdown()


def test_the_sdks_attribute_limits_apply(tmp_path: Path, monkeypatch: Any) -> None:
    """OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT holds for the request span as for any SDK span."""
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "16")
    exporter = InMemorySpanExporter()
    observer = create_observer(Settings(out_dir=tmp_path), environ={}, span_exporter=exporter)
    _observe(observer, _record(user_agent="a-very-long-user-agent/1.0 (with details)"), [])
    observer.force_flush()
    (span,) = exporter.get_finished_spans()
    assert span.attributes["user_agent.original"] == "a-very-long-user"
    observer.shutdown()
