"""The recompilation detector on real torch.compile traces recorded here (Dynamo with the eager
backend; servprof's probe adds torch's compile records to the metadata). The demo server's
--compile knob, live, is in test_memory_compile_live.py."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from _kineto_builder import KinetoTrace
from _memory_compile_helpers import record_compile_trace

from servprof.detect.analysis import analyse
from servprof.detect.compile_causes import describe_cause
from servprof.detect.finding import severity_for
from servprof.detect.recompilation import CRITICAL_MS, WARNING_MS, classify, compile_stalls
from servprof.trace import load_trace

# Each recording compiles a small function a few times (~0.5-1 s each on 2 cores).
slow = pytest.mark.slow


def _kind(analysis, kind: str):
    return [f for f in analysis.findings if f.kind == kind]


@slow
def test_a_new_batch_size_recompiles_inside_the_step_and_is_named(tmp_path: Path):
    path, records = record_compile_trace(tmp_path / "rc.json", warm=[2, 4], served=[2, 3, 4, 3])
    assert len(records) == 1  # torch compiled once while profiling: for batch size 3
    findings = _kind(analyse(load_trace(path)), "recompilation")
    assert len(findings) == 1
    finding = findings[0]
    evidence = finding.evidence
    assert evidence["cause"] == "batch_size" and evidence["detail"]["actual"] == 3
    assert evidence["in_steps"] == 1 and evidence["stalls"][0]["batch"] == 3
    # Measured by torch itself: the compile's duration in its own record.
    assert evidence["stall_ms"] == pytest.approx(records[0].duration_us / 1e3, rel=0.2)
    assert finding.cost_ms == evidence["stall_ms"]
    assert finding.request_ids == ["req-1-0", "req-1-1", "req-1-2"]  # the step it stalled
    assert "mark_dynamic" in finding.fix and "bucket" in finding.fix
    # In a step, its severity follows its length (how long a compile takes depends on the machine).
    assert finding.severity == severity_for(finding.cost_ms, WARNING_MS, CRITICAL_MS)


@slow
def test_serving_only_warmed_up_shapes_finds_nothing(tmp_path: Path):
    path, records = record_compile_trace(tmp_path / "clean.json", warm=[2, 4], served=[2, 4, 2, 4])
    assert records == []
    analysis = analyse(load_trace(path))
    assert not _kind(analysis, "recompilation") and not _kind(analysis, "graph_break")
    assert analysis.summary["compile"]["steps_with_compiled_code"] == 4
    assert analysis.summary["compile"]["compiles"] == 0


@slow
def test_without_torchs_records_the_stall_is_still_found_and_the_reason_is_missing(tmp_path: Path):
    path, records = record_compile_trace(tmp_path / "bare.json", warm=[2], served=[2, 5], probes=False)
    analysis = analyse(load_trace(path))
    findings = _kind(analysis, "recompilation")
    assert len(findings) == 1 and findings[0].evidence["cause"] == "unknown"
    assert findings[0].evidence["stall_ms"] == pytest.approx(records[0].duration_us / 1e3, rel=0.2)
    assert findings[0].evidence["stalls"][0]["compile_id"] == records[0].compile_id
    assert any(m["what"] == "recompile reasons" for m in analysis.summary["missing"])


@slow
def test_graph_breaks_are_counted_per_step(tmp_path: Path):
    path, _ = record_compile_trace(tmp_path / "gb.json", warm=[2], served=[2, 2, 2], graph_break=True)
    analysis = analyse(load_trace(path))
    summary = analysis.summary["compile"]
    assert summary["compiled_regions_per_step"] == 2 and summary["graph_breaks_per_step"] == 1
    findings = _kind(analysis, "graph_break")
    assert len(findings) == 1
    assert findings[0].evidence["resume_functions"] and "explain" in findings[0].fix
    # Without the frame table the regions are counted but not called breaks.
    bare, _ = record_compile_trace(tmp_path / "gb-bare.json", warm=[2], served=[2, 2], graph_break=True, probes=False)
    bare_analysis = analyse(load_trace(bare))
    assert bare_analysis.summary["compile"]["graph_breaks_per_step"] is None
    assert not _kind(bare_analysis, "graph_break")
    assert any(m["what"] == "graph breaks" for m in bare_analysis.summary["missing"])
    # Dynamo's eager backend marks no graph's own run: the eager time between graphs is unknown, not 0.
    assert findings[0].evidence["eager_ms"] is None and "not in this trace" in findings[0].title


@slow
def test_the_eager_time_of_a_graph_break_is_the_time_no_graph_ran(tmp_path: Path):
    """The code after a break runs inside the broken frame's region (the resume frame's region
    nests in it): a sleep there, 4 ms a step, is eager time, under the steps' own time. Inductor,
    whose generated code marks each graph's run (``## Call CompiledFxGraph``)."""
    path, _ = record_compile_trace(tmp_path / "gb.json", warm=[2], served=[2, 2, 2], graph_break=True,
                                   backend="inductor", eager_sleep_s=0.004)
    analysis = analyse(load_trace(path))
    (finding,) = _kind(analysis, "graph_break")
    steps_ms = sum(s.dur_us for s in analysis.steps) / 1e3
    assert 3 * 4.0 <= finding.evidence["eager_ms"] <= steps_ms
    assert finding.evidence["share_of_steps"] >= 0.1 and finding.severity == "warning"


