"""The detectors on real CUDA traces of the demo engine (an H100, bf16; tests/fixtures/README.md):
device timestamps, kernels with their launches, phase ranges mirrored on the device timeline.

Recorded on a lent GPU machine with the project's own code (`bench/record_fixtures.py --device cuda
--size tiny`); what was injected is stored in each trace under `servprof_fixture`, so no expected
number is written here. These run on CPU-only CI: only the recording needed the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from _analyze_helpers import FIXTURES

from servprof.detect.analysis import analyse
from servprof.trace import load_trace

SCENARIOS = ("clean", "step_delay_20ms", "sync_per_step")


@pytest.fixture(scope="module")
def analyses():
    out = {}
    for name in SCENARIOS:
        trace = load_trace(FIXTURES / f"cuda_tiny_{name}.json.gz")
        out[name] = (trace, analyse(trace), trace.metadata[0]["servprof_fixture"])
    return out


def gaps(analysis, where=None, cause=None):
    return [f for f in analysis.findings if f.kind == "decode_gap"
            and (where is None or f.evidence["where"] == where) and (cause is None or f.evidence["cause"] == cause)]


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_phase_mirrored_on_the_device_timeline_counts_once(analyses, name):
    # With CUDA activity each servprof phase range is also written as a gpu_user_annotation on the
    # stream it launched onto; counted as a step of its own, every request had two prefills.
    trace, analysis, meta = analyses[name]
    mirrored = trace.mask_category("gpu_user_annotation") & trace.mask_name(lambda s: s.startswith("servprof:"))
    assert mirrored.any()
    requests = meta["prompt_tokens"]
    assert analysis.summary["steps"]["by_kind"]["prefill"] == len(requests)
    # Three requests of max_tokens each, batched: the first token comes from the prefill.
    assert analysis.summary["steps"]["by_kind"]["decode"] <= len(requests) * (meta["max_tokens"] - 1)
    for rid in requests:
        assert sum(s.kind == "prefill" and rid in s.request_ids for s in analysis.steps) == 1
    # Each step is a host range: none comes from the device's mirror of it.
    assert not trace.mask_category("gpu_user_annotation")[[s.row for s in analysis.steps]].any()


def test_every_kernel_has_its_launch_and_steps_are_timed_on_the_device(analyses):
    trace, analysis, _ = analyses["clean"]
    kernels = np.flatnonzero(trace.device_mask())
    assert kernels.size > 1000
    assert (trace.launch_row_for(kernels) >= 0).all()
    assert analysis.summary["decode_gap"]["mode"] == "device"
    assert all(step["on"] == "device" for step in analysis.summary["utilisation"]["steps"])


def test_step_delay_found_on_device_timestamps_within_ten_percent(analyses):
    _, analysis, meta = analyses["step_delay_20ms"]
    injected_ms = meta["knobs"]["step_delay_ms"]
    (finding,) = gaps(analysis, where="between_steps")
    decode_steps = analysis.summary["steps"]["by_kind"]["decode"]
    assert finding.evidence["gaps"] >= decode_steps - 2
    assert abs(finding.evidence["mean_gap_ms"] - injected_ms) <= 0.10 * injected_ms
    assert abs(finding.evidence["median_gap_ms"] - injected_ms) <= 0.10 * injected_ms
    assert finding.evidence["cause"] == "untraced_host_time"  # a sleep: no profiled op covers it
    assert set(finding.request_ids) == set(meta["prompt_tokens"])
    # The clean run has no such gap between its steps.
    assert gaps(analyses["clean"][1], where="between_steps") == []


def test_the_slow_host_op_these_steps_wait_on_is_named(analyses):
    # What is true of this engine on this GPU: each step's attention gets a new key length, and
    # cuDNN's attention builds a plan per new shape on the host (tens of ms) while the device idles.
    _, analysis, _ = analyses["clean"]
    inside = gaps(analysis, where="inside_step")
    assert inside and inside[0].severity == "critical"
    assert "aten::_cudnn_attention_forward" in inside[0].title
    assert inside[0].fix


def test_a_sync_per_step_is_named_but_not_blamed_when_the_device_waits_for_the_host(analyses):
    # sync_per_step reads every step's tokens on the host right away. Here the device is busy ~0.3%
    # of each step (the host is the bottleneck), so the read finds the work done: it is counted per
    # step, and its synchronize gaps stay under the bar instead of being blamed for the idle.
    _, analysis, meta = analyses["sync_per_step"]
    assert meta["knobs"] == {"sync_per_step": True}
    decode = analysis.summary["steps"]["by_kind"]["decode"]
    reads = analysis.summary["decode_gap"]["host_reads"]
    assert reads["steps_with_reads"] == reads["steps"] == decode
    assert gaps(analysis, cause="synchronize") == []
    busy = [a for a in analysis.summary["utilisation"]["aggregates"] if a["kind"] == "decode"]
    assert busy and busy[0]["busy_pct"] < 5
