"""Each detector finds the fault injected into the demo engine's recorded traces, with the
right magnitude (within 10%), and nothing of that kind in the clean run.

The fixtures are real torch.profiler traces of servprof.demo.engine on CPU, made by
bench/record_fixtures.py (see tests/fixtures/README.md); what was injected is stored
in each trace under `servprof_fixture`, so no expected number is written here.
"""

from __future__ import annotations

import numpy as np
import pytest
from _analyze_helpers import fixture, public_trace

from servprof.detect import run_detectors
from servprof.detect.analysis import analyse
from servprof.detect.idle_split import idle_split
from servprof.trace import load_trace

SCENARIOS = ("clean", "step_delay_20ms", "slow_tokenizer", "tokenize_on_loop_slow", "sync_per_step")


@pytest.fixture(scope="module")
def analyses():
    out = {}
    for name in SCENARIOS:
        trace = load_trace(fixture(name))
        out[name] = (trace, analyse(trace), trace.metadata[0]["servprof_fixture"])
    return out


def kinds(analysis, kind):
    return [f for f in analysis.findings if f.kind == kind]


def test_clean_run_has_no_stall_and_no_gap(analyses):
    _, analysis, knobs = analyses["clean"]
    assert knobs["knobs"] == {}
    assert kinds(analysis, "decode_gap") == []
    assert kinds(analysis, "tokenization_stall") == []
    assert analysis.summary["steps"]["by_kind"]["decode"] >= 5


def test_step_delay_found_as_decode_gaps_of_the_injected_size(analyses):
    trace, analysis, meta = analyses["step_delay_20ms"]
    injected_ms = meta["knobs"]["step_delay_ms"]
    gaps = kinds(analysis, "decode_gap")
    assert len(gaps) == 1
    finding = gaps[0]
    decode_steps = analysis.summary["steps"]["by_kind"]["decode"]
    # The delay runs before every decode step but the first of a run, so nearly all are preceded by one.
    assert finding.evidence["gaps"] >= decode_steps - 2
    assert finding.evidence["where"] == "between_steps"
    assert abs(finding.evidence["median_gap_ms"] - injected_ms) <= 0.10 * injected_ms
    assert abs(finding.evidence["mean_gap_ms"] - injected_ms) <= 0.10 * injected_ms
    # A busy-wait in plain Python: no profiled op covers it.
    assert finding.evidence["cause"] == "untraced_host_time"
    assert finding.severity == "critical"
    assert set(finding.request_ids) == set(meta["prompt_tokens"])
    assert kinds(analysis, "tokenization_stall") == []


def test_slow_tokenizer_found_with_the_injected_time_per_request(analyses):
    _, analysis, meta = analyses["slow_tokenizer"]
    per_token_ms = meta["knobs"]["slow_tokenizer_us_per_token"] / 1000.0
    stalls = {f.request_ids[0]: f for f in kinds(analysis, "tokenization_stall")}
    assert set(stalls) == set(meta["prompt_tokens"])
    for rid, tokens in meta["prompt_tokens"].items():
        injected = tokens * per_token_ms
        measured = stalls[rid].evidence["tokenize_ms"]
        assert abs(measured - injected) <= 0.10 * injected, (rid, measured, injected)
        assert stalls[rid].evidence["on_event_loop"] is False  # a worker thread in this scenario
        assert stalls[rid].evidence["to_first_model_step_ms"] >= measured
    # No gap between steps. The one stall inside a step is the recording host's preemption
    # documented in tests/fixtures/README.md: nothing ran in the process meanwhile.
    for gap in kinds(analysis, "decode_gap"):
        assert gap.evidence["where"] == "inside_step" and gap.evidence["cause"] == "untraced_host_time"


def test_tokenize_on_event_loop_is_named_and_its_harm_measured(analyses):
    _, analysis, meta = analyses["tokenize_on_loop_slow"]
    per_token_ms = meta["knobs"]["slow_tokenizer_us_per_token"] / 1000.0
    stalls = kinds(analysis, "tokenization_stall")
    assert {f.request_ids[0] for f in stalls} == set(meta["prompt_tokens"])
    for f in stalls:
        assert f.evidence["on_event_loop"] is True
        assert "event loop" in f.title
        injected = meta["prompt_tokens"][f.request_ids[0]] * per_token_ms
        # Wall time includes waiting for the GIL while the engine ran: never less than the work.
        assert f.evidence["tokenize_ms"] >= 0.95 * injected
    # Requests arrived while others decoded: their tokenization held the GIL and slowed those steps.
    harmed = [f for f in stalls if f.evidence["delayed_steps"] > 0]
    assert harmed
    for f in harmed:
        assert f.evidence["delayed_request_ids"] and f.evidence["delayed_step_ms"] > 0
        assert f.cost_ms == pytest.approx(f.evidence["tokenize_ms"] + f.evidence["delayed_step_ms"], rel=1e-3)


