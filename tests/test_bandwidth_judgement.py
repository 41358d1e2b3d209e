"""What the bandwidth detector claims, on synthetic traces with hand-computed figures and on a
public H100 trace: never a GB/s above the device's peak in a finding (the summary says whether the
device or the model is wrong), unknown GPUs stay GPUs, --device against the trace is a warning,
severity is the share of step (or trace) time, and an assumed peak never makes more than info."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from _analyze_helpers import public_trace
from _bandwidth_helpers import H100, SynthTrace

from servprof.cli import main
from servprof.detect import calibrate
from servprof.detect.analysis import analyse
from servprof.detect.devices import DEVICES
from servprof.trace import load_trace

N = 1_000_000  # elements of the add below: 3 x 4 MB = 12 MB moved, 3.58 us at an H100's 3350 GB/s
ADD = ("aten::add", [[N], [N], []], ["float", "float", "Scalar"], ["", "", "1"])
ADD_BYTES = 3 * N * 4
# A GPU op large enough for its time left on the table to matter (findings under 1 ms in all are
# never critical, under 0.1 ms only info): 3 x 48 MB = 144 MB, 42.99 us at an H100's 3350 GB/s.
BIG_N = 12 * N
BIG_ADD = ("aten::add", [[BIG_N], [BIG_N], []], ["float", "float", "Scalar"], ["", "", "1"])
BIG_BYTES = 3 * BIG_N * 4


@pytest.fixture(autouse=True)
def no_saved_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SERVPROF_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _gpu_trace(tmp_path: Path, kernel_us: float, span_us: float, props: list | None = None) -> Path:
    """One 144 MB add whose kernel takes kernel_us (from 5 us), and a 1-element add whose 30 us kernel
    ends the device timeline at span_us + 5: a device span of span_us. (The 1-element add moves 12 B:
    per-op overhead, never time left to bandwidth.)"""
    synth = SynthTrace([H100] if props is None else props)
    synth.op(*BIG_ADD[:1], 0.0, kernel_us + 20, *BIG_ADD[1:], kernel_us=kernel_us)
    synth.op("aten::add", span_us - 30, 20, [[1], [1], []], ["float", "float", "Scalar"], kernel_us=30.0)
    return synth.write(tmp_path / "t.json.gz")


def test_public_h100_trace_has_no_op_above_peak_and_models_the_issue_ops():
    analysis = analyse(load_trace(public_trace("hf_qwen1.5_0.5b_prefill_h100.json.gz")))
    bandwidth = analysis.summary["bandwidth"]
    assert bandwidth["device"]["name"] == DEVICES["h100-sxm"].name and bandwidth["device"]["identified"]
    assert all(not p["above_peak"] for p in analysis.kernels)  # was 154% (mean) and 122% (copy_)
    n = 16 * 559 * 1024
    means = [p for p in analysis.kernels if p["op"] == "aten::mean" and p["shapes"][0] == [16, 559, 1024]]
    assert means and all(p["bytes"] == n * 4 + 16 * 559 * 4 for p in means)
    converts = [p for p in analysis.kernels if p["op"] == "aten::to" and p["shapes"][0] == [16, 559, 1024]]
    assert converts and all(p["bytes"] == n * 2 + n * 4 for p in converts)  # bf16 -> fp32 and back
    for finding in analysis.findings:
        assert finding.fix
        if finding.kind == "bandwidth_bound_decode":
            assert finding.evidence["bandwidth_share"] <= 1.0
            assert all(op["bandwidth_share"] <= 1.0 for op in finding.evidence["top_ops"])


def test_an_op_faster_than_the_peak_is_a_model_error_never_a_finding(tmp_path: Path):
    # 144 MB in 24 us = 6000 GB/s on a 3350 GB/s H100: impossible; the trace names the device.
    analysis = analyse(load_trace(_gpu_trace(tmp_path, kernel_us=24.0, span_us=1200.0)))
    above = analysis.summary["bandwidth"]["above_peak"]
    assert above["ops"] == 1 and above["error"] == "model"
    assert above["examples"][0]["achieved_gbs"] == pytest.approx(BIG_BYTES / 24e-6 / 1e9, rel=1e-3)
    assert any("faster than" in w for w in analysis.summary["warnings"])
    for finding in analysis.findings:
        assert all(op["shapes"] != BIG_ADD[1] for op in finding.evidence.get("top_ops", []))


def test_an_op_the_l2_cache_can_account_for_is_no_model_error(tmp_path: Path):
    # 144 MB in 30 us = 4800 GB/s on a 3350 GB/s H100: above the DRAM peak, but DRAM at peak moves
    # 100.5 MB in 30 us, and the other 43.5 MB fit in its 50 MiB L2: data that was there already.
    analysis = analyse(load_trace(_gpu_trace(tmp_path, kernel_us=30.0, span_us=1200.0)))
    above = analysis.summary["bandwidth"]["above_peak"]
    assert above["ops"] == above["cache_may_serve"] == 1 and above["error"] == "cache"
    assert BIG_BYTES - 3350e9 * 30e-6 <= 50 * 1024**2 < BIG_BYTES - 3350e9 * 24e-6  # (24 us: the model error above)
    assert not any("faster than" in w for w in analysis.summary["warnings"])
    for finding in analysis.findings:  # still left out of every finding
        assert all(op["shapes"] != BIG_ADD[1] for op in finding.evidence.get("top_ops", []))


def test_public_v100_training_gradients_read_back_from_l2_are_no_model_error():
    """Kineto's ResNet-50 sample: AccumulateGrad's aten::add_ of two 2 MiB gradients (6 MiB moved)
    in 4-5 µs on a V100 (900 GB/s): the gradient the backward kernel just wrote is read back from
    the 6 MiB L2. Every such call is within what DRAM at peak and the L2 could move; none is
    reported as servprof's error, and none is judged."""
    analysis = analyse(load_trace(public_trace("kineto_resnet50_dataloader_v100.json.gz")))
    above = analysis.summary["bandwidth"]["above_peak"]
    assert above["ops"] > 100 and above["cache_may_serve"] == above["ops"] and above["error"] == "cache"
    for example in above["examples"]:
        assert example["bytes"] - 900e9 * example["time_us"] * 1e-6 <= 6 * 1024**2
    assert not any("faster than" in w for w in analysis.summary["warnings"])