def test_compile_workers_on_other_threads_are_part_of_one_stall(tmp_path: Path):
    """Inductor compiles files on worker threads while the compiling thread waits: found as one."""
    events = [
        {"ph": "X", "name": "entire_frame_compile", "ts": 100.0, "dur": 900.0, "pid": 1, "tid": 1, "cat": "cpu_op"},
        {"ph": "X", "name": "inductor_compile_data: compile_id=0/2", "ts": 150.0, "dur": 1.0, "pid": 1, "tid": 1,
         "cat": "user_annotation"},
        {"ph": "X", "name": "compile_file (dynamo_timed)", "ts": 300.0, "dur": 400.0, "pid": 1, "tid": 2, "cat": "cpu_op"},
    ]
    path = tmp_path / "workers.json"
    path.write_bytes(orjson.dumps({"traceEvents": events}))
    stalls = compile_stalls(load_trace(path))
    assert len(stalls) == 1 and stalls[0]["compile_id"] == "0/2"
    assert stalls[0]["ms"] == pytest.approx(0.9) and stalls[0]["start_us"] == pytest.approx(100.0)


@pytest.mark.parametrize("inside_a_compile", [False, True])
def test_recording_a_cuda_graph_is_not_called_a_compile(tmp_path: Path, inside_a_compile: bool):
    """torch.compile(mode='reduce-overhead') records a CUDA graph for each new shape: cudagraph
    trees time it as ``CUDAGraphNode.record (dynamo_timed)`` (seen in TraceLens's xDiT Flux trace,
    243 ms in a step). Alone, that is a graph recorded, not "compiled `?`: a first compile"; inside
    Dynamo's own compile range it stays part of that compile."""
    trace = KinetoTrace()
    for step in range(3):
        trace.annotation(f"ProfilerStep#{step}", step * 1000.0, 900.0)
        trace.host("aten::mm", step * 1000.0 + 10, 50.0)
    if inside_a_compile:
        trace.annotation("entire_frame_compile", 1050.0, 800.0)
    trace.annotation("CUDAGraphNode.record (dynamo_timed)", 1100.0, 700.0)
    trace.frame("/tmp/torchinductor_root/ab/cab.py(3980): partition_0", 1110.0, 600.0)
    (finding,) = _kind(analyse(load_trace(trace.write(tmp_path / "t.json"))), "recompilation")
    if inside_a_compile:
        assert finding.evidence["cause"] == "first_compile" and "compiled a function" in finding.title
        return
    assert finding.evidence["cause"] == "cudagraph_record" and finding.evidence["function"] is None
    assert finding.title.startswith("torch.compile recorded a CUDA graph of a function the trace does not name "
                                    "1 time(s) while serving (1 inside model steps), 1 ms stalled")
    assert "?" not in finding.title and "reduce-overhead" in finding.fix and "start-up" in finding.fix


