"""Phase child spans and finding events for sampled requests, after their session's analysis.

The first tests feed on_analysis results in the documented contract shape (docs/CONTRACTS.md),
built from the real records of real requests, to pin down structure and bounds exactly. The
last test runs the whole chain for real: the demo LLM server behind ServprofMiddleware,
torch.profiler capture, the analysis subprocess, and spans in the embedded OTLP-JSON file."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from _telemetry_helpers import ObserverProbe, chat_body, make_app, serve
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from servprof.observers import RequestRecord
from servprof.settings import Settings
from servprof.telemetry import create_observer
from servprof.telemetry.analysis_spans import (
    MAX_SPANS_PER_PHASE,
    MAX_STEP_EVENTS,
    MAX_STEP_SPANS,
    SampledParent,
    SampledParents,
)
from servprof.telemetry.otlp_file import parse_trace_line


@pytest.fixture
def sampled(tmp_path: Path) -> Any:
    """Two real requests (one sampled, one not) through a loopback server."""
    exporter = InMemorySpanExporter()
    observer = create_observer(Settings(out_dir=tmp_path), environ={}, span_exporter=exporter)
    probe = ObserverProbe(make_app(), observer)
    with serve(probe) as url, httpx.Client() as client:
        assert (
            client.post(
                url + "/v1/chat/completions",
                content=chat_body(stream=False),
                headers={"x-sample": "1", "x-request-id": "req-A"},
            ).status_code
            == 200
        )
        assert (
            client.post(
                url + "/v1/chat/completions",
                content=chat_body(stream=False),
                headers={"x-request-id": "req-B"},
            ).status_code
            == 200
        )
        probe.wait_records(2)
    yield observer, exporter, probe.records
    observer.shutdown()


def _result_for(
    record: RequestRecord, steps: int, findings: list[dict[str, Any]] | None = None, detokenize_times: int = 1
) -> dict[str, Any]:
    """A result in the contract's shape whose trace clock is the record's own: trace us 0 is
    the request's arrival, so every phase falls inside the request."""
    phases = [
        {"name": "tokenize", "start_us": 10.0, "end_us": 30.0},
        {"name": "queue", "start_us": 30.0, "end_us": 45.5},
        {"name": "prefill", "start_us": 50.0, "end_us": 90.0},
    ]
    phases += [
        {"name": "decode_step", "start_us": 100.0 + 10 * i, "end_us": 107.0 + 10 * i} for i in range(steps)
    ]
    end = 100.0 + 10 * steps
    phases += [
        {"name": "detokenize", "start_us": end + i, "end_us": end + i + 0.5} for i in range(detokenize_times)
    ]
    return {
        "session_id": "session-1",
        "trace_file": "/out/traces/session-1.pt.trace.json.gz",
        "error": None,
        "requests": {record.request_id: {"phases": phases[::-1]}},  # order must not matter
        "findings": findings or [],
        "summary": {},
        "clock": {"trace_us_to_unix_ns_offset": record.arrival_ns},
    }


def _by_name(spans: list[Any]) -> dict[str, list[Any]]:
    grouped: dict[str, list[Any]] = {}
    for span in spans:
        grouped.setdefault(span.name, []).append(span)
    return grouped


