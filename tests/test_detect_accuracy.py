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


def gaps_of(analysis, cause=None):
    """decode_gap findings other than the per-step host read (named at info on CPU traces)."""
    return [f for f in kinds(analysis, "decode_gap") if f.evidence["cause"] != "host_read_per_step"
            and (cause is None or f.evidence["cause"] == cause)]


def test_clean_run_has_no_stall_and_no_gap(analyses):
    _, analysis, knobs = analyses["clean"]
    assert knobs["knobs"] == {}
    assert gaps_of(analysis) == []
    assert kinds(analysis, "tokenization_stall") == []
    assert analysis.summary["steps"]["by_kind"]["decode"] >= 5
    # The clean engine also reads every step's tokens on the host (one step behind): named, at info only.
    assert all(f.severity == "info" for f in kinds(analysis, "decode_gap"))


def test_step_delay_found_as_decode_gaps_of_the_injected_size(analyses):
    trace, analysis, meta = analyses["step_delay_20ms"]
    injected_ms = meta["knobs"]["step_delay_ms"]
    gaps = gaps_of(analysis)
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
    # documented in tests/fixtures/README.md: nothing ran in the process meanwhile, and once
    # (not the loop's habit), so it is reported at info only.
    (stall,) = gaps_of(analysis)
    assert stall.evidence["where"] == "inside_step" and stall.evidence["cause"] == "untraced_host_time"
    assert stall.severity == "info" and stall.evidence["steps_affected_share"] < 0.5


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


def test_sync_per_step_on_cpu_is_named_at_the_cost_it_has_here(analyses):
    # The engine reads each step's sampled tokens on the host (.tolist()) right after the step. On a
    # CPU trace the read waits for nothing: no gap. It is still the loop's per-step host read, named
    # with its count per step and what it costs on a GPU, at the severity its cost here earns (info).
    _, analysis, meta = analyses["sync_per_step"]
    assert meta["knobs"] == {"sync_per_step": True}
    assert gaps_of(analysis) == []
    (read,) = [f for f in kinds(analysis, "decode_gap") if f.evidence["cause"] == "host_read_per_step"]
    decode_steps = analysis.summary["steps"]["by_kind"]["decode"]
    assert read.evidence["steps"] == decode_steps and read.evidence["steps_with_reads"] == decode_steps
    assert 1.0 <= read.evidence["reads_per_step"] <= 1.5
    assert read.evidence["calls"] == {".tolist() / .numpy()": read.evidence["reads"]}
    assert read.severity == "info" and read.evidence["share_of_step_time"] < 0.01
    assert "device sync per step" in read.title and ".item()" in read.fix


def test_run_detectors_matches_the_contract(analyses):
    trace, _, _ = analyses["step_delay_20ms"]
    findings = run_detectors(trace, requests=[], device=None)
    assert [f.cost_ms for f in findings] == sorted((f.cost_ms for f in findings), reverse=True)
    for f in findings:
        d = f.to_dict()
        assert set(d) == {"kind", "severity", "cost_ms", "start_us", "end_us", "request_ids", "sampled_request_ids",
                          "title", "evidence", "fix"}
        assert d["fix"]
        assert d["kind"] in ("tokenization_stall", "decode_gap", "bandwidth_bound_decode")
        assert d["severity"] in ("info", "warning", "critical")
        assert d["end_us"] >= d["start_us"]


def test_session_requests_name_findings_in_traces_without_phase_markers():
    trace = load_trace(public_trace("sglang_qwen3_8b_decode_bs32_mi300x.json.gz"))
    (gap,) = [f for f in run_detectors(trace, requests=[{"request_id": "s1"}, {"request_id": "s2"}])
              if f.kind == "decode_gap" and f.severity != "info"]
    assert gap.request_ids == ["s1", "s2"] and "session records" in gap.evidence["request_ids_from"]
    # Where phase markers name the requests, the session's list does not replace them.
    marked = load_trace(fixture("step_delay_20ms"))
    (gap,) = [f for f in run_detectors(marked, requests=[{"request_id": "other"}]) if f.kind == "decode_gap"
              and f.evidence["cause"] != "host_read_per_step"]
    assert "other" not in gap.request_ids and "request_ids_from" not in gap.evidence


