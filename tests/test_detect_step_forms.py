"""Every form of model step servprof reads, on small synthetic Kineto traces (tests/_kineto_builder.py)
with known answers: the source named per step, the kind, and one plain sentence when there is none."""

from __future__ import annotations

from pathlib import Path

import pytest
from _kineto_builder import KinetoTrace, eager_step

from servprof.detect.analysis import analyse
from servprof.trace import load_trace


def _analyse(trace: KinetoTrace, tmp_path: Path):
    return analyse(load_trace(trace.write(tmp_path / "t.json")))


@pytest.mark.parametrize(("name", "kind", "batch"), [
    ("execute_32_context_0(sq0sk0sqsq0sqsk0)_generation_32(sq32sk55086sqsq32sqsk55086)", "decode", 32),
    ("execute_context_0(0)_generation_16(16)", "decode", 16),
    ("execute_context_2(900)_generation_0(0)", "prefill", 2),
    ("execute_context_1(7)_generation_3(3)", "mixed", 4),
])
def test_vllm_annotations_in_both_forms(tmp_path: Path, name: str, kind: str, batch: int):
    trace = KinetoTrace()
    for k in range(3):
        eager_step(trace, k * 1000.0, kernels=5, annotation=name)
    steps = _analyse(trace, tmp_path).steps
    assert [(s.source, s.kind, s.batch) for s in steps] == [("vllm", kind, batch)] * 3


def test_vllm_v1_execute_model_frames_without_annotation(tmp_path: Path):
    # vLLM V1 recorded with with_stack and no execute_* annotation: the worker's Python frames.
    trace = KinetoTrace()
    for k in range(4):
        t = k * 2000.0
        trace.frame("vllm/v1/worker/gpu_worker.py(450): execute_model", t, 900)
        trace.frame("vllm/v1/worker/gpu_model_runner.py(2907): execute_model", t + 5, 880)
        trace.frame("torch/nn/modules/module.py(1779): _call_impl", t + 20, 800)
        eager_step(trace, t + 30, kernels=8)
    analysis = _analyse(trace, tmp_path)
    assert [(s.source, s.kind) for s in analysis.steps] == [("vllm_frames", "step")] * 4
    assert all(s.label.endswith("gpu_model_runner.py(2907): execute_model") for s in analysis.steps)
    assert analysis.summary["utilisation"]["sources"] == {"0": "vLLM execute_model frames"}


@pytest.mark.parametrize("wrapped", [False, True])
def test_sglang_steps_are_labelled_sglang(tmp_path: Path, wrapped: bool):
    trace = KinetoTrace()
    for k, label in enumerate(("step[EXTEND bs=3 toks=900]", "step[DECODE bs=3]", "step[DECODE bs=3]")):
        t = k * 3000.0
        if wrapped:  # SGLang also writes a vLLM-style range around each step
            trace.annotation("execute_3_context_0(sq0sk0sqsq0sqsk0)_generation_3(sq3sk120sqsq3sqsk120)", t, 1500)
        trace.annotation(label, t + 100, 1000)
        eager_step(trace, t + 150, kernels=6)
    steps = _analyse(trace, tmp_path).steps
    assert [(s.source, s.kind, s.batch) for s in steps] == [("sglang", "prefill", 3), ("sglang", "decode", 3),
                                                             ("sglang", "decode", 3)]
    if wrapped:  # the whole scheduler step, with the sums from the outer range
        assert steps[1].start_us == 3000.0 and steps[1].end_us == 4500.0
        assert steps[1].attention == {"decode_sum_q": 3, "decode_sum_kv": 120}


def test_servprof_markers_win_and_automatic_ones_are_named(tmp_path: Path):
    auto = KinetoTrace()
    for k in range(3):
        auto.host(f"servprof:auto.decode_step|r{k}", k * 1000.0, 60)
        eager_step(auto, k * 1000.0, kernels=4)
    assert {s.source for s in _analyse(auto, tmp_path).steps} == {"servprof_auto"}
    both = KinetoTrace()
    for k in range(3):
        both.host("servprof:decode_step|a", k * 1000.0, 60)
        both.host("servprof:auto.decode_step|a", k * 1000.0 + 1, 58)
        both.annotation(f"ProfilerStep#{k}", k * 1000.0, 900)
        eager_step(both, k * 1000.0, kernels=4)
    steps = analyse(load_trace(both.write(tmp_path / "b.json"))).steps
    assert [(s.source, s.kind) for s in steps] == [("servprof", "decode")] * 3


