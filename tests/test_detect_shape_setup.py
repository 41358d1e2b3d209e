"""shape_setup: an op that pays a set-up on the host for each new input shape (cuDNN attention's
plan, a oneDNN primitive), named from record_shapes alone. Real H100 traces of the demo engine,
where it is the step's bottleneck, and synthetic edges (tests/_kineto_builder.py) for what must
not be called one."""

from __future__ import annotations

import gzip
from pathlib import Path

import orjson
import pytest
from _analyze_helpers import FIXTURES
from _kineto_builder import KinetoTrace

from servprof.detect.analysis import analyse
from servprof.trace import load_trace

CUDNN = "aten::_cudnn_attention_forward"


def setups(analysis):
    return [f for f in analysis.findings if f.kind == "shape_setup"]


def test_cudnn_attention_rebuilding_its_plan_every_step_is_named_on_the_h100_trace():
    trace = load_trace(FIXTURES / "cuda_tiny_clean.json.gz")
    analysis = analyse(trace)
    top = setups(analysis)[0]
    # The innermost op that pays it: not the SDPA op around it.
    assert top.evidence["op"] == CUDNN and top.severity == "critical"
    calls = [r for r in range(len(trace)) if trace.name(r) == CUDNN and trace.complete()[r]]
    shapes = {str(trace.args(r).get("Input Dims")) for r in calls}
    # Every distinct shape's first call is a slow one; all repeats are fast.
    assert top.evidence["new_shape_calls"] == len(shapes) and top.evidence["slow_repeats"] == 0
    assert top.evidence["repeat_calls"] == len(calls) - len(shapes)
    assert top.evidence["new_median_ms"] > 10 * top.evidence["repeat_median_ms"]
    assert top.cost_ms <= sum(trace.dur[r] for r in calls) / 1000
    assert set(top.request_ids) == set(trace.metadata[0]["servprof_fixture"]["prompt_tokens"])
    assert "sdpa_kernel" in top.fix and "bucket" in top.fix
    # The device idle it causes (decode_gap: a slow host op) gets the same fix, not "move the op out".
    waits = [f for f in analysis.findings if f.kind == "decode_gap" and f.evidence.get("cause") == "host_ops"]
    assert waits and all(f.evidence["shape_setup_op"] == CUDNN and "sdpa_kernel" in f.fix for f in waits)


def test_cudnn_attention_recorded_without_shapes_gets_its_fix_as_something_to_check(tmp_path: Path):
    # The same H100 trace as a plain torch.profiler records it (no record_shapes): the per-shape
    # set-up cannot be told from the trace, but the op is known to pay one; "move the op out of the
    # step" would still be the wrong advice.
    document = orjson.loads(gzip.decompress((FIXTURES / "cuda_tiny_clean.json.gz").read_bytes()))
    for event in document["traceEvents"]:
        for key in ("Input Dims", "Input type", "Input Strides", "Concrete Inputs"):
            event.get("args", {}).pop(key, None)
    path = tmp_path / "plain.json"
    path.write_bytes(orjson.dumps(document))
    analysis = analyse(load_trace(path))
    assert setups(analysis) == []
    assert CUDNN in analysis.summary["shape_setup"]["unshaped_ops"]
    waits = [f for f in analysis.findings if f.kind == "decode_gap" and f.evidence.get("cause") == "host_ops"]
    assert waits and all(f.evidence["shape_setup_op"] == CUDNN for f in waits)
    assert all("sdpa_kernel" in f.fix and "record_shapes=True" in f.fix for f in waits)


def test_a_step_whose_shapes_repeat_has_none():
    # One decode step at a fixed batch and length, after warm-up: every shape was seen before.
    assert setups(analyse(load_trace(FIXTURES / "gpu_decode" / "decode_b8.json.gz"))) == []


def _op_trace(tmp_path: Path, durations_and_shapes: list[tuple[float, list[int]]], name: str = "aten::conv") -> Path:
    trace = KinetoTrace()
    ts = 0.0
    for dur, dims in durations_and_shapes:
        trace.host(name, ts, dur, args={"Input Dims": [dims, [4, 4]], "Input type": ["float", "float"]})
        ts += dur + 50
    return trace.write(tmp_path / "t.json")


def test_new_shapes_paying_a_set_up_against_fast_repeats(tmp_path: Path):
    calls = [(5000, [1, 8]), (100, [1, 8]), (6000, [1, 9]), (100, [1, 9]), (110, [1, 8]), (7000, [1, 10])]
    (finding,) = setups(analyse(load_trace(_op_trace(tmp_path, calls))))
    assert finding.evidence["new_shape_calls"] == 3 and finding.evidence["repeat_calls"] == 3
    assert finding.cost_ms == pytest.approx((5000 + 6000 + 7000 - 3 * 100) / 1000)
    assert "sdpa_kernel" not in finding.fix  # not cuDNN attention: the general remedy only


@pytest.mark.parametrize("calls", [
    # One slow first call, then repeats: a lazy initialisation, not a set-up per shape.
    [(5000, [1, 8]), (100, [1, 8]), (100, [1, 8]), (100, [1, 9]), (100, [1, 9])],
    # Slow whatever the shape, new or not: the op is slow, shapes have nothing to do with it.
    [(5000, [1, 8]), (5000, [1, 8]), (6000, [1, 9]), (5500, [1, 9]), (5000, [1, 10])],
    # New shapes only: nothing to compare them with.
    [(5000, [1, 8]), (6000, [1, 9]), (7000, [1, 10])],
    # Slow new shapes but under a millisecond: not worth naming.
    [(900, [1, 8]), (10, [1, 8]), (900, [1, 9]), (10, [1, 9]), (900, [1, 10])],
    # Three slow calls that happen to be new shapes, among many new shapes that were fast.
    [(5000, [1, 8]), (100, [1, 8]), (6000, [1, 9]), (7000, [1, 10]),
     *((100, [2, n]) for n in range(10)), (100, [2, 3])],
])
def test_what_is_not_a_set_up_per_shape(tmp_path: Path, calls):
    assert setups(analyse(load_trace(_op_trace(tmp_path, calls)))) == []


def test_a_copy_waiting_for_the_device_is_not_a_set_up(tmp_path: Path):
    # A copy to the host waits for the work queued before it (its runtime call blocks): its first
    # calls with each shape can be slow for that alone. The runtime call's time is not the op's own.
    trace = KinetoTrace()
    ts = 0.0
    for dur, dims in [(5000, [1, 8]), (100, [1, 8]), (6000, [1, 9]), (100, [1, 9]), (7000, [1, 10]), (100, [1, 10])]:
        trace.host("aten::copy_", ts, dur, args={"Input Dims": [dims, dims], "Input type": ["float", "float"]})
        trace.host("cudaMemcpyAsync", ts + 5, dur - 20, cat="cuda_runtime", args={"correlation": 1})
        ts += dur + 50
    assert setups(analyse(load_trace(trace.write(tmp_path / "t.json")))) == []


def test_no_shapes_recorded_says_nothing(tmp_path: Path):
    trace = KinetoTrace()
    for i, dur in enumerate([5000, 100, 6000, 100]):
        trace.host("aten::conv", i * 10_000, dur)
    assert setups(analyse(load_trace(trace.write(tmp_path / "t.json")))) == []
