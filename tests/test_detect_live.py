"""End to end, live: the demo engine with a fault knob on, under the real torch.profiler,
and the detectors on the trace it wrote (what bench/record_fixtures.py does, run now, so
a change in the engine or the profiler that breaks detection shows up here)."""

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
    (gap,) = [f for f in analysis.findings if f.kind == "decode_gap"]
    assert abs(gap.evidence["median_gap_ms"] - knobs["step_delay_ms"]) <= 0.10 * knobs["step_delay_ms"]
    assert gap.evidence["gaps"] >= 4


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
        # Wall time: at least the injected work. Only a loose upper bound here: a live run on a
        # shared 2-core CI host can be preempted mid-tokenization (the 10% accuracy check runs
        # on the committed fixtures in test_detect_accuracy.py).
        assert 0.95 * injected <= stalls[rid].evidence["tokenize_ms"] <= 2.0 * injected