def test_profiler_steps_and_training(tmp_path: Path):
    trace = KinetoTrace()
    for k in range(3):
        t = k * 4000.0
        trace.annotation(f"ProfilerStep#{k}", t, 3000)
        eager_step(trace, t + 10, kernels=10)
        trace.host("autograd::engine::evaluate_function: MmBackward0", t + 1500, 400, tid=2)
    analysis = _analyse(trace, tmp_path)
    assert [(s.source, s.kind) for s in analysis.steps] == [("profiler_step", "train")] * 3
    # Training steps are never called decode steps.
    assert analysis.summary["utilisation"]["aggregates"][0]["kind"] == "train"


def test_outermost_model_forward_is_the_step(tmp_path: Path):
    """HF generate() with_stack/with_modules, no markers: each outermost LlamaForCausalLM call is a
    step (not the sampler module called beside it, nor the modules inside), decode vs prefill from
    the embedding's input ids [batch, seq]; a ProfilerStep holding the whole generate() is not the step."""
    trace = KinetoTrace()
    trace.annotation("ProfilerStep#0", 0.0, 20000)
    for k in range(5):
        t = 100 + k * 3000.0
        trace.frame("nn.Module: LlamaForCausalLM_0", t, 2000)
        trace.frame("nn.Module: LlamaModel_0", t + 5, 1900)
        trace.frame("nn.Module: Embedding_0", t + 10, 50)
        seq = 12 if k == 0 else 1
        trace.host("aten::embedding", t + 12, 40, args={"Input Dims": [[32000, 64], [1, seq]]})
        eager_step(trace, t + 100, kernels=6)
        trace.frame("nn.Module: Sampler_0", t + 2100, 100)  # beside the model, also outermost
    analysis = _analyse(trace, tmp_path)
    assert [(s.source, s.kind) for s in analysis.steps] == [("forward", "prefill")] + [("forward", "decode")] * 4
    assert all(s.label == "nn.Module: LlamaForCausalLM_0" for s in analysis.steps)


def test_outermost_forward_frame_without_module_frames(tmp_path: Path):
    """with_stack but not with_modules: the outermost Python `forward` frame on the thread."""
    trace = KinetoTrace()
    for k in range(4):
        t = k * 3000.0
        if k == 0:  # generate()'s loop frame, around the first forward only (it began before the profiler)
            trace.frame("transformers/generation/utils.py(2400): _sample", t, 2900)
        trace.frame("torch/nn/modules/module.py(1779): _call_impl", t + 10, 2000)
        trace.frame("transformers/models/llama/modeling_llama.py(1180): forward", t + 20, 1900)
        trace.frame("transformers/models/llama/modeling_llama.py(900): forward", t + 30, 1800)
        eager_step(trace, t + 100, kernels=5)
    steps = _analyse(trace, tmp_path).steps
    assert [(s.source, s.label) for s in steps] == \
        [("forward", "transformers/models/llama/modeling_llama.py(1180): forward")] * 4


def test_no_step_says_what_to_add(tmp_path: Path):
    trace = KinetoTrace()
    eager_step(trace, 0.0, kernels=5)
    analysis = _analyse(trace, tmp_path)
    assert analysis.steps == []
    missing = {m["what"]: m["message"] for m in analysis.summary["missing"]}
    assert "servprof.phase(\"decode_step\")" in missing["model steps"] and "with_stack" in missing["model steps"]
    # And no tokenization either: how to get it.
    assert "servprof.phase(\"tokenize\")" in missing["tokenization"]
    assert analysis.summary["utilisation"]["steps"] == []


def test_async_steps_are_timed_on_the_device(tmp_path: Path):
    """Asynchronous scheduling: each host range launches its work in 100 µs and returns; the
    device runs it for ~2 ms. Step time, utilisation and gaps come from the device timeline."""
    trace = KinetoTrace()
    t_dev = 500.0
    for k in range(5):
        t = k * 400.0  # the host runs ahead of the device
        trace.annotation(f"execute_context_0(0)_generation_8(8)#{k}", t, 100)
        for i in range(10):
            trace.launch(t + i * 5, t_dev + i * 200, 190)
        t_dev += 10 * 200 + 300  # 300 µs idle between device steps
    analysis = _analyse(trace, tmp_path)
    assert len(analysis.steps) == 5
    assert analysis.summary["steps"]["median_step_ms"] == pytest.approx(1.99, abs=1e-6)
    rows = analysis.summary["utilisation"]["steps"]
    # Each step's last kernel ends 10 µs after the previous starts + 190: 310 µs before the next step.
    assert [r["idle_between_ms"] for r in rows] == [0.0] + [pytest.approx(0.31)] * 4
    assert all(r["idle_inside_ms"] == pytest.approx(9 * 0.01) for r in rows)


def _unmarked_forward(trace: KinetoTrace, t: float, lookups: int = 1, ops: int = 80) -> None:
    """One forward as torch.profiler records it with no marker, stack or schedule: its token
    (and position) lookups back to back, then ``ops`` host ops each launching a kernel."""
    for k in range(lookups):
        trace.host("aten::embedding", t + k * 4, 3)
    for i in range(ops):
        begin = t + 10 + i * 5.0
        trace.host("aten::linear", begin, 4)
        trace.launch(begin + 1, begin + 20, 4)