def test_phase_children_under_the_ended_request_span(sampled: Any) -> None:
    observer, exporter, records = sampled
    record_a = next(r for r in records if r.request_id == "req-A")
    assert record_a.sampled
    findings = [
        {
            "kind": "decode_gap",
            "severity": "warning",
            "cost_ms": 1.5,
            "start_us": 107.0,
            "end_us": 110.0,
            "request_ids": ["req-A"],
            "title": "gap between decode steps",
            "evidence": {"gap_ms": [0.003]},
        },
        {
            "kind": "tokenization_stall",
            "severity": "critical",
            "cost_ms": 9.0,
            "start_us": 10.0,
            "end_us": 30.0,
            "request_ids": ["someone-else"],
            "title": "not this request",
            "evidence": {},
        },
        {
            "kind": "bandwidth_bound_decode",
            "severity": "info",
            "cost_ms": 0.25,
            "start_us": 100.0,
            "end_us": 150.0,
            "request_ids": [],
            "title": "session-wide",
            "evidence": {},
        },
    ]
    observer.on_analysis(_result_for(record_a, steps=5, findings=findings), records)
    observer.force_flush()
    spans = _by_name(exporter.get_finished_spans())
    (request_span,) = [
        s for s in spans["POST /v1/chat/completions"] if s.attributes["servprof.request_id"] == "req-A"
    ]
    base = record_a.arrival_ns
    children = [
        s
        for s in exporter.get_finished_spans()
        if s.parent and s.parent.span_id == request_span.context.span_id
    ]
    assert sorted(s.name for s in children) == [
        "decode",
        "detokenize",
        "prefill",
        "queue",
        "servprof.analysis",
        "tokenize",
    ]
    assert all(
        s.context.trace_id == request_span.context.trace_id and s.kind is SpanKind.INTERNAL for s in children
    )
    # Real times from the trace clock, emitted in time order.
    (tokenize,) = spans["tokenize"]
    (queue,) = spans["queue"]
    assert (tokenize.start_time, tokenize.end_time) == (base + 10_000, base + 30_000)
    assert (queue.start_time, queue.end_time) == (base + 30_000, base + 45_500)
    phase_spans = [s for s in children if s.name != "servprof.analysis"]
    assert [s.start_time for s in phase_spans] == sorted(s.start_time for s in phase_spans)
    (decode,) = spans["decode"]
    assert (decode.start_time, decode.end_time) == (base + 100_000, base + 147_000)
    assert decode.attributes["servprof.decode_steps"] == 5
    assert decode.attributes["servprof.decode_step_ms.max"] == pytest.approx(0.007)
    assert decode.attributes["servprof.decode_gap_ms.max"] == pytest.approx(0.003)
    steps = spans["decode_step"]
    assert [s.attributes["servprof.step"] for s in steps] == [0, 1, 2, 3, 4]
    assert all(s.parent.span_id == decode.context.span_id for s in steps)
    # Findings for this request, none of another request's; the one naming no request is the
    # session's: on the session's analysis span, linked to the request span, not on the request's.
    (analysis,) = spans["servprof.analysis"]
    assert analysis.attributes["servprof.trace_file"] == "/out/traces/session-1.pt.trace.json.gz"
    assert analysis.attributes["servprof.session_id"] == "session-1"
    assert analysis.attributes["servprof.findings"] == 1
    assert analysis.attributes["servprof.phase.decode_step.count"] == 5
    assert [e.name for e in analysis.events] == ["servprof.finding"]
    (gap,) = analysis.events
    (session,) = spans["servprof.session_analysis"]
    assert session.parent is None and session.context.trace_id != request_span.context.trace_id
    assert [link.context.span_id for link in session.links] == [request_span.context.span_id]
    assert session.attributes["servprof.session_id"] == "session-1" and session.attributes["servprof.findings"] == 1
    (wide,) = session.events
    assert dict(gap.attributes) | {} == {
        "servprof.finding.kind": "decode_gap",
        "servprof.finding.severity": "warning",
        "servprof.finding.cost_ms": 1.5,
        "servprof.finding.title": "gap between decode steps",
        "servprof.finding.evidence": '{"gap_ms":[0.003]}',
    }
    assert gap.timestamp == base + 107_000
    assert wide.attributes["servprof.finding.kind"] == "bandwidth_bound_decode"
    assert (analysis.start_time, analysis.end_time) == (request_span.start_time, request_span.end_time)
    status = observer.status()
    assert status["analysed_requests"] == 1 and status["analysis_orphaned_requests"] == 0
    assert status["analysis_spans"] == len(children) + len(steps) + 1  # + the session's
    assert status["analysis_session_spans"] == 1


