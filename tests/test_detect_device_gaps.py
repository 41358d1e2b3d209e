"""decode_gap on a device timeline, and the loader under arbitrary input.

No GPU runs here, so the device-side tests use a stand-in: a small chrome trace
written in the test, shaped like Kineto's GPU export (cudaLaunchKernel on the host
and kernels on a stream joined by `correlation`). Only the timings are invented;
the loader and detectors are the real ones. The real GPU traces in
The vendored public traces (tests/fixtures/public) are covered in test_detect_accuracy.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servprof.detect.analysis import analyse
from servprof.detect.idle_split import idle_split
from servprof.detect.steps import is_step_annotation
from servprof.trace import TraceError, load_trace

HOST, ENGINE, LOOP = 100, 1, 2


class StandInGpuTrace:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.correlation = 0

    def host(self, name: str, ts: float, dur: float, tid: int = ENGINE, cat: str = "cpu_op") -> None:
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": HOST, "tid": tid, "ts": ts, "dur": dur})

    def kernel(self, launch_ts: float, start: float, dur: float, name: str = "gemv_kernel") -> None:
        self.correlation += 1
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": HOST, "tid": ENGINE,
                            "ts": launch_ts, "dur": 3.0, "args": {"correlation": self.correlation}})
        self.events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": start, "dur": dur,
                            "args": {"stream": 7, "correlation": self.correlation, "device": 0}})

    def step(self, start: float, kernels: int, rids: str = "a,b") -> float:
        """A decode step: the host launches `kernels` kernels of 40 µs back to back; returns the last end."""
        self.host(f"servprof:decode_step|{rids}", start, kernels * 5.0 + 10)
        end = start
        for i in range(kernels):
            begin = start + 20 + i * 40
            self.kernel(start + i * 5, begin, 40.0)
            end = begin + 40
        return end

    def write(self, path: Path) -> Path:
        path.write_bytes(orjson.dumps({"traceEvents": self.events, "deviceProperties": [{"name": "NVIDIA H100 80GB HBM3"}]}))
        return path


def test_device_idle_between_steps_is_measured_and_blamed(tmp_path: Path):
    trace = StandInGpuTrace()
    t = 1000.0
    for _ in range(6):
        end = trace.step(t, kernels=10)
        # After each step the host blocks on a synchronize for 500 µs before the next launch.
        trace.host("cudaStreamSynchronize", end, 500.0, cat="cuda_runtime")
        t = end + 520
    analysis = analyse(load_trace(trace.write(tmp_path / "gpu.json")))
    (gap,) = [f for f in analysis.findings if f.kind == "decode_gap"]
    assert gap.evidence["cause"] == "synchronize" and gap.evidence["where"] == "between_steps"
    assert gap.evidence["gaps"] == 5
    # Device idle = next step's first kernel (launch + 20 µs) - previous step's last kernel end.
    assert gap.evidence["median_gap_ms"] == pytest.approx(0.540, abs=1e-6)
    assert gap.request_ids == ["a", "b"]
    assert analysis.summary["bandwidth"]["device"]["name"].startswith("NVIDIA H100")
    (split,) = idle_split(load_trace(tmp_path / "gpu.json"), round_like_hta=False)
    # HTA's rule: the launch after each gap began after the previous kernel ended -> host_wait.
    assert split.host_wait_gaps == 5 and split.host_wait_us == pytest.approx(5 * 540.0)


def test_a_kernel_with_no_launch_in_the_trace_never_makes_its_gap_host_wait(tmp_path: Path):
    """A kernel whose launch the trace lacks (launched before the profiler started, or a
    profiler that dropped it) cannot show that the host was late: its gap is kernel_wait or
    other, never host_wait. (HTA 0.5 joins such a kernel to the trace's first event and reads
    that event's start as its launch: on the public HF prefill trace it so calls 7 gaps of
    2-3 µs host_wait, 18 µs in all -- the one place its split and servprof's differ.)"""
    trace = StandInGpuTrace()
    trace.host("ProfilerStep#1", 5000.0, 10.0)  # the first event, after the kernels' gaps
    trace.kernel(100.0, 200.0, 40.0)
    trace.kernel(150.0, 250.0, 40.0)  # launched before the gap: kernel_wait
    trace.events.append({"ph": "X", "cat": "kernel", "name": "orphan", "pid": 0, "tid": 7, "ts": 300.0,
                         "dur": 40.0, "args": {"stream": 7, "correlation": 999, "device": 0}})
    trace.events.append({"ph": "X", "cat": "kernel", "name": "orphan", "pid": 0, "tid": 7, "ts": 400.0,
                         "dur": 40.0, "args": {"stream": 7, "correlation": 998, "device": 0}})
    (split,) = idle_split(load_trace(trace.write(tmp_path / "gpu.json")))
    assert split.host_wait_gaps == 0
    assert (split.kernel_wait_gaps, split.kernel_wait_us) == (2, 10.0 + 10.0)
    assert (split.other_gaps, split.other_us) == (1, 60.0)


def test_another_requests_tokenization_in_a_gap_is_named(tmp_path: Path):
    trace = StandInGpuTrace()
    t = 1000.0
    for k in range(4):
        end = trace.step(t, kernels=8, rids="r1")
        trace.host(f"servprof:tokenize|new-{k}", end + 5, 700.0, tid=LOOP)
        t = end + 720
    analysis = analyse(load_trace(trace.write(tmp_path / "gpu.json")))
    (gap,) = [f for f in analysis.findings if f.kind == "decode_gap"]
    assert gap.evidence["cause"] == "tokenization"
    worst = gap.evidence["worst_gaps"][0]
    assert worst["tokenize_request_ids"][0].startswith("new-")
    assert "tokenization" in gap.title


def test_a_run_of_tiny_kernels_between_steps_is_named(tmp_path: Path):
    trace = StandInGpuTrace()
    t = 1000.0
    for _ in range(4):
        end = trace.step(t, kernels=10)
        # Sampling bookkeeping as 30 tiny kernels, each 4 µs with 16 µs of launch latency between.
        for i in range(30):
            trace.kernel(end + i * 20, end + 16 + i * 20, 4.0, name="tiny_elementwise")
        t = end + 30 * 20
    analysis = analyse(load_trace(trace.write(tmp_path / "gpu.json")))
    (gap,) = [f for f in analysis.findings if f.kind == "decode_gap"]
    # Each tiny kernel starts 16 µs after its launch, which came as the previous one ended: the
    # device waited for the host every time (launch-bound), in 30 short gaps summed per step.
    assert gap.evidence["cause"] == "launch_bound"
    assert sum(g["count"] for g in gap.evidence["worst_gaps"]) == gap.evidence["gaps"] == 3 * 31
    # Idle between two steps is the window minus the tiny kernels' busy time: 30 x 16 µs of launch
    # latency, + 20 µs before the next step's first kernel; counted once, for each of the 3 windows.
    assert [g["idle_us"] for g in gap.evidence["worst_gaps"]] == [pytest.approx(30 * 16 + 20)] * 3
    assert gap.cost_ms == pytest.approx(3 * (30 * 16 + 20) / 1000)
    assert gap.evidence["where"] == "between_steps" and gap.fix


def test_clean_device_timeline_has_no_gap(tmp_path: Path):
    trace = StandInGpuTrace()
    t = 1000.0
    for _ in range(5):
        end = trace.step(t, kernels=10)
        t = end - 10  # the next step's first kernel starts 10 µs after the last one ended
    analysis = analyse(load_trace(trace.write(tmp_path / "gpu.json")))
    assert [f for f in analysis.findings if f.kind == "decode_gap"] == []


def test_per_request_step_markers_are_merged_into_batches(tmp_path: Path):
    # A server that marks one decode_step per request, nested in the batch's time.
    trace = StandInGpuTrace()
    t = 0.0
    for _ in range(5):
        for i, rid in enumerate(("x", "y", "z")):
            trace.host(f"servprof:decode_step|{rid}", t + i * 100, 900 - i * 100)
        t += 900 + 3000  # 3 ms of host time between batches
    analysis = analyse(load_trace(trace.write(tmp_path / "cpu.json")))
    assert len(analysis.steps) == 5
    assert all(s.request_ids == ["x", "y", "z"] and s.dur_us == 900 for s in analysis.steps)
    (gap,) = [f for f in analysis.findings if f.kind == "decode_gap"]
    assert gap.evidence["gaps"] == 4 and gap.evidence["median_gap_ms"] == pytest.approx(3.0)


def test_cpu_step_stalled_by_another_threads_tokenization(tmp_path: Path):
    # Engine thread: 8 decode steps of 2 ms fully covered by ops; in step 5 the engine thread
    # runs ops for only 2 ms of 12 while the loop thread tokenizes (holding the GIL).
    trace = StandInGpuTrace()
    t = 0.0
    for k in range(8):
        length = 12000.0 if k == 5 else 2000.0
        trace.host("servprof:decode_step|r1", t, length)
        trace.host("aten::mm", t, 1000.0)
        trace.host("aten::mm", t + length - 1000.0, 1000.0)
        if k == 5:
            trace.host("servprof:tokenize|late", t + 1000.0, 10000.0, tid=LOOP)
        t += length + 100
    analysis = analyse(load_trace(trace.write(tmp_path / "cpu.json")))
    (gap,) = [f for f in analysis.findings if f.kind == "decode_gap"]
    assert gap.evidence["where"] == "inside_step" and gap.evidence["cause"] == "tokenization"
    assert gap.cost_ms == pytest.approx(10.0)
    assert gap.evidence["worst_gaps"][0]["tokenize_request_ids"] == ["late"]
    (stall,) = [f for f in analysis.findings if f.kind == "tokenization_stall"]
    assert stall.request_ids[0] == "late" and stall.evidence["delayed_steps"] == 1
    assert stall.evidence["overlapping_gap_ms"] == pytest.approx(10.0)


def test_both_vllm_step_annotation_forms(tmp_path: Path):
    trace = StandInGpuTrace()
    trace.host("execute_32_context_0(sq0sk0sqsq0sqsk0)_generation_32(sq32sk55086sqsq32sqsk55086)", 0.0, 100.0,
               cat="user_annotation")
    trace.host("execute_context_1(7)_generation_3(3)", 200.0, 100.0, cat="user_annotation")
    steps = analyse(load_trace(trace.write(tmp_path / "vllm.json"))).steps
    assert [(s.kind, s.batch, s.source) for s in steps] == [("decode", 32, "vllm"), ("mixed", 4, "vllm")]
    assert steps[0].attention == {"decode_sum_q": 32, "decode_sum_kv": 55086} and steps[1].attention == {}


events_strategy = st.lists(
    st.dictionaries(
        st.sampled_from(["ph", "cat", "name", "pid", "tid", "ts", "dur", "args", "id"]),
        st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False),
                  st.text(max_size=5), st.lists(st.integers(-10, 10), max_size=2),
                  st.dictionaries(st.sampled_from(["stream", "correlation", "External id"]),
                                  st.one_of(st.integers(-5, 5), st.text(max_size=3), st.none()), max_size=3)),
        max_size=9,
    ),
    max_size=12,
)