@pytest.mark.parametrize("lookups", [1, 2])
def test_a_loop_with_no_marker_is_read_from_each_forwards_first_lookup(tmp_path: Path, lookups: int):
    """generate() profiled with no schedule, with_stack or annotation: each forward opens with its
    token-embedding lookup (GPT-2 looks positions up right after: one forward, not two steps)."""
    trace = KinetoTrace()
    for k in range(5):
        _unmarked_forward(trace, k * 1000.0, lookups)
    analysis = _analyse(trace, tmp_path)
    assert [(s.source, s.kind) for s in analysis.steps] == [("embedding", "step")] * 5
    assert [s.start_us for s in analysis.steps] == [k * 1000.0 for k in range(5)]
    assert [s.end_us for s in analysis.steps[:4]] == [k * 1000.0 for k in range(1, 5)]  # to the next forward
    assert analysis.summary["utilisation"]["sources"] == {"0": "each forward's first aten::embedding (no step marked)"}


def test_the_last_unmarked_step_ends_with_its_work_not_the_threads_later_work(tmp_path: Path):
    trace = KinetoTrace()
    for k in range(4):
        _unmarked_forward(trace, k * 1000.0)
    trace.host("aten::copy_", 3500.0, 50_000)  # the thread goes on to something else
    last = _analyse(trace, tmp_path).steps[-1]
    assert last.start_us == 3000.0 and last.end_us == 3000.0 + 2 * 1000.0


def test_a_profiler_step_around_a_whole_unmarked_generate_is_not_the_step(tmp_path: Path):
    trace = KinetoTrace()
    trace.annotation("ProfilerStep#0", 0.0, 6000)
    for k in range(5):
        _unmarked_forward(trace, 100 + k * 1000.0)
    assert [s.source for s in _analyse(trace, tmp_path).steps] == ["embedding"] * 5


def test_gradient_accumulation_keeps_the_profiler_step(tmp_path: Path):
    """A training step holding several forwards (micro-batches): the step is the profiler's, not
    each forward (nor each forward re-run by activation checkpointing)."""
    trace = KinetoTrace()
    for k in range(3):
        t = k * 10_000.0
        trace.annotation(f"ProfilerStep#{k}", t, 9000)
        for micro in range(3):
            trace.frame("nn.Module: LlamaForCausalLM_0", t + 100 + micro * 2500, 1000)
            eager_step(trace, t + 110 + micro * 2500, kernels=4)
            trace.host("autograd::engine::evaluate_function: MmBackward0", t + 1200 + micro * 2500, 400, tid=2)
    assert [(s.source, s.kind) for s in _analyse(trace, tmp_path).steps] == [("profiler_step", "train")] * 3


def test_a_training_loop_with_no_marker_is_read_from_its_dataloader_fetches(tmp_path: Path):
    trace = KinetoTrace()
    for k in range(4):
        t = k * 5000.0
        trace.host("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", t, 1000)
        trace.host("aten::stack", t + 100, 500)  # (collate, inside the fetch)
        _unmarked_forward(trace, t + 1100)
        trace.host("autograd::engine::evaluate_function: MmBackward0", t + 2000, 400, tid=2)
        trace.host("Optimizer.step#SGD.step", t + 3000, 500)
    steps = _analyse(trace, tmp_path).steps
    assert [(s.source, s.kind) for s in steps] == [("data_loader", "train")] * 4
    assert [s.start_us for s in steps] == [k * 5000.0 for k in range(4)]


def test_steps_served_on_several_threads_at_once_keep_their_own_device_work(tmp_path: Path):
    """A thread pool serving two requests at once (FastAPI's `def` endpoints, generate() in each):
    each step's device span is the work its own thread launched, never the other thread's
    launched while both steps were open."""
    trace = KinetoTrace()
    own: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for k in range(3):
        for tid, offset, stream in ((1, 0.0, 7), (2, 500.0, 8)):
            t = k * 1000.0 + offset
            trace.host(f"servprof:decode_step|r{tid}", t, 900, tid=tid)
            for i in range(8):  # a launch every 100 µs across the step, each kernel 30 µs later
                trace.launch(t + 10 + 100 * i, t + 40 + 100 * i, 20.0, tid=tid, stream=stream)
            own[(tid, k)] = [(t + 40, t + 40 + 700 + 20)]
    steps = _analyse(trace, tmp_path).steps
    assert len(steps) == 6
    for step in steps:
        k = int(step.start_us // 1000)
        (start, end), = own[(step.tid, k)]
        assert (step.device_start_us, step.device_end_us) == (start, end), (step.tid, k)
