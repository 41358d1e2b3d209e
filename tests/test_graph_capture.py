"""CUDA/HIP graph capture: while a stream captures, its kernels are recorded into a graph, not
run, so the device idles by design. A real vLLM start-up trace (its piecewise HIP-graph capture
on MI300X, vendored from TraceLens: tests/fixtures/public/NOTICE.md) and a small synthetic one:
the idle inside capture windows is counted apart, said in ``missing``, and never a finding."""

from __future__ import annotations

from pathlib import Path

from _analyze_helpers import public_trace
from _kineto_builder import KinetoTrace

from servprof.detect.analysis import analyse
from servprof.detect.graph_capture import MISSING_WHAT
from servprof.trace import load_trace


def test_vllm_start_up_capture_is_not_judged_as_serving_gaps() -> None:
    analysis = analyse(load_trace(public_trace("vllm_graph_capture_piecewise_mi300x.json.gz")))
    captured = analysis.summary["decode_gap"]["graph_capture"]
    assert captured["captures"] == 25 and captured["idle_us_not_judged"] > 40_000  # ~47 ms of 55
    assert captured["launches"] > 300  # recorded into the graphs, not run
    (entry,) = [m for m in analysis.summary["missing"] if m["what"] == MISSING_WHAT]
    assert "25 CUDA/HIP graph capture(s)" in entry["message"] and f"the {captured['launches']} launch" in entry["message"]
    gaps = [f for f in analysis.findings if f.kind == "decode_gap"]
    assert all(f.severity != "critical" and f.evidence["share_of_step_time"] < 0.2 for f in gaps), \
        [f.title for f in gaps]
    # The KV cache allocated at start-up is the engine's pool, not memory pressure.
    (memory,) = [f for f in analysis.findings if f.kind == "memory_near_limit"]
    assert memory.severity == "info" and memory.evidence["preallocated_pool"] is True


def test_idle_inside_a_capture_window_is_set_apart(tmp_path: Path) -> None:
    """Two steps of three kernels each with a 20 ms device hole in each: the first step's hole lies
    inside a capture window (cudaStreamBeginCapture ... cudaStreamEndCapture on the launching
    thread), the second's does not and is judged."""
    trace = KinetoTrace()
    for step, start in enumerate((0.0, 100_000.0)):
        trace.host(f"servprof:decode_step|r{step}", start, 60_000.0)
        for k, offset in enumerate((1_000.0, 3_000.0, 25_000.0)):  # a 20 ms hole before the third kernel
            trace.launch(start + offset - 500.0, start + offset, 2_000.0)
            if step == 0 and k == 1:
                trace.host("cudaStreamBeginCapture", start + offset + 2_100.0, 10.0, cat="cuda_runtime")
                trace.host("cudaStreamEndCapture", start + offset + 21_500.0, 10.0, cat="cuda_runtime")
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    captured = analysis.summary["decode_gap"]["graph_capture"]
    assert captured["captures"] == 1 and 19_000 <= captured["idle_us_not_judged"] <= 20_000
    judged = [g for g in analysis.gaps if g.where == "inside_step" and g.idle_us >= 10_000]
    assert [round(g.start_us) for g in judged] == [105_000]