@pytest.mark.parametrize("session", [False, True])
def test_a_graph_recorded_in_a_traces_first_step_may_be_its_warm_up(tmp_path: Path, session: bool):
    """A user's trace whose first step records a CUDA graph for 600 ms (TraceLens's xDiT Flux capture
    traces: one step, its first run) cannot say whether a server was serving: the finding says it
    was the trace's first step, at most a warning, and how to read it either way. A servprof
    session's trace is of a server serving: there it stays "while serving", critical by its length."""
    trace = KinetoTrace(metadata={"servprof": {"tier": "deep"}} if session else {})
    for step, (start, length) in enumerate([(0.0, 700_000.0), (701_000.0, 900.0), (702_000.0, 900.0)]):
        trace.annotation(f"ProfilerStep#{step}", start, length)
        trace.host("aten::mm", start + 10.0, 50.0)
    trace.annotation("CUDAGraphNode.record (dynamo_timed)", 100.0, 600_000.0)
    (finding,) = _kind(analyse(load_trace(trace.write(tmp_path / "t.json"))), "recompilation")
    if session:
        assert "while serving" in finding.title and finding.severity == "critical"
        assert "first_step_only" not in finding.evidence
        return
    assert finding.title.startswith("torch.compile recorded a CUDA graph of a function the trace does not name "
                                    "1 time(s) in the trace's first model step")
    assert finding.severity == "warning" and finding.evidence["first_step_only"] is True
    assert "warm-up" in finding.fix and "start-up" in finding.fix


@pytest.mark.parametrize(("reason", "batch", "cause"), [
    ("0/0: tensor 'x' size mismatch at index 0. expected 2, actual 3", 3, "batch_size"),
    ("0/0: tensor 'x' size mismatch at index 1. expected 128, actual 256", 3, "dimension"),
    ("0/1: L['temperature'] == 0.7", None, "value"),
    ("0/0: ___check_obj_id(L['self'], 1407)", None, "unknown"),
    (None, None, "first_compile"),
])
def test_reasons_are_classified(reason, batch, cause):
    compile_id = "0/1" if reason else "0/0"
    assert classify(reason, compile_id, batch)["cause"] == cause


def test_a_reason_of_no_known_kind_is_quoted_not_called_unnamed():
    # What torch 2.13 records when compiled transformers generate() runs on a thread pool under load.
    reason = ("0/5: Unexpected recompilation: runtime guards failed even though they passed during "
              "recompilation-reason analysis. Please open an issue with a minimal repro: https://github.com/pytorch/pytorch")
    detail = classify(reason, "0/6", None)
    assert detail["cause"] == "unknown" and detail["torch_reason"].startswith("Unexpected recompilation: runtime")
    assert "Unexpected recompilation" in describe_cause(detail) and "did not name" not in describe_cause(detail)
    assert describe_cause(classify(None, "0/3", None)) == "a guard failure torch did not name here"


def test_an_inductor_recompile_recorded_by_the_project_is_found():
    """tests/fixtures/torch_compile_recompile.json.gz (bench/record_compile_fixture.py): Inductor
    on CPU, warmed at batch 2, then batch 3 recompiles inside its decode step."""
    trace = load_trace(Path(__file__).parent / "fixtures" / "torch_compile_recompile.json.gz")
    analysis = analyse(trace)
    (finding,) = _kind(analysis, "recompilation")
    assert finding.evidence["cause"] == "batch_size" and finding.evidence["in_steps"] == 1
    # torch's own record of that compile, carried in the trace's metadata by servprof's probe.
    (record,) = trace.servprof_metadata()["compile"]["compiles"]
    assert finding.evidence["stall_ms"] == pytest.approx(record["duration_us"] / 1e3, rel=0.2)
    assert finding.request_ids == ["req-1-0", "req-1-1", "req-1-2"]


def test_a_recompiles_guard_text_leaves_the_session_trace_valid(tmp_path: Path):
    """torch's guard text holds quotes and newlines (``L['x']``, ``File "app.py"``); the profiler's
    add_metadata_json turns a backslash into '/', so JSON escapes in servprof's metadata broke the
    whole trace file. A real profiler both ways: the raw text breaks it, servprof's does not."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from servprof.auto.session import trace_metadata_json
    from servprof.trace import TraceError

    reason = 'tensor \'L["x"]\' size mismatch at index 0. expected 4, actual 3\n  File "app.py", line 3, in forward'
    metadata = {"session_id": "s", "compiles": [{"fail_reason": reason, "co_name": "forward"}]}
    for name, text in (("raw", orjson.dumps(metadata).decode()), ("safe", trace_metadata_json(metadata))):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            torch.ones(4).add_(1)
            prof.add_metadata_json("servprof", text)
        prof.export_chrome_trace(str(tmp_path / f"{name}.json"))
    with pytest.raises(TraceError, match="not valid JSON"):
        load_trace(tmp_path / "raw.json")
    (kept,) = load_trace(tmp_path / "safe.json").servprof_metadata()["compiles"]
    assert kept["fail_reason"] == "tensor 'L['x']' size mismatch at index 0. expected 4, actual 3   File 'app.py', line 3, in forward"
