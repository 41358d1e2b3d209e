"""A trace of ops that ran on a device the profiler did not record is not a CPU trace.

torch.profiler with ``activities=[ProfilerActivity.CPU]`` on a GPU server records every op but no
kernel: the ops' host times are their dispatch. Before, servprof read such a trace as a CPU one,
judged a GEMM's dispatch against this machine's CPU bandwidth and said "on this CPU trace". The
GPU traces here are servprof's own CUDA fixtures with their device activity taken out, as
``activities=[CPU]`` would have recorded them (every host op and frame is the real one).
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import orjson

from servprof.detect.analysis import analyse
from servprof.detect.unrecorded_device import unrecorded_device
from servprof.trace import load_trace

FIXTURES = Path(__file__).parent / "fixtures"
DEVICE_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "ac2g", "gpu_user_annotation")


def _host_only(tmp_path: Path, fixture: str) -> Path:
    document = orjson.loads(gzip.decompress((FIXTURES / fixture).read_bytes()))
    document["traceEvents"] = [e for e in document["traceEvents"] if e.get("cat") not in DEVICE_ACTIVITY]
    path = tmp_path / "host_only.json"
    path.write_bytes(orjson.dumps(document))
    return path


def _missing(analysis: Any, what: str) -> list[str]:
    return [m["message"] for m in analysis.summary["missing"] if m["what"] == what]


def test_a_gpu_trace_recorded_without_device_activity(tmp_path: Path) -> None:
    trace = load_trace(_host_only(tmp_path, "cuda_tiny_sync_per_step.json.gz"))
    assert not trace.has_device_events()
    found = unrecorded_device(trace)
    assert found is not None and found.device == "NVIDIA H100 80GB HBM3" and not found.ascend
    assert "aten::_cudnn_attention_forward" in found.evidence
    analysis = analyse(trace)
    [message] = _missing(analysis, "device activity")
    assert "ProfilerActivity.CUDA" in message and "dispatch" in message
    bandwidth = analysis.summary["bandwidth"]
    assert bandwidth["ops_modelled"] == 0 and bandwidth["device"]["name"] == "NVIDIA H100 80GB HBM3"
    assert bandwidth["device"]["kind"] == "gpu" and not bandwidth["device"]["identified"]
    assert not [f for f in analysis.findings if f.kind == "bandwidth_bound_decode"]
    assert not _missing(analysis, "op shapes")  # (the shapes are there; the device times are not)
    reads = [f for f in analysis.findings if f.evidence.get("cause") == "host_read_per_step"]
    assert reads and all("CPU trace" not in f.title and "NVIDIA H100" in f.title for f in reads)


def test_the_same_trace_with_its_device_activity_is_a_gpu_trace(tmp_path: Path) -> None:
    trace = load_trace(FIXTURES / "cuda_tiny_sync_per_step.json.gz")
    assert unrecorded_device(trace) is None
    assert not _missing(analyse(trace), "device activity")


def test_a_cpu_trace_is_a_cpu_trace() -> None:
    """The demo's CPU model runs SDPA's CPU kernel (aten::_scaled_dot_product_flash_attention_for_cpu):
    not a device op."""
    trace = load_trace(FIXTURES / "demo_clean.json.gz")
    assert trace.ids_matching(lambda name: name.endswith("_flash_attention_for_cpu")).size
    assert unrecorded_device(trace) is None
    analysis = analyse(trace)
    assert not _missing(analysis, "device activity")
    assert analysis.summary["bandwidth"]["device"]["kind"] == "cpu"


def test_a_torch_npu_trace_says_its_device_tasks_are_not_read(tmp_path: Path) -> None:
    """torch_npu's trace_view.json, in the shape its own tests write it (an events array, string
    timestamps, CANN's calls linked to the 'Ascend Hardware' process by HostToDevice flows)."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "Python"}},
        {"ph": "M", "name": "process_name", "pid": 4, "tid": 0, "args": {"name": "Ascend Hardware"}},
        {"ph": "M", "name": "process_name", "pid": 5, "tid": 0, "args": {"name": "CANN"}},
    ]
    for i in range(12):
        start = 1699529623100000 + 3000 * i
        events += [
            {"ph": "X", "cat": "cpu_op", "name": f"ProfilerStep#{i}", "ts": f"{start}", "dur": 2000, "pid": 1, "tid": 2},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": f"{start + 10}", "dur": 60, "pid": 1, "tid": 2,
             "args": {"Input Dims": [[8, 4096], [4096, 4096]], "Input type": ["c10::BFloat16", "c10::BFloat16"]}},
            {"ph": "X", "name": "AscendCL@aclnnMm", "ts": f"{start + 20}", "dur": 20, "pid": 5, "tid": 2},
            {"ph": "s", "cat": "HostToDevice", "name": "HostToDevice", "id": i, "ts": f"{start + 20}", "pid": 5, "tid": 2},
            {"ph": "X", "name": "MatMulV2", "ts": f"{start + 200}", "dur": 50, "pid": 4, "tid": 3,
             "args": {"Task Type": "AI_CORE", "Stream Id": 3, "Task Id": i}},
            {"ph": "f", "cat": "HostToDevice", "name": "HostToDevice", "id": i, "ts": f"{start + 200}", "pid": 4,
             "tid": 3, "bp": "e"},
        ]
    path = tmp_path / "trace_view.json"
    path.write_bytes(orjson.dumps(events))
    analysis = analyse(load_trace(path))
    [message] = _missing(analysis, "device activity")
    assert "torch_npu" in message and "Ascend Hardware" in message and "AscendCL@aclnnMm" in message
    assert analysis.summary["bandwidth"]["device"]["name"] == "an Ascend NPU"
    assert not [f for f in analysis.findings if f.kind == "bandwidth_bound_decode"]
