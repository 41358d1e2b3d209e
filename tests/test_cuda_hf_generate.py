"""A user's own trace of transformers' ``generate()`` on a GPU, as torch.profiler records it by
default (CPU and CUDA activity, no shapes, no stack, no servprof inside): a 16-layer bf16 Llama
on an H100, 6 new tokens (tests/fixtures/README.md says how it was made). What must hold on it
is read from the raw file here, independently of servprof's code."""

from __future__ import annotations

import gzip

import numpy as np
import orjson
import pytest
from _analyze_helpers import FIXTURES

from servprof.detect.analysis import analyse
from servprof.trace import load_trace

FIXTURE = FIXTURES / "cuda_hf_generate_h100.json.gz"
CUDNN = "aten::_cudnn_attention_forward"


@pytest.fixture(scope="module")
def raw() -> list[dict]:
    return orjson.loads(gzip.decompress(FIXTURE.read_bytes()))["traceEvents"]


@pytest.fixture(scope="module")
def analysis():
    return analyse(load_trace(FIXTURE))


def test_each_forward_is_a_step_timed_on_the_device(raw, analysis):
    forwards = [e for e in raw if e.get("name") == "aten::embedding"]  # one lookup per forward
    steps = analysis.summary["steps"]
    assert steps["count"] == len(forwards) == 6
    utilisation = analysis.summary["utilisation"]
    assert utilisation["mode"] == "device"
    for row in utilisation["steps"]:
        assert 0 <= row["busy_ms"] <= row["step_ms"] and 0 <= row["idle_inside_ms"] <= row["step_ms"]


def test_cudnn_set_up_for_new_key_lengths_is_the_named_cause_with_its_fix(raw, analysis):
    calls = sorted((e["ts"], e["dur"]) for e in raw if e.get("name") == CUDNN)
    slow = [(ts, ts + dur) for ts, dur in calls if dur >= 10_000]
    # The warm-up generate() before the trace saw the first key lengths: only the 2 new ones are slow.
    assert len(calls) == 6 * 16 and len(slow) == 2
    assert np.median([dur for _, dur in calls]) < 1_000
    waits = [f for f in analysis.findings if f.kind == "decode_gap" and f.evidence["cause"] == "host_ops"]
    (wait,) = waits
    assert wait.evidence["shape_setup_op"] == CUDNN
    assert "sdpa_kernel" in wait.fix and "record_shapes=True" in wait.fix
    assert "Move that op out of the step" not in wait.fix
    # Its gaps are those two calls' time (each from the kernel before the call to the kernel after
    # it): the second is in the last step, which is as slow as an earlier one, so not cut short.
    gaps = wait.evidence["worst_gaps"]
    for a, b in slow:
        assert any(min(b, g["end_us"]) - max(a, g["start_us"]) >= 0.95 * (g["end_us"] - g["start_us"]) for g in gaps)
    assert wait.evidence["gaps"] == 2
    assert wait.cost_ms == pytest.approx(sum(g["idle_us"] for g in gaps) / 1000)
    assert sum(b - a for a, b in slow) / 1000 <= wait.cost_ms <= 1.05 * sum(b - a for a, b in slow) / 1000
    # No shapes: no shape_setup finding, and the op is listed as one that could not be judged.
    assert not [f for f in analysis.findings if f.kind == "shape_setup"]
    assert CUDNN in analysis.summary["shape_setup"]["unshaped_ops"]


def test_the_rest_of_the_idle_is_the_host_launching_kernels(analysis):
    (launch,) = [f for f in analysis.findings if f.kind == "decode_gap" and f.evidence["cause"] == "launch_bound"]
    idle = sum(row["idle_inside_ms"] for row in analysis.summary["utilisation"]["steps"])
    cudnn = next(f for f in analysis.findings if f.evidence.get("cause") == "host_ops")
    # Every millisecond of device idle inside the steps goes to one cause or the other, none twice.
    assert launch.cost_ms + cudnn.cost_ms == pytest.approx(idle, rel=0.02)
    assert "CUDA graphs" in launch.fix