def test_many_decode_steps_become_bounded_events(sampled: Any) -> None:
    observer, exporter, records = sampled
    record_a = records[0]
    many = MAX_STEP_EVENTS + 50
    assert many > MAX_STEP_SPANS
    observer.on_analysis(_result_for(record_a, steps=many, detokenize_times=MAX_SPANS_PER_PHASE + 9), records)
    observer.force_flush()
    spans = _by_name(exporter.get_finished_spans())
    assert "decode_step" not in spans
    (decode,) = spans["decode"]
    assert decode.attributes["servprof.decode_steps"] == many
    assert len(decode.events) == MAX_STEP_EVENTS
    assert decode.attributes["servprof.decode_step_events_truncated"] is True
    assert [e.attributes["servprof.step"] for e in decode.events[:3]] == [0, 1, 2]
    assert len(spans["detokenize"]) == MAX_SPANS_PER_PHASE
    (analysis,) = spans["servprof.analysis"]
    assert analysis.attributes["servprof.phase.detokenize.count"] == MAX_SPANS_PER_PHASE + 9


def test_failed_analysis_and_unknown_requests(sampled: Any) -> None:
    observer, exporter, records = sampled
    failed = {
        "session_id": "s",
        "trace_file": None,
        "error": "analysis timed out after 60 s and was killed",
        "requests": {},
        "findings": [],
        "summary": {},
        "clock": {},
    }
    observer.on_analysis(failed, records)
    # Not sampled (req-B), already analysed (req-A) or unknown: no spans, only a count.
    observer.on_analysis(_result_for(records[1], steps=2), records)
    observer.on_analysis({"requests": {"nobody": {"phases": []}}}, [])
    observer.force_flush()
    spans = _by_name(exporter.get_finished_spans())
    (analysis,) = spans["servprof.analysis"]
    assert analysis.status.status_code is StatusCode.ERROR
    assert "timed out" in analysis.status.description
    assert analysis.attributes["servprof.findings"] == 0
    assert not {"tokenize", "decode", "decode_step"} & set(spans)
    assert observer.status()["analysis_orphaned_requests"] == 3


def test_malformed_results_never_raise(sampled: Any) -> None:
    observer, exporter, records = sampled
    observer.on_analysis("not a dict", [])  # type: ignore[arg-type]
    malformed = {
        "requests": {"req-A": {"phases": ["x", {"name": "tokenize", "start_us": "soon"}, 3]}},
        "findings": "none",
        "clock": {"trace_us_to_unix_ns_offset": "later"},
    }
    observer.on_analysis(malformed, records)
    observer.force_flush()
    spans = _by_name(exporter.get_finished_spans())
    (analysis,) = spans["servprof.analysis"]  # the request still gets its analysis span
    assert analysis.attributes["servprof.findings"] == 0 and "tokenize" not in spans
    assert observer.status()["analysis_errors"] == 1


def test_sampled_parents_are_bounded() -> None:
    from opentelemetry.trace import INVALID_SPAN_CONTEXT

    parents = SampledParents(capacity=3)
    for index in range(5):
        parents.put(f"r{index}", SampledParent(INVALID_SPAN_CONTEXT, index, index + 1))
    assert len(parents) == 3
    assert parents.pop("r0") is None and parents.pop("r1") is None
    assert parents.pop("r4").start_ns == 4
    assert parents.pop("r4") is None  # used once


