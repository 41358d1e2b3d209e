"""The `servprof.finding` span event: evidence always whole JSON under its cap (1,024 characters, or
OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT when lower), and the fix carried as its own attribute."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from _analyze_helpers import PUBLIC_TRACES, fixture
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN_CONTEXT

from servprof.detect.analysis import analyse
from servprof.telemetry.analysis_spans import AnalysisSpanEmitter, SampledParent, SampledParents
from servprof.telemetry.finding_event import MAX_EVIDENCE_CHARS, finding_event_attributes, fit_evidence
from servprof.trace import load_trace

BIG_EVIDENCE = {
    "device": {"name": "NVIDIA H100 80GB HBM3", "source": "x" * 300},
    "top_ops": [{"op": "aten::mul", "shapes": [[16, 559, 1024], [16, 559, 1]], "calls": i, "note": "é\"\\" * 20}
                for i in range(200)],
    "worst_gaps": [{"start_us": float(i), "explanation": "host ops: " + "y" * 500} for i in range(50)],
    "nested": {"a": {"b": {"c": {"d": {"e": list(range(1000))}}}}},
    "count": 7,
}


def _all_traces() -> list[Path]:
    return sorted(PUBLIC_TRACES.glob("*.json.gz")) + sorted(fixture("clean").parent.glob("*.json.gz"))


@pytest.mark.parametrize("limit", [MAX_EVIDENCE_CHARS, 300, 64, 2])
def test_oversized_evidence_is_summarised_into_valid_json(limit: int):
    text, summarised = fit_evidence(BIG_EVIDENCE, limit)
    assert summarised and text is not None and len(text) <= limit
    parsed = orjson.loads(text)
    assert isinstance(parsed, dict)
    if limit >= 300:  # room for the small fields, whole
        assert parsed["count"] == 7


def test_small_evidence_is_kept_exactly():
    text, summarised = fit_evidence({"gap_ms": [0.003], "cause": "synchronize"}, MAX_EVIDENCE_CHARS)
    assert not summarised and orjson.loads(text) == {"gap_ms": [0.003], "cause": "synchronize"}
    assert fit_evidence({"a": 1}, 1) == (None, True)  # not even "{}" fits: no attribute rather than a cut one


def test_lists_keep_their_first_items_and_say_how_many_there_were():
    text, _ = fit_evidence({"ids": [f"request-{i:04d}" for i in range(500)]}, 400)
    ids = orjson.loads(text)["ids"]
    assert ids[0] == "request-0000" and ids[-1].startswith("... ") and ids[-1].endswith(" more")


@pytest.mark.parametrize("limit", [MAX_EVIDENCE_CHARS, 200])
def test_every_fixture_and_public_trace_finding_gives_parseable_evidence(limit: int):
    seen = 0
    for path in _all_traces():
        for finding in analyse(load_trace(path)).findings:
            attributes = finding_event_attributes(finding.to_dict(), limit)
            text = attributes.get("servprof.finding.evidence")
            assert text is not None and len(text) <= limit, (path.name, finding.kind)
            assert isinstance(orjson.loads(text), dict)
            seen += 1
    assert seen >= 5


def test_sdk_limit_lower_than_the_cap_still_gives_whole_json(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "300")
    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # reads the limit from the environment, as servprof's provider does
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    parents = SampledParents()
    parents.put("req-1", SampledParent(INVALID_SPAN_CONTEXT, 1_000, 2_000))
    emitter = AnalysisSpanEmitter(provider.get_tracer("test"), parents)
    finding = {"kind": "bandwidth_bound_decode", "severity": "warning", "cost_ms": 3.0, "start_us": 0.0,
               "end_us": 10.0, "request_ids": ["req-1"], "sampled_request_ids": ["req-1"], "title": "slow ops",
               "evidence": BIG_EVIDENCE, "fix": "quantise the weights"}
    whole = {**finding, "request_ids": [], "sampled_request_ids": []}
    emitter.emit({"session_id": "s", "requests": {}, "findings": [finding, whole], "clock": {}}, ["req-1"])
    events = [e for span in exporter.get_finished_spans() for e in span.events if e.name == "servprof.finding"]
    assert len(events) == 2  # one on the request's analysis span, one on the session's
    for event in events:
        text = event.attributes["servprof.finding.evidence"]
        assert len(text) <= 300 and isinstance(orjson.loads(text), dict)
        assert event.attributes["servprof.finding.evidence_truncated"] is True
        assert event.attributes["servprof.finding.fix"] == "quantise the weights"
    provider.shutdown()