def test_a_peak_the_trace_contradicts_is_a_device_error_and_a_warning(tmp_path: Path, capsys):
    path = _gpu_trace(tmp_path, kernel_us=24.0, span_us=1200.0)
    # Judged against an L4 (300 GB/s) although the trace ran on an H100.
    analysis = analyse(load_trace(path), device="l4")
    assert analysis.summary["bandwidth"]["above_peak"]["error"] == "device"
    assert any("disagrees with the trace's deviceProperties" in w for w in analysis.summary["warnings"])
    assert main(["analyze", str(path), "--device", "l4"]) == 0
    assert "warning:" in capsys.readouterr().out


def test_device_named_against_a_cpu_trace_is_a_warning(tmp_path: Path):
    synth = SynthTrace([])
    synth.op(*ADD[:1], 0.0, 5000.0, *ADD[1:])
    analysis = analyse(load_trace(synth.write(tmp_path / "cpu.json.gz")), device="h100-sxm")
    assert any("no device kernels" in w for w in analysis.summary["warnings"])
    assert all(f.severity == "info" for f in analysis.findings)


@pytest.mark.parametrize(("span_us", "severity"), [(3600.0, "critical"), (12_000.0, "warning"),
                                                  (1_200_000.0, None)])
def test_severity_is_the_share_of_the_trace_span_without_steps(tmp_path: Path, span_us: float, severity):
    # The add: 1200 us for 144 MB = 120 GB/s, 3.6% of the H100's peak; its roofline is 43 us, so it
    # leaves 1157 us (the 12-byte add's 30 us are per-op overhead, not counted). Span 3.6 ms: 32%
    # -> critical; 12 ms: 9.6% -> warning; 1.2 s: the ops are 0.1% of the trace -> no finding
    # (before, severity followed the ops' own time: "critical" at any span).
    analysis = analyse(load_trace(_gpu_trace(tmp_path, kernel_us=1200.0, span_us=span_us)))
    found = [f for f in analysis.findings if f.kind == "bandwidth_bound_decode"]
    if severity is None:
        assert found == []
        return
    (finding,) = found
    assert finding.severity == severity
    left = 1200.0 - BIG_BYTES / (3350e9) * 1e6
    assert finding.evidence["time_judged_ms"] == pytest.approx(span_us / 1000, rel=1e-6)
    assert finding.evidence["left_on_table_share"] == pytest.approx(left / span_us, abs=1e-3)
    assert finding.cost_ms == pytest.approx(left / 1000, rel=1e-3) and finding.evidence["overhead_bound_ops"] == 1
    assert finding.evidence["scope"] == "whole trace" and finding.request_ids == []
    assert "3%" in finding.fix or "4%" in finding.fix  # the measured share of peak, in the remedy
    assert "element-wise" in finding.fix


