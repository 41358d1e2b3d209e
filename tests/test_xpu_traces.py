"""Intel GPU (XPU) traces are read as CUDA ones are: device events on their SYCL queues, launches
joined on correlation, unified-runtime waits as syncs, the device's peak from its name.

Kineto's XPU plugin writes a device event's queue as ``sycl queue``, never ``stream``; before this
was read, an XPU trace had no device events at all and was analysed as a CPU-only one. No Intel GPU
is here and no public XPU trace could be vendored, so each test reads the XPU twin of a real CUDA
trace (tests/_xpu_twin.py: the CUDA timings, written in the XPU plugin's fields and names) against
that CUDA trace judged on the same device.
"""

from __future__ import annotations

import gzip
import re
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from _xpu_twin import DRIVER_NAMES, MAX_1550_STACK, RUNTIME_NAMES, xpu_twin

from servprof.detect.analysis import analyse
from servprof.detect.devices import DEVICES, match_device_properties
from servprof.detect.host_classes import SYNC_NAMES
from servprof.trace import load_trace

FIXTURES = Path(__file__).parent / "fixtures"


def _twins(tmp_path: Path, fixture: str) -> tuple[Any, Any]:
    """(the CUDA trace, its XPU twin), both naming one stack of a Max 1550 as their device."""
    document = orjson.loads(gzip.decompress((FIXTURES / fixture).read_bytes()))
    cuda = tmp_path / "cuda.json"
    cuda.write_bytes(orjson.dumps({**document, "deviceProperties": [MAX_1550_STACK]}))
    xpu = tmp_path / "xpu.json"
    xpu.write_bytes(orjson.dumps(xpu_twin(document)))
    return load_trace(cuda), load_trace(xpu)


_CALLS = sorted({*RUNTIME_NAMES, *RUNTIME_NAMES.values(), *DRIVER_NAMES, *DRIVER_NAMES.values()}, key=len, reverse=True)
_CALL_NAMES = re.compile("|".join(map(re.escape, _CALLS)))


def _without_names(value: Any) -> Any:
    """A finding's evidence with the runtime calls' names blanked (the one thing the twins differ in)."""
    if isinstance(value, dict):
        return {k: _without_names(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_without_names(v) for v in value]
    return _CALL_NAMES.sub("<runtime call>", value) if isinstance(value, str) else value


@pytest.mark.parametrize("fixture", ["cuda_tiny_sync_per_step.json.gz", "cuda_hf_generate_h100.json.gz",
                                     "public/hta_cuda_event_sync_a100.json.gz"])
def test_an_xpu_trace_reads_as_its_cuda_twin(tmp_path: Path, fixture: str) -> None:
    cuda, xpu = _twins(tmp_path, fixture)
    assert xpu.has_device_events()
    assert np.array_equal(cuda.device_mask(), xpu.device_mask())
    assert np.array_equal(cuda.stream, xpu.stream)  # (the twin's queue ids are the CUDA streams)
    devices = np.flatnonzero(xpu.device_mask())
    assert np.array_equal(cuda.launch_row_for(devices), xpu.launch_row_for(devices))
    assert (xpu.launch_row_for(devices) >= 0).mean() > 0.9  # kernels joined to their urEnqueue* calls
    ours, theirs = analyse(cuda), analyse(xpu)
    assert ours.findings, "the CUDA trace has findings to compare"
    assert [_without_names((f.kind, f.severity, f.cost_ms, f.title, f.fix, f.evidence)) for f in ours.findings] == \
        [_without_names((f.kind, f.severity, f.cost_ms, f.title, f.fix, f.evidence)) for f in theirs.findings]
    assert ours.summary["decode_gap"]["idle_split"] == theirs.summary["decode_gap"]["idle_split"]
    assert theirs.summary["bandwidth"]["device"]["name"] == DEVICES["max1550-stack"].name


def test_unified_runtime_waits_are_syncs(tmp_path: Path) -> None:
    """HTA's event-sync trace as an XPU trace: the host's urEventWait / urQueueFinish is the gap's cause."""
    _, xpu = _twins(tmp_path, "public/hta_cuda_event_sync_a100.json.gz")
    causes = {f.evidence.get("cause") for f in analyse(xpu).findings}
    assert "synchronize" in causes
    for name in ("urQueueFinish", "urEventWait", "zeEventHostSynchronize", "zeCommandListHostSynchronize",
                 "torch/xpu/__init__.py(1071): synchronize"):
        assert SYNC_NAMES.search(name), name
    assert not SYNC_NAMES.search("urEnqueueKernelLaunch")


def test_a_device_event_without_a_queue_is_not_a_device_event(tmp_path: Path) -> None:
    """Only a ``sycl queue`` that is a queue id makes a stream: none, a string or a negative one leave
    the event off the device (as a CUDA kernel without ``stream`` is)."""
    events: list[dict[str, Any]] = [
        {"ph": "X", "cat": "xpu_runtime", "name": "urEnqueueKernelLaunch", "pid": 1, "tid": 1, "ts": 10.0, "dur": 2.0,
         "args": {"correlation": 1}},
    ]
    for i, queue in enumerate([64, None, "64", -3, True], start=1):
        args: dict[str, Any] = {"correlation": i, "device": 0}
        if queue is not None:
            args["sycl queue"] = queue
        events.append({"ph": "X", "cat": "kernel", "name": f"k{i}", "pid": 0, "tid": 0, "ts": 20.0 + 10 * i,
                       "dur": 5.0, "args": args})
    path = tmp_path / "xpu.json"
    path.write_bytes(orjson.dumps({"traceEvents": events}))
    trace = load_trace(path)
    on_device = sorted(trace.name(int(r)) for r in np.flatnonzero(trace.device_mask()))
    assert on_device == ["k1"]
    assert trace.stream[trace.device_mask()].tolist() == [64]


def test_intel_device_names() -> None:
    """A Max 1550 is a whole card (1024 vector engines) or, in Level Zero's FLAT hierarchy, one of its
    two stacks (512): each has its own peak; a listing without the count is not guessed at."""
    card = {"name": "Intel(R) Data Center GPU Max 1550", "maxComputeUnits": 1024}
    assert match_device_properties(card) == "max1550"
    assert match_device_properties({**card, "maxComputeUnits": 512}) == "max1550-stack"
    assert match_device_properties({"name": card["name"]}) is None
    assert match_device_properties({"name": "Intel(R) Data Center GPU Max 1100", "maxComputeUnits": 448}) == "max1100"
    assert DEVICES["max1550-stack"].memory_bandwidth_gbs * 2 == DEVICES["max1550"].memory_bandwidth_gbs
