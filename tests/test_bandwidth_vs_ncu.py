"""The bandwidth detector's byte models against Nsight Compute's DRAM counters, on one decode step
of the demo's 1B Llama-shaped model (bf16, an H100) at batch 1, 8 and 32.

The fixture (tests/fixtures/gpu_decode, made on a lent GPU machine by bench/gpu/device_checks.sh:
bench/gpu/decode_step.py under torch.profiler and under ncu, joined by bench/gpu/ncu_compare.py)
holds the profiler traces and, per kernel in launch order, ncu's `dram__bytes_read.sum +
dram__bytes_write.sum` and `gpu__time_duration.sum`. This test recomputes servprof's bytes and
GB/s on those kernels with the detector's own code, on CPU-only CI: a byte model that drifts
from what the hardware counted fails here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
from _analyze_helpers import FIXTURES

from servprof.detect.analysis import analyse
from servprof.detect.devices import DEVICES
from servprof.trace import load_trace

sys.path.insert(0, str(Path(__file__).parents[1] / "bench" / "gpu"))
from ncu_compare import _base_name, _kernel_rows, compare  # noqa: E402

FOLDER = FIXTURES / "gpu_decode"
RECORDED = orjson.loads((FOLDER / "ncu.json").read_bytes())
# Ops this large read their operands from DRAM (weights, the KV cache: the L2 holds 50 MB), so
# ncu's DRAM counters measure their traffic. Smaller ones can stay in L2 (a 512 KiB output is never
# written back during its kernel): DRAM counters undercount them, whatever the model says.
DRAM_SIZED = 4 << 20
TOLERANCE = 0.10
LAYERS = 16


@pytest.fixture(scope="module", params=sorted(RECORDED["batches"], key=int))
def batch(request):
    trace = load_trace(FOLDER / f"decode_b{request.param}.json.gz")
    ncu = RECORDED["batches"][request.param]
    return request.param, trace, ncu, compare(trace, ncu)


def test_the_trace_and_ncu_saw_the_same_kernels(batch):
    _, trace, ncu, result = batch
    kernels = _kernel_rows(trace)
    assert len(kernels) == len(ncu) > 800
    assert [_base_name(trace.name(int(k))) for k in kernels] == [k["name"] for k in ncu]
    assert result["kernel_names_differ"] == 0


def test_byte_models_match_the_dram_counters_on_dram_sized_ops(batch):
    size, _, _, result = batch
    large = [o for o in result["ops"] if o["bytes"] >= DRAM_SIZED]
    gemms = [o for o in large if o["family"] == "gemm"]
    # Every linear of the step: five per layer (q, kv, o, gate_up, down) and the LM head.
    assert len(gemms) == 5 * LAYERS + 1
    if int(size) >= 8:  # the KV cache read by attention passes 4 MiB from batch 8 (513 positions)
        assert sum(o["family"] == "attention" for o in large) == LAYERS
    off = [(o["op"], o["shapes"], round(o["bytes_ratio"], 3)) for o in large
           if abs(o["bytes_ratio"] - 1) > TOLERANCE]
    assert off == []


def test_servprof_reports_these_figures_and_none_above_the_peak(batch):
    # The comparison reads the detector's own functions; its analysis reports the same points.
    _, trace, _, result = batch
    points = {(p["op"], round(p["bytes"]), round(p["time_us"], 3)) for p in analyse(trace).kernels}
    for op in (o for o in result["ops"] if o["bytes"] >= DRAM_SIZED):
        assert (op["op"], round(op["bytes"]), round(op["time_us"], 3)) in points
    peak = DEVICES["h100-sxm"].memory_bandwidth_gbs
    assert max(o["servprof_gbs"] for o in result["ops"]) < peak


def test_ncu_times_each_kernel_longer_by_a_fixed_offset(batch):
    # Why GB/s against ncu's time is not the check: ncu replays each kernel alone and its
    # gpu__time_duration adds ~1.5-2.5 µs to every kernel, long or short, against the same kernel
    # back to back in the profiled step. servprof's time is the step's own.
    _, trace, ncu, _ = batch
    kernels = _kernel_rows(trace)
    extra_us = np.array([k["duration_ns"] for k in ncu]) / 1e3 - trace.dur[kernels]
    short = trace.dur[kernels] < 3
    long = trace.dur[kernels] >= 10
    assert 1.0 < np.median(extra_us[short]) < 3.0
    assert abs(np.median(extra_us[long]) - np.median(extra_us[short])) < 1.0