def test_unknown_gpu_is_a_gpu_with_an_unknown_peak_and_says_how_to_calibrate(tmp_path: Path):
    props = [{"id": 0, "name": "NVIDIA RTX PRO 6000 Blackwell Server Edition", "totalGlobalMem": 102e9,
              "computeMajor": 12, "computeMinor": 0, "numSms": 188}]
    analysis = analyse(load_trace(_gpu_trace(tmp_path, kernel_us=1200.0, span_us=3600.0, props=props)))
    device = analysis.summary["bandwidth"]["device"]
    assert device["kind"] == "gpu" and device["basis"] == "unknown" and device["memory_bandwidth_gbs"] is None
    assert "RTX PRO 6000" in device["name"] and "CPU" not in device["name"]
    assert [f for f in analysis.findings if f.kind == "bandwidth_bound_decode"] == []
    (missing,) = [m for m in analysis.summary["missing"] if m["what"] == "device peak"]
    assert "servprof calibrate" in missing["message"]
    assert analysis.kernels and analysis.kernels[0]["achieved_gbs"] == pytest.approx(BIG_BYTES / 1200e-6 / 1e9)


def test_unknown_gpu_peak_from_memory_clock_and_bus_width(tmp_path: Path):
    # 2 x 2619 MHz x 5120 bits / 8 = 3352.3 GB/s (an H100 SXM's HBM3, as CUDA reports it).
    props = [{"name": "NVIDIA Future GPU", "memoryClockRate": 2_619_000, "memoryBusWidth": 5120}]
    analysis = analyse(load_trace(_gpu_trace(tmp_path, kernel_us=1200.0, span_us=3600.0, props=props)))
    device = analysis.summary["bandwidth"]["device"]
    assert device["basis"] == "derived" and device["memory_bandwidth_gbs"] == pytest.approx(3352.3, abs=0.1)
    (finding,) = [f for f in analysis.findings if f.kind == "bandwidth_bound_decode"]
    assert finding.severity == "critical"  # identified from the trace's own properties: not capped


def test_unknown_gpu_uses_a_calibration_of_the_same_name(tmp_path: Path, no_saved_calibration: Path):
    calibrate.save({"name": "NVIDIA Future GPU", "torch_device": "cuda:0", "memory_bandwidth_gbs": 5000.0,
                    "peak_tflops": 1500.0, "measured_at": 1.0})
    props = [{"name": "NVIDIA Future GPU"}]
    analysis = analyse(load_trace(_gpu_trace(tmp_path, kernel_us=1200.0, span_us=3600.0, props=props)))
    device = analysis.summary["bandwidth"]["device"]
    assert device["basis"] == "calibrated" and device["memory_bandwidth_gbs"] == 5000.0
    # A calibration of another device is never used for it.
    other = [{"name": "NVIDIA Other GPU"}]
    analysis = analyse(load_trace(_gpu_trace(tmp_path, kernel_us=1200.0, span_us=3600.0, props=other)))
    assert analysis.summary["bandwidth"]["device"]["basis"] == "unknown"


