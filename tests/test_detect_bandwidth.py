"""bandwidth_bound_decode: bytes and FLOPs from record_shapes, intensity against the ridge
point, achieved GB/s, on a trace recorded here with the real torch.profiler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from servprof.detect.analysis import analyse
from servprof.detect.devices import DEVICES, match_device_name, match_device_properties, resolve_device
from servprof.phases import phase
from servprof.trace import load_trace


def test_device_table_and_resolution():
    for spec in DEVICES.values():
        assert spec.memory_bandwidth_gbs > 0 and spec.peak_tflops > 0 and spec.source
    assert resolve_device("mi300x", [], True) is DEVICES["mi300x"]
    assert resolve_device("NVIDIA H100 PCIe", [], True) is DEVICES["h100-pcie"]
    assert match_device_properties({"name": "", "computeMajor": 9, "computeMinor": 4, "numSms": 304}) == "mi300x"
    assert match_device_properties({"name": "NVIDIA H200", "numSms": 132}) == "h200"
    assert match_device_properties({"name": "", "computeMajor": 9, "computeMinor": 0, "numSms": 132,
                                    "totalGlobalMem": 150e9}) == "h200"
    names = {"NVIDIA GH200 480GB": None, "NVIDIA H20": "h20", "NVIDIA GB200": "gb200", "NVIDIA B200": "b200",
             "NVIDIA H100 NVL": "h100-nvl", "NVIDIA A100-SXM4-40GB": "a100-40gb", "NVIDIA A100-SXM4-80GB": "a100",
             "NVIDIA RTX PRO 6000 Blackwell Server Edition": None, "AMD Instinct MI210": "mi210"}
    assert {name: match_device_name(name) for name in names} == names


@pytest.mark.parametrize("prop", [
    {"name": 5, "computeMajor": "9", "computeMinor": 0.0, "numSms": None, "totalGlobalMem": "80GB"},
    {"computeMajor": 9, "computeMinor": 0, "numSms": 132, "totalGlobalMem": "80GB"},
    {"computeMajor": True, "computeMinor": [0], "numSms": {"n": 1}, "totalGlobalMem": float("nan")},
    {"name": ["H100"], "memoryClockRate": "fast", "memoryBusWidth": -1},
])
def test_device_properties_of_the_wrong_type_are_ignored(prop):
    assert match_device_properties(prop) in (None, "h100-sxm")
    assert resolve_device(None, [prop], True).kind == "gpu"


@pytest.fixture(scope="module")
def decode_like_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A matrix-vector product (how decode uses weights) and a square matmul, inside a
    servprof decode_step phase, recorded by torch.profiler with record_shapes."""
    torch.manual_seed(0)
    weight = torch.randn(2048, 2048)
    token = torch.randn(1, 2048)
    # 192x192 fp32: 32 FLOP/byte, above the generic CPU's ridge (25) yet small enough that
    # the matrix-vector products stay a large share of the step even on a loaded host.
    square = torch.randn(192, 192)
    path = tmp_path_factory.mktemp("bw") / "decode.json"
    # One thread: on a loaded 2-core host a parallel matmul waits for its descheduled threads (the
    # square one took 8-25 ms instead of ~0.1 in 3 runs of 12 beside three busy loops), and the
    # matrix-vector products fell under the 5% of step time a finding needs.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.mm(token, weight), torch.mm(square, square)  # (first calls' set-up outside the trace)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(5):
                with phase("decode_step", request_ids=["r1", "r2"]):
                    for _ in range(3):
                        torch.mm(token, weight)
                    torch.mm(square, square)
    finally:
        torch.set_num_threads(threads)
    prof.export_chrome_trace(str(path))
    return path


def test_matvec_is_memory_bound_and_matmul_compute_bound(decode_like_trace: Path):
    analysis = analyse(load_trace(decode_like_trace), device="cpu")
    spec = DEVICES["cpu"]
    points = [p for p in analysis.kernels if p["op"] == "aten::mm"]
    assert len(points) == 20
    matvec = [p for p in points if p["shapes"][0] == [1, 2048]]
    square = [p for p in points if p["shapes"][0] == [192, 192]]
    assert len(matvec) == 15 and len(square) == 5
    for p in matvec:
        assert p["bytes"] == (2048 + 2048 * 2048 + 2048) * 4
        assert p["intensity"] < spec.ridge_flops_per_byte
        assert p["bound"] == "memory"
        # achieved GB/s is exactly bytes over the op's measured time
        assert p["achieved_gbs"] == pytest.approx(p["bytes"] / (p["time_us"] * 1e-6) / 1e9)
    for p in square:
        assert p["intensity"] > spec.ridge_flops_per_byte
        assert p["bound"] == "compute"
    (finding,) = [f for f in analysis.findings if f.kind == "bandwidth_bound_decode"]
    assert finding.request_ids == ["r1", "r2"]
    assert finding.evidence["device"]["name"] == spec.name
    top = finding.evidence["top_ops"][0]
    # The calls below half the (assumed) peak: on a fast machine a call or two may reach more.
    assert top["op"] == "aten::mm" and top["shapes"][0] == [1, 2048] and 1 <= top["calls"] <= 15


def test_calibrated_device_is_used(decode_like_trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from servprof.detect import calibrate

    monkeypatch.setenv("SERVPROF_CACHE_DIR", str(tmp_path))
    result = calibrate.measure(None, copy_mib=16, matmul_n=256, repeats=2)
    assert result["memory_bandwidth_gbs"] > 0 and result["peak_tflops"] > 0
    parser = __import__("argparse").ArgumentParser()
    calibrate.add_arguments(parser)
    assert calibrate.run(parser.parse_args(["--copy-mib", "16", "--matmul-n", "256", "--repeats", "2"])) == 0
    saved = (tmp_path / "calibration.json").read_bytes()
    assert b"memory_bandwidth_gbs" in saved
    analysis = analyse(load_trace(decode_like_trace))  # CPU trace, no --device: the calibration
    device = analysis.summary["bandwidth"]["device"]
    assert device["source"].startswith("measured by servprof calibrate")
    assert analyse(load_trace(decode_like_trace), device="calibrated").summary["bandwidth"]["device"] == device


def test_calibrate_refuses_a_device_it_cannot_use(capsys: pytest.CaptureFixture[str]):
    import argparse

    from servprof.detect import calibrate

    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    device = "meta" if torch.cuda.is_available() else "cuda"
    assert calibrate.run(parser.parse_args(["--device", device, "--no-save"])) == 2
    err = capsys.readouterr().err
    assert err.startswith("servprof calibrate: ") and len(err.strip().splitlines()) == 1
    assert calibrate.run(parser.parse_args(["--repeats", "0"])) == 2