@settings(max_examples=100, deadline=None, derandomize=True)  # the same inputs every CI run
@given(events=events_strategy)
def test_loader_never_fails_with_anything_but_a_trace_error(tmp_path_factory, events):
    path = tmp_path_factory.mktemp("fuzz") / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))  # json: orjson cannot write ints past 64 bits
    try:
        trace = load_trace(path)
    except TraceError as exc:
        assert "\n" not in str(exc)
        return
    assert (trace.dur >= 0).all() and len(trace) <= len(events)
    analyse(trace)  # and the detectors take whatever loaded


@pytest.mark.parametrize("name", [
    "execute_1_context_1(1)_generation_2(2|3)",  # vLLM with attention sums
    "execute_context_0(0)_generation_16(16)",  # vLLM with token counts
    "step[DECODE bs=32]", "ProfilerStep#3", "servprof:decode_step|a,b", "servprof:prefill|a",
])
def test_every_step_annotation_form_is_a_step_not_host_work(name: str) -> None:
    """The gap-cause evidence leaves out the ranges that mark whole steps, in every form
    find_steps reads (one predicate serves both, so they cannot drift apart)."""
    assert is_step_annotation(name)


@pytest.mark.parametrize("name", ["aten::mm", "servprof:tokenize|a", "execute_model", "cudaLaunchKernel"])
def test_host_work_is_not_a_step_annotation(name: str) -> None:
    assert not is_step_annotation(name)