def test_assumed_cpu_peak_gives_at_most_info_and_says_which_peak(tmp_path: Path):
    synth = SynthTrace([])
    for step in range(4):  # decode steps, each mostly one slow 12 MB add: 12 MB in 3 ms = 4 GB/s
        synth.span("servprof:decode_step|r1", step * 4000.0, 3500.0)
        synth.op(*ADD[:1], step * 4000.0 + 100, 3000.0, *ADD[1:])
    analysis = analyse(load_trace(synth.write(tmp_path / "cpu.json.gz")))
    (finding,) = [f for f in analysis.findings if f.kind == "bandwidth_bound_decode"]
    assert finding.severity == "info"  # 10% of a 40 GB/s assumed peak, 70% of step time left
    assert "assumed" in finding.title and "servprof calibrate" in finding.evidence["severity_capped"]
    assert "servprof calibrate" in finding.fix


def test_measured_cpu_peak_judges_for_real_unless_the_step_fits_in_cache(tmp_path: Path, no_saved_calibration):
    synth = SynthTrace([])
    for step in range(4):
        synth.span("servprof:decode_step|r1", step * 4000.0, 3500.0)
        synth.op(*ADD[:1], step * 4000.0 + 100, 3000.0, *ADD[1:])
    path = synth.write(tmp_path / "cpu.json.gz")
    result = {"name": "CPU Test", "torch_device": "cpu", "memory_bandwidth_gbs": 40.0, "peak_tflops": 1.0,
              "measured_at": 1.0, "cache_bytes": 8 * 1024**2}
    calibrate.save(result)
    (finding,) = [f for f in analyse(load_trace(path)).findings if f.kind == "bandwidth_bound_decode"]
    assert finding.severity == "critical" and "severity_capped" not in finding.evidence  # 12 MB > 8 MB cache
    calibrate.save({**result, "cache_bytes": 64 * 1024**2, "measured_at": 2.0})
    (finding,) = [f for f in analyse(load_trace(path)).findings if f.kind == "bandwidth_bound_decode"]
    assert finding.severity == "info" and "last-level cache" in finding.evidence["severity_capped"]
    assert "per-op overhead" in finding.fix and "fits in the last-level cache" in finding.fix
    assert "move too little" not in finding.fix  # (12 MB a step: not little, but in the cache)


@pytest.mark.parametrize(("op", "capped"), [(ADD, True), (BIG_ADD, False)], ids=["12MB", "144MB"])
def test_a_gpu_decode_step_that_fits_in_the_l2_is_not_bandwidth_bound(tmp_path: Path, op: tuple, capped: bool):
    """An H100 decode step whose one add runs at a fraction of the peak: 12 MB a step fits in the
    H100's 50 MiB L2 (its datasheet's), so DRAM bandwidth does not bound it and the finding is at most
    info; 144 MB does not, and the same slowness is judged."""
    synth = SynthTrace([H100])
    for step in range(4):
        synth.span("servprof:decode_step|r1", step * 4000.0, 3500.0)
        synth.op(*op[:1], step * 4000.0 + 100, 3100.0, *op[1:], kernel_us=3000.0)
    (finding,) = [f for f in analyse(load_trace(synth.write(tmp_path / "t.json.gz"))).findings
                  if f.kind == "bandwidth_bound_decode"]
    assert finding.evidence["device"]["cache_bytes"] == 50 * 1024**2
    if capped:
        assert finding.severity == "info" and "52 MB last-level cache" in finding.evidence["severity_capped"]
    else:
        assert finding.severity != "info" and "severity_capped" not in finding.evidence


