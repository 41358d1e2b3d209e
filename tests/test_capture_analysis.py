"""The analysis hand-off on its own: phase timings kept when a detector fails, a trace the
loader refuses failing the child cleanly, and the parent's handling of a child that fails."""

from __future__ import annotations

import gzip
import time
from pathlib import Path

import orjson
import pytest
from _analyze_helpers import record_phase_trace

from servprof import analysis, analysis_worker


@pytest.fixture(scope="module")
def real_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_phase_trace(tmp_path_factory.mktemp("trace"))


def test_phase_timings_survive_a_failing_detector(real_trace: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from servprof.detect import analysis as detect_analysis

    def broken_detectors(*_args: object) -> None:
        raise RuntimeError("a detector bug")

    monkeypatch.setattr(detect_analysis, "analyse", broken_detectors)
    session = tmp_path / "s1.session.json"
    session.write_bytes(orjson.dumps({"session_id": "s1", "requests": [{"request_id": "r1"}]}))
    result_path = tmp_path / "s1.analysis.json"
    assert analysis.main([str(real_trace), str(session), str(result_path)]) == 0
    result = orjson.loads(result_path.read_bytes())
    assert result["error"] is None and result["findings"] == []
    assert result["summary"]["detectors"] == "failed: RuntimeError: a detector bug"
    assert [p["name"] for p in result["requests"]["r1"]["phases"]] == ["tokenize", "decode_step"]
    assert [p["name"] for p in result["requests"]["r2"]["phases"]] == ["decode_step"]
    tokenize = result["requests"]["r1"]["phases"][0]
    assert tokenize["end_us"] >= tokenize["start_us"]
    # unix_ns = ts_us * 1000 + offset: the phase happened in the last minute.
    unix_ns = tokenize["start_us"] * 1000 + result["clock"]["trace_us_to_unix_ns_offset"]
    assert abs(unix_ns - time.time_ns()) < 60e9


def test_child_failing_on_a_bad_trace_is_a_failed_result(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt.trace.json.gz"
    bad.write_bytes(gzip.compress(b"not json at all"))
    session = tmp_path / "bad.session.json"
    session.write_bytes(orjson.dumps({"session_id": "bad", "requests": []}))
    result = analysis.run_analysis("bad", bad, session, tmp_path / "bad.analysis.json", timeout_s=60)
    assert result["session_id"] == "bad" and result["requests"] == {} and result["findings"] == []
    assert result["error"].startswith("servprof analysis failed: TraceError:"), result["error"]
    assert analysis_worker.WORKERS._warm is not None and analysis_worker.WORKERS._warm.alive()  # it lives on


def test_a_trace_over_the_size_limit_is_refused_not_read(real_trace: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The child reads the trace only through the loader, whose limits always apply."""
    monkeypatch.setenv("SERVPROF_MAX_TRACE_BYTES", "100")
    session = tmp_path / "s1.session.json"
    session.write_bytes(orjson.dumps({"session_id": "s1", "requests": []}))
    result = analysis.run_analysis("s1", real_trace, session, tmp_path / "s1.analysis.json", timeout_s=60)
    assert result["requests"] == {} and result["findings"] == []
    assert "TraceError" in result["error"] and "100" in result["error"], result["error"]


def test_an_analysis_stopped_as_it_starts_is_killed(real_trace: Path, tmp_path: Path) -> None:
    """A shutdown that killed the running analyses just before this child was registered."""
    session = tmp_path / "s1.session.json"
    session.write_bytes(orjson.dumps({"session_id": "s1", "requests": []}))
    result = analysis.run_analysis("s1", real_trace, session, tmp_path / "s1.analysis.json", timeout_s=60,
                                   should_stop=lambda: True)
    assert result["error"] == "analysis process exited with status -9: ", result["error"]
    assert not analysis_worker.WORKERS.running
