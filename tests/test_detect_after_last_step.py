"""after_last_step on small synthetic session traces with known answers (tests/_kineto_builder.py:
only the timings are invented; the loader and detectors are the real ones): a request's tail after
its last step is counted to its last byte, never past what the trace recorded, and without its own
detokenize phase. The real server behind it: tests/test_post_filter_server.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from _kineto_builder import KinetoTrace

from servprof.detect.analysis import analyse
from servprof.trace import load_trace

BASE_NS = 1_700_000_000_000_000_000
MS = 1000.0  # trace µs


def _session(tmp_path: Path, stop_ms: float, detokenize: tuple[float, float] | None = None,
             last_byte_ms: float = 40.0) -> tuple[Any, dict[str, Any]]:
    """One request: arrives at 0, ten 1 ms decode steps from 1 ms, its last byte at ``last_byte_ms``."""
    trace = KinetoTrace()
    trace.host("servprof:prefill|r1", 1 * MS, 1 * MS, cat="user_annotation")
    for k in range(10):
        trace.host("servprof:decode_step|r1", (2 + k) * MS, 0.9 * MS, cat="user_annotation")
        trace.host("aten::mm", (2 + k) * MS + 10, 0.8 * MS)
    if detokenize is not None:
        trace.host("servprof:detokenize|r1", detokenize[0] * MS, (detokenize[1] - detokenize[0]) * MS,
                   cat="user_annotation")
    trace.host("aten::add", 45 * MS, 10.0)  # the trace runs on after the answer
    trace.metadata = {"baseTimeNanoseconds": BASE_NS,
                      "servprof": orjson.dumps({"stop_wall_ns": BASE_NS + int(stop_ms * 1e6)}).decode()}
    ns = lambda ms: BASE_NS + int(ms * 1e6)  # noqa: E731 - the perf clock here runs with the wall clock
    record = {"request_id": "r1", "arrival_ns": ns(0), "arrival_perf_ns": ns(0), "first_byte_ns": ns(12.5),
              "last_byte_ns": ns(last_byte_ms), "end_ns": ns(last_byte_ms + 0.1)}
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")), [record])
    return [f for f in analysis.findings if f.kind == "after_last_step"], analysis.summary["after_last_step"]


def test_the_tail_after_the_last_step_is_named(tmp_path: Path) -> None:
    (finding,), summary = _session(tmp_path, stop_ms=50)
    (tail,) = summary["tails"]
    assert tail["tail_ms"] == pytest.approx(40 - 11.9, abs=1e-3) and tail["request_ms"] == pytest.approx(40.0)
    assert finding.request_ids == ["r1"] and finding.severity == "warning"
    assert finding.cost_ms == pytest.approx(28.1, abs=1e-3)


def test_a_request_answered_after_the_trace_stopped_recording_is_not_judged(tmp_path: Path) -> None:
    """Its last steps may have run after the stop, unrecorded: a tail read then would be invented
    (the demo's clean run had one: 330 ms 'after the last step' of a 185 ms request)."""
    findings, summary = _session(tmp_path, stop_ms=20)
    assert findings == [] and summary["tails"] == []
    assert summary["unmeasured"] == [{"request_id": "r1", "why": "answered after the trace stopped recording its steps"}]


def test_its_own_detokenization_is_not_counted_and_a_short_tail_is_quiet(tmp_path: Path) -> None:
    findings, summary = _session(tmp_path, stop_ms=50, detokenize=(12.0, 38.0))
    assert findings == [] and summary["tails"][0]["own_phases_ms"] == pytest.approx(26.0, abs=1e-3)
    assert summary["tails"][0]["tail_ms"] < 10