def test_a_step_whose_ops_are_mostly_unmodelled_is_not_said_to_fit_in_cache(tmp_path: Path, no_saved_calibration):
    """The same steps, each with a dynamically quantised linear beside the add, three times as long:
    its int8 weight is packed in an object whose shape the profiler does not record, so the 12 MB
    the add moves is not a step's traffic and nothing says it fits in a 64 MB cache; the finding,
    its evidence and the summary's missing list name the op left out."""
    synth = SynthTrace([])
    for step in range(4):
        synth.span("servprof:decode_step|r1", step * 16000.0, 15500.0)
        synth.op(*ADD[:1], step * 16000.0 + 100, 3000.0, *ADD[1:])
        synth.op("quantized::linear_dynamic", step * 16000.0 + 3200, 9000.0, [[1, 1, 4096], [], []], ["float", "", "Scalar"])
    calibrate.save({"name": "CPU Test", "torch_device": "cpu", "memory_bandwidth_gbs": 40.0, "peak_tflops": 1.0,
                    "measured_at": 1.0, "cache_bytes": 64 * 1024**2})
    analysis = analyse(load_trace(synth.write(tmp_path / "cpu.json.gz")))
    (finding,) = [f for f in analysis.findings if f.kind == "bandwidth_bound_decode"]
    assert "last-level cache" not in finding.evidence.get("severity_capped", "") and "last-level cache" not in finding.fix
    left_out = finding.evidence["unmodelled"]
    assert left_out["share_of_op_time"] == pytest.approx(0.75) and left_out["top_ops"][0]["name"] == "quantized::linear_dynamic"
    assert left_out["top_ops"][0]["calls"] == 4 and "leave out 75%" in finding.fix
    (missing,) = [m for m in analysis.summary["missing"] if m["what"] == "op bytes"]
    assert "quantized::linear_dynamic (36.0 ms, 4 calls)" in missing["message"]


# Decode attention over a 16k-token KV cache: q [1, 8, 1, 64], k and v [1, 8, 16384, 64] in float32 (67 MB).
ATTENTION = ("aten::scaled_dot_product_attention", [[1, 8, 1, 64], [1, 8, 16384, 64], [1, 8, 16384, 64]],
             ["float", "float", "float"], ["", "", ""])


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_the_remedy_for_slow_attention_is_the_devices_own(tmp_path: Path, device: str):
    """FlashAttention, FlashInfer, paged attention and an fp8 KV cache are GPU kernels and formats:
    a CPU trace's slow decode attention is told what a CPU has (a bfloat16, preallocated cache)."""
    synth = SynthTrace([] if device == "cpu" else [H100])
    for step in range(4):  # each step mostly the attention op, far below either peak
        synth.span("servprof:decode_step|r1", step * 40_000.0, 35_000.0)
        synth.op(ATTENTION[0], step * 40_000.0 + 100, 30_000.0, *ATTENTION[1:],
                 **({} if device == "cpu" else {"kernel_us": 29_000.0}))
    (finding,) = [f for f in analyse(load_trace(synth.write(tmp_path / "t.json.gz"))).findings
                  if f.kind == "bandwidth_bound_decode"]
    assert "attention ops" in finding.fix
    if device == "cpu":
        assert "KV cache in bfloat16" in finding.fix and "FlashInfer" not in finding.fix and "fp8" not in finding.fix
    else:
        assert "FlashAttention / FlashInfer" in finding.fix


def test_report_json_keeps_the_device_basis_and_the_fix(tmp_path: Path):
    out = tmp_path / "r.json"
    assert main(["analyze", str(_gpu_trace(tmp_path, kernel_us=1200.0, span_us=3600.0)), "--json", str(out)]) == 0
    report = orjson.loads(out.read_bytes())
    assert report["summary"]["bandwidth"]["device"]["basis"] == "datasheet"
    assert all(f["fix"] for f in report["findings"])


