"""End to end, live: the demo engine with a fault knob on, under the real torch.profiler,
and the detectors on the trace it wrote (what bench/record_fixtures.py does, run now, so
a change in the engine or the profiler that breaks detection shows up here).

Only lower bounds on sizes here: the injected delays are busy-waits to a deadline, so
a gap or a tokenization lasts at least that long, but a live run on a shared 2-core
host can be preempted for any time on top. The 10% accuracy checks run on the
committed fixtures (test_detect_accuracy.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from servprof.detect.analysis import analyse
from servprof.trace import load_trace

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
record_fixtures = pytest.importorskip("record_fixtures", reason="bench/record_fixtures.py needs the demo extra")


@pytest.mark.slow
def test_live_step_delay_is_found_with_its_size(tmp_path: Path):
    knobs = {"step_delay_ms": 15.0}
    path = record_fixtures.record("live_step_delay", knobs, tmp_path, requests=2, max_tokens=6)
    analysis = analyse(load_trace(path))
    # (A loaded host may also stall a step itself: such gaps are "inside_step" and not counted.)
    gaps = [f for f in analysis.findings if f.kind == "decode_gap" and f.evidence["where"] == "between_steps"]
    assert gaps
    assert sum(f.evidence["gaps"] for f in gaps) >= 4
    for f in gaps:
        assert f.evidence["median_gap_ms"] >= 0.99 * knobs["step_delay_ms"]


@pytest.mark.slow
def test_live_slow_tokenizer_is_found_with_its_size(tmp_path: Path):
    knobs = {"slow_tokenizer_us_per_token": 100.0}
    path = record_fixtures.record("live_slow_tokenizer", knobs, tmp_path, requests=2, max_tokens=4, stagger_s=0.1)
    trace = load_trace(path)
    tokens = trace.metadata[0]["servprof_fixture"]["prompt_tokens"]
    stalls = {f.request_ids[0]: f for f in analyse(trace).findings if f.kind == "tokenization_stall"}
    assert set(stalls) == set(tokens)
    for rid, count in tokens.items():
        injected = count * knobs["slow_tokenizer_us_per_token"] / 1000
        assert stalls[rid].evidence["tokenize_ms"] >= 0.99 * injected
        assert stalls[rid].evidence["on_event_loop"] is False