def test_sync_per_step_on_cpu_adds_no_gap(analyses):
    # Without a device the host's read of the sampled tokens waits for nothing.
    _, analysis, meta = analyses["sync_per_step"]
    assert meta["knobs"] == {"sync_per_step": True}
    assert kinds(analysis, "decode_gap") == []


def test_run_detectors_matches_the_contract(analyses):
    trace, _, _ = analyses["step_delay_20ms"]
    findings = run_detectors(trace, requests=[], device=None)
    assert [f.cost_ms for f in findings] == sorted((f.cost_ms for f in findings), reverse=True)
    for f in findings:
        d = f.to_dict()
        assert set(d) == {"kind", "severity", "cost_ms", "start_us", "end_us", "request_ids", "sampled_request_ids",
                          "title", "evidence", "fix"}
        assert d["kind"] in ("tokenization_stall", "decode_gap", "bandwidth_bound_decode")
        assert d["severity"] in ("info", "warning", "critical")
        assert d["end_us"] >= d["start_us"]


def test_session_requests_name_findings_in_traces_without_phase_markers():
    trace = load_trace(public_trace("sglang_qwen3_8b_decode_bs32_mi300x.json.gz"))
    (gap,) = [f for f in run_detectors(trace, requests=[{"request_id": "s1"}, {"request_id": "s2"}])
              if f.kind == "decode_gap"]
    assert gap.request_ids == ["s1", "s2"] and "session records" in gap.evidence["request_ids_from"]
    # Where phase markers name the requests, the session's list does not replace them.
    marked = load_trace(fixture("step_delay_20ms"))
    (gap,) = [f for f in run_detectors(marked, requests=[{"request_id": "other"}]) if f.kind == "decode_gap"]
    assert "other" not in gap.request_ids and "request_ids_from" not in gap.evidence


def test_hta_idle_split_reference_on_resnet():
    trace = load_trace(public_trace("resnet_ddp_training_v100.json.gz"))
    (stream,) = idle_split(trace)
    # Holistic Trace Analysis 0.5.0's figures on this trace (tests/fixtures/public/NOTICE.md).
    assert stream.stream == 7
    assert (stream.host_wait_us, stream.host_wait_gaps) == (1709.0, 90)
    assert (stream.kernel_wait_us, stream.kernel_wait_gaps) == (8404.0, 4785)
    assert stream.other_gaps == 0


def test_sglang_step_blocked_in_a_device_copy_is_explained():
    analysis = analyse(load_trace(public_trace("sglang_qwen3_8b_decode_bs32_mi300x.json.gz")))
    (gap,) = kinds(analysis, "decode_gap")
    assert gap.evidence["cause"] == "synchronize"
    assert gap.evidence["where"] == "inside_step"
    worst = gap.evidence["worst_gaps"][0]
    assert "hipMemcpyWithStream" in worst["sync_calls"]
    # The device sat idle for most of the step while the host waited in the copy.
    step_ms = analysis.steps[0].dur_us / 1000
    assert gap.cost_ms > 0.9 * step_ms
    assert analysis.summary["bandwidth"]["device"]["name"] == "AMD Instinct MI300X"


@pytest.mark.parametrize("name", ["vllm_decode_bs32_fullgraph_mi300x.json.gz",
                                  "vllm_prefill_decode_piecewise_mi300x.json.gz"])
def test_vllm_graph_replays_are_explained_not_crashed(name):
    analysis = analyse(load_trace(public_trace(name)))
    (step,) = analysis.steps
    assert step.source == "vllm"
    replay = analysis.summary["bandwidth"]["graph_replay"]
    assert replay["kernels"] > 300 and replay["launches"] >= 1
    assert "no shapes" in replay["note"]
    assert analysis.summary["bandwidth"]["device"]["name"] == "AMD Instinct MI300X"
    assert kinds(analysis, "decode_gap") == []  # the GPU stays busy through the replays


def test_vllm_step_annotation_is_parsed():
    analysis = analyse(load_trace(public_trace("vllm_decode_bs32_fullgraph_mi300x.json.gz")))
    step = analysis.steps[0]
    assert step.kind == "decode" and step.batch == 32
    assert step.attention == {"decode_sum_q": 32, "decode_sum_kv": 55086}
    mixed = analyse(load_trace(public_trace("vllm_prefill_decode_piecewise_mi300x.json.gz"))).steps[0]
    assert mixed.kind == "mixed" and mixed.batch == 9 + 37


def test_profiler_steps_are_used_when_nothing_else_marks_steps():
    analysis = analyse(load_trace(public_trace("resnet_ddp_training_v100.json.gz")))
    assert [s.source for s in analysis.steps] == ["profiler_step"] * 5
    starts = np.array([s.start_us for s in analysis.steps])
    assert (np.diff(starts) > 0).all()