@pytest.mark.parametrize("with_big_op", [False, True])
def test_ops_too_small_to_be_bandwidth_bound_are_per_op_overhead(tmp_path: Path, with_big_op: bool):
    # 30 one-element adds whose kernels take 2 us: this trace's shortest ops, so its per-op floor.
    # 10 adds of 4 KB x 3 taking 40 us each: at 3350 GB/s their bytes need 3.7 ns, far under the
    # 2 us floor: no memory system would make them faster, so they are overhead, not bandwidth.
    synth = SynthTrace([H100])
    t = 0.0
    for _ in range(30):
        synth.op("aten::add", t, 10, [[1], [1], []], ["float", "float", "Scalar"], kernel_us=2.0)
        t += 12
    for _ in range(10):
        synth.op("aten::add", t, 50, [[1024], [1024], []], ["float", "float", "Scalar"], kernel_us=40.0)
        t += 52
    if with_big_op:  # plus, 9 ms later, the 144 MB add at 3.6% of peak: bandwidth-limited, 1157 us left
        t += 9000
        synth.op(*BIG_ADD[:1], t, 1220, *BIG_ADD[1:], kernel_us=1200.0)
    analysis = analyse(load_trace(synth.write(tmp_path / "t.json.gz")))
    assert analysis.summary["bandwidth"]["op_floor_us"] == pytest.approx(2.0)
    (finding,) = [f for f in analysis.findings if f.kind == "bandwidth_bound_decode"]
    assert finding.evidence["overhead_bound_ops"] == 2  # the 1-element and the 4 KB shapes
    if with_big_op:
        left = 1200.0 - BIG_BYTES / 3350e9 * 1e6
        # Only the big add's 1157 us count, against the device span: kernels from 5 us to t + 5 + 1200 us.
        assert finding.evidence["ops_below_half_peak"] == 1 and finding.cost_ms == pytest.approx(left / 1000, rel=1e-3)
        assert finding.evidence["left_on_table_share"] == pytest.approx(left / (t + 1200.0), abs=1e-4)
        assert finding.severity == "warning"  # 10.4%; counting the overhead-bound ops too would make it 14.6%
    else:
        assert finding.severity == "info" and "per-op overhead" in finding.title
        assert "per-op overhead" in finding.evidence["severity_capped"] and "fewer, larger ops" in finding.fix


def test_a_named_stand_in_for_an_unknown_gpu_is_judged_with_a_warning(tmp_path: Path):
    props = [{"name": "NVIDIA RTX PRO 6000 Blackwell Server Edition"}]
    analysis = analyse(load_trace(_gpu_trace(tmp_path, kernel_us=1200.0, span_us=3600.0, props=props)),
                       device="h100-sxm")
    assert any("does not know" in w for w in analysis.summary["warnings"])
    (finding,) = [f for f in analysis.findings if f.kind == "bandwidth_bound_decode"]
    assert finding.severity == "critical"  # the user's stand-in is not contradicted by the trace


@pytest.mark.parametrize(("kernel_us", "severity"), [(None, "info"), (600.0, "warning"), (1200.0, "critical")])
def test_a_small_cost_is_never_critical_whatever_its_share(tmp_path: Path, kernel_us: float | None, severity: str):
    """A trace of a few µs of device work (SGLang's graph-capture trace: two 8-byte fills, 11 µs
    in all) was 'critical, 100% of the trace span'. A cost under 1 ms in all is at most a warning,
    and per-op overhead (bytes that take under a µs at peak, with too few ops to measure the
    trace's own floor) is never time left to bandwidth."""
    synth = SynthTrace([H100])
    synth.op("aten::fill_", 0.0, 10, [[1], []], ["long int", "Scalar"], kernel_us=5.5)
    synth.op("aten::fill_", 10.0, 10, [[1], []], ["long int", "Scalar"], kernel_us=5.5)
    if kernel_us is not None:  # the 144 MB add at 3.6% of peak, most of the device span
        synth.op(*BIG_ADD[:1], 20.0, kernel_us + 20, *BIG_ADD[1:], kernel_us=kernel_us)
    analysis = analyse(load_trace(synth.write(tmp_path / "t.json.gz")))
    assert analysis.summary["bandwidth"]["op_floor_us"] == pytest.approx(1.0)
    (finding,) = [f for f in analysis.findings if f.kind == "bandwidth_bound_decode"]
    assert finding.severity == severity
    assert finding.evidence["overhead_bound_ops"] == 1  # the fills
    if kernel_us is None:
        assert finding.evidence["ops_below_half_peak"] == 0 and "per-op overhead" in finding.title
    else:  # most of the span either way: the cost alone tells warning from critical
        assert finding.evidence["left_on_table_share"] > 0.2
        assert finding.cost_ms == pytest.approx((kernel_us - BIG_BYTES / 3350e9 * 1e6) / 1000, rel=1e-3)