def test_hta_idle_split_reference_on_resnet():
    trace = load_trace(public_trace("resnet_ddp_training_v100.json.gz"))
    (stream,) = idle_split(trace)
    # Holistic Trace Analysis 0.5.0's figures on this trace (tests/fixtures/public/NOTICE.md).
    assert stream.stream == 7
    assert (stream.host_wait_us, stream.host_wait_gaps) == (1709.0, 90)
    assert (stream.kernel_wait_us, stream.kernel_wait_gaps) == (8404.0, 4785)
    assert stream.other_gaps == 0


def test_sglang_step_held_back_by_a_stream_wait_is_explained():
    """The SGLang decode step's work was queued within 40 µs of the device going idle, then held
    back 463 ms behind a hipStreamWaitEvent; the host meanwhile blocked in a hipMemcpyWithStream
    queued behind it. The device was not waiting for the host: the cause is the stream wait, and
    both calls are where and when the finding says, on the thread it names."""
    trace = load_trace(public_trace("sglang_qwen3_8b_decode_bs32_mi300x.json.gz"))
    analysis = analyse(trace)
    (step,) = analysis.steps
    assert (step.source, step.kind, step.batch) == ("sglang", "decode", 32)
    assert step.label == "step[DECODE bs=32]" and step.attention == {"decode_sum_q": 32, "decode_sum_kv": 32785}
    (gap,) = kinds(analysis, "decode_gap")
    assert gap.evidence["cause"] == "stream_wait" and gap.evidence["where"] == "inside_step"
    assert gap.severity == "critical" and gap.fix
    worst = gap.evidence["worst_gaps"][0]
    wait = worst["stream_wait"]
    row = int(np.flatnonzero((trace.ts == wait["ts"]) & (trace.tid == wait["thread"]))[0])
    # Enqueued before the held-back work was launched (the gap's first microseconds).
    assert trace.name(row) == wait["call"] == "hipStreamWaitEvent" and trace.ts[row] < worst["start_us"] + 100
    blocked = [f for f in worst["top_frames"] if f["class"] == "sync"]
    assert blocked and blocked[0]["name"] == "hipMemcpyWithStream"
    copy = np.flatnonzero(trace.mask_name(lambda s: s == "hipMemcpyWithStream") & (trace.tid == worst["thread"]))
    overlap = [min(trace.end[c], worst["end_us"]) - max(trace.ts[c], worst["start_us"]) for c in copy]
    assert max(overlap) >= 0.99 * (worst["end_us"] - worst["start_us"])  # blocked for the whole gap
    # The device sat idle for most of the step.
    assert gap.cost_ms > 0.9 * step.time_us / 1000
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
    # Backward ops run inside them: training steps, never called decode steps.
    assert [s.kind for s in analysis.steps] == ["train"] * 5
    starts = np.array([s.start_us for s in analysis.steps])
    assert (np.diff(starts) > 0).all()


def test_every_stall_and_gap_carries_a_fix_that_fits_it(analyses):
    _, on_loop, _ = analyses["tokenize_on_loop_slow"]
    for f in kinds(on_loop, "tokenization_stall"):
        assert "event loop" in f.fix and "run_sync" in f.fix
    _, worker, _ = analyses["slow_tokenizer"]
    for f in kinds(worker, "tokenization_stall"):
        assert f.fix and "event loop" not in f.fix
        # Slowing other requests' steps (the GIL) is critical only when it is tens of ms.
        assert f.severity == "warning" or f.cost_ms >= 20
    for _, analysis, _ in analyses.values():
        for f in kinds(analysis, "decode_gap") + kinds(analysis, "tokenization_stall"):
            assert f.fix, f.title