@pytest.mark.slow
def test_real_capture_and_analysis_become_phase_spans_in_the_file(tmp_path: Path, monkeypatch: Any) -> None:
    from _demo_helpers import start_sampled_demo_server

    from servprof import telemetry

    settings = {"OUT_DIR": str(tmp_path), "SAMPLE_EVERY": "2", "REQUESTS_PER_SESSION": "1",
                "TELEMETRY_EXPORTER": "file"}
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    spans_file = tmp_path / "spans" / "spans.otlp.jsonl"
    try:
        with start_sampled_demo_server(monkeypatch, settings, size="tiny") as url, \
                httpx.Client(timeout=60) as client:
            for index in range(4):
                response = client.post(
                    url + "/v1/chat/completions", content=chat_body(max_tokens=6, stream=index % 2 == 0, ignore_eos=True)
                )
                assert response.status_code == 200
            spans = _wait_for_spans(
                spans_file, lambda found: sum(s.name == "servprof.analysis" for s in found) >= 1
            )
    finally:
        telemetry.shutdown()
    requests = [s for s in spans if s.name == "POST /v1/chat/completions"]
    assert len(requests) == 4 and all(s.kind == 2 for s in requests)  # SPAN_KIND_SERVER
    sampled = [s for s in requests if _attr(s, "servprof.sampled")]
    assert sampled, "sample_every=2 sampled none of 4 requests"
    analysed = {s.parent_span_id for s in spans if s.name == "servprof.analysis"}
    for request in (s for s in sampled if s.span_id in analysed):
        children = [s for s in spans if s.parent_span_id == request.span_id]
        names = {s.name for s in children}
        analysis = next(s for s in children if s.name == "servprof.analysis")
        # A span for every phase the analysis found (how many decode steps a session holds is
        # capture's business: its event budget may end it early).
        counts = {a.key.split(".")[2] for a in analysis.attributes if a.key.endswith(".count")}
        assert {"tokenize", "prefill"} <= counts, counts
        assert names == {"decode" if name == "decode_step" else name for name in counts} | {
            "servprof.analysis"
        }
        # The trace clock and the request span's clock agree: phases lie inside the request
        # (a slack of 20 ms for two clocks read at different moments; a unit or offset
        # mistake would be off by seconds or decades).
        slack = 20_000_000
        for child in children:
            assert request.start_time_unix_nano - slack <= child.start_time_unix_nano
            assert child.end_time_unix_nano <= request.end_time_unix_nano + slack
        assert _attr(analysis, "servprof.trace_file").endswith(".pt.trace.json.gz")


def _attr(span: Any, key: str) -> Any:
    for attribute in span.attributes:
        if attribute.key == key:
            value = attribute.value
            return getattr(value, value.WhichOneof("value"))
    return None


def _wait_for_spans(path: Path, done: Any, timeout_s: float = 90.0) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    found: list[Any] = []
    while time.monotonic() < deadline:
        found = []
        if path.exists():
            for line in path.read_bytes().splitlines():
                for resource_spans in parse_trace_line(line).resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        found.extend(scope_spans.spans)
        if done(found):
            return found
        time.sleep(0.2)
    raise AssertionError(f"spans did not arrive in {timeout_s} s: {sorted({s.name for s in found})}")


def test_a_stream_that_outlives_its_session_still_gets_its_analysis_spans(tmp_path: Path) -> None:
    """Sessions stop at their step bound while a long stream goes on, so the analysis often
    arrives before the request ends: its span context is kept from the request's start."""
    from _middleware_helpers import sse_post, tiny_server, wait_idle, wait_sessions

    wait_idle()
    with tiny_server(tmp_path, telemetry=True, sample_every=1, requests_per_session=1,
                     max_session_steps=4) as (url, mw, _engine), httpx.Client(timeout=60) as client:
        observer = mw.runtime.observers[0]
        status, lines, _ = sse_post(client, url, tokens=400)
        assert status == 200 and len(lines) == 401
        (session,) = wait_sessions(mw, 1)
        deadline = time.monotonic() + 30
        while observer.status()["analyses"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        counts = observer.status()
    assert session["stop_reason"] == "max_session_steps"
    assert counts["analyses"] == 1
    assert (counts["analysed_requests"], counts["analysis_orphaned_requests"]) == (1, 0), counts
    assert counts["analysis_spans"] >= 1 and counts["sampled_parents_kept"] == 0