def test_shapes_however_written_are_modelled_alike_and_unreadable_args_are_not_guessed(tmp_path: Path):
    """The detector reads each op's shape args as text (one decode per distinct text): the same
    shapes written with spaces, in another key order, or with other args around them give the same
    cost; an op whose shape args are not UTF-8 is not modelled (its args do not decode), and the
    others still are."""
    synth = SynthTrace([H100])
    for i in range(4):
        synth.op(*ADD[:1], 100.0 * i, 20.0, *ADD[1:], kernel_us=10.0)
    text = orjson.dumps({**synth.top, "traceEvents": synth.events})
    dims = orjson.dumps(ADD[1])
    compact = b'"Input Dims":' + dims
    assert text.count(compact) == 4
    second = text.index(compact, text.index(compact) + 1)
    text = text[:second] + b'"Input Dims" :  ' + dims.replace(b",", b", ") + text[second + len(compact):]
    third = text.index(compact, second + 1)
    text = text[:third] + b'"Input Strides": ["\xff"], ' + text[third:]
    path = tmp_path / "t.json"
    path.write_bytes(text)
    analysis = analyse(load_trace(path))
    assert analysis.summary["bandwidth"]["ops_modelled"] == 3
    assert [p["bytes"] for p in analysis.kernels] == [ADD_BYTES] * 3
    assert all(p["shapes"] == ADD[1] for p in analysis.kernels)


def test_to_that_changes_nothing_leaves_no_bytes_out(tmp_path: Path, no_saved_calibration):
    """A decode loop's .to(float32) of float32 tensors returns them (no copy): however long those
    calls take on a busy CPU, no bytes are left out with them, so they neither count as unmodelled
    op time nor keep the step's bytes from being said to fit in the cache. A gather whose indices
    the profiler does not record (aten::index) still does."""
    synth = SynthTrace([])
    for step in range(4):
        synth.span("servprof:decode_step|r1", step * 16000.0, 15500.0)
        synth.op(*ADD[:1], step * 16000.0 + 100, 3000.0, *ADD[1:])
        for k in range(30):  # 9 ms of no-op to() calls a step: three times the add
            synth.op("aten::to", step * 16000.0 + 3200 + k * 320, 300.0, [[1, 4, 1, 16], [], [], [], []],
                     ["float", "Scalar", "Scalar", "Scalar", ""], ["", "6", "False", "False", ""])
    calibrate.save({"name": "CPU Test", "torch_device": "cpu", "memory_bandwidth_gbs": 40.0, "peak_tflops": 1.0,
                    "measured_at": 1.0, "cache_bytes": 64 * 1024**2})
    analysis = analyse(load_trace(synth.write(tmp_path / "cpu.json.gz")))
    (finding,) = [f for f in analysis.findings if f.kind == "bandwidth_bound_decode"]
    assert analysis.summary["bandwidth"]["unmodelled"]["share_of_op_time"] == 0.0
    assert finding.severity == "info" and "last-level cache" in finding.evidence["severity_capped"]
    gather = SynthTrace([])
    for step in range(4):
        gather.span("servprof:decode_step|r1", step * 16000.0, 15500.0)
        gather.op(*ADD[:1], step * 16000.0 + 100, 3000.0, *ADD[1:])
        gather.op("aten::index", step * 16000.0 + 3200, 9000.0, [[16, 2, 1498, 16], []], ["float", ""], ["", ""])
    left_out = analyse(load_trace(gather.write(tmp_path / "gather.json.gz"))).summary["bandwidth"]["unmodelled"]
    assert left_out["share_of_op_time"] == pytest.approx(0.75) and left_out["top_ops"][0]["name"] == "aten::index"
