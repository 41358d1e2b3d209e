"""A transformers Llama quantised with ``torch.ao``'s dynamic int8, traced the way users trace it.

- The model's own Python between its ops, traced without stacks, is not a stall of the decode loop
  (detect/stalled_steps.py): its linear layers fast, their Python the same, a third of each decode
  step is unrecorded, in hundreds of holes of a few µs between ops. Alone on its thread that is the
  interpreter running ``forward``, and the decode loop has no gap; beside another thread's
  generate() (two requests served at once) the same holes are also waits for the GIL, and the
  finding stays (concurrent_steps: the thread that held the GIL was in its own model steps).
- Its int8 weights are packed in objects whose shapes the profiler does not record: the bandwidth
  figures leave those layers out, and the report says so (detect/unmodelled_ops.py).

Real parts: a transformers Llama built from its config (random weights), quantised by torch, run
by ``generate()`` under the real profiler on the CPU with record_shapes, as users trace it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from servprof.detect.analysis import analyse
from servprof.detect.causes import GapExplainer
from servprof.detect.gap import CPU_MIN_GAP_US
from servprof.detect.host_classes import UNTRACED
from servprof.detect.host_stacks import HostStacks
from servprof.detect.steps import find_steps
from servprof.trace import load_trace
from servprof.trace.model import Trace

transformers = pytest.importorskip("transformers")

# (torch.ao's eager quantisation warns that it moves to torchao; users still call it.)
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]
PROMPT = torch.arange(3, 40).unsqueeze(0)
GENERATE = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False}


def _int8_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=8, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def _traced(tmp_path: Path, threads: int) -> Trace:
    model = _int8_llama()

    def generate() -> None:
        with torch.no_grad():
            model.generate(PROMPT, **GENERATE)

    generate()  # (warm-up, not traced)
    go = threading.Event()
    workers = [threading.Thread(target=lambda: (go.wait(), generate())) for _ in range(threads)]
    for worker in workers:
        worker.start()  # (before the profiler: the threads it records are those alive when it starts)
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, experimental_config=config) as prof:
        go.set()
        for worker in workers:
            worker.join()
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"int8_{threads}.json"
    prof.export_chrome_trace(str(path))
    return load_trace(path)


def _holes(trace: Trace) -> tuple[float, float, float]:
    """Over the decode steps: their time, its part in holes under CPU_MIN_GAP_US, and in longer ones."""
    steps = [s for s in find_steps(trace) if s.kind == "decode"]
    stacks = HostStacks(trace, int(trace.rank.min()))
    total = short = long = 0.0
    for step in steps:
        stack = stacks.thread(step.tid)
        inside = (stack.start >= step.start_us) & (stack.end <= step.end_us) & (stack.cls == UNTRACED)
        lengths = stack.end[inside] - stack.start[inside]
        total += step.dur_us
        short += float(lengths[lengths < CPU_MIN_GAP_US].sum())
        long += float(lengths[lengths >= CPU_MIN_GAP_US].sum())
    return total, short, long


def _beside_work(trace: Trace) -> float:
    """The share of decode steps whose short holes had another thread recording work for at least half
    as long meanwhile (busy_elsewhere: what a hole beside another thread's work is told by)."""
    steps = [s for s in find_steps(trace) if s.kind == "decode"]
    stacks = HostStacks(trace, int(trace.rank.min()))
    a, b = np.array([s.start_us for s in steps]), np.array([s.end_us for s in steps])
    tids = np.array([s.tid for s in steps], dtype=np.int64)
    short = np.array([float(stacks.thread(s.tid).short_holes(a[i:i + 1], b[i:i + 1], CPU_MIN_GAP_US)[0])
                      for i, s in enumerate(steps)])
    busy = GapExplainer(stacks).busy_elsewhere(a, b, tids)
    return float(np.mean(busy >= 0.5 * short)) if steps else 0.0


@pytest.fixture(scope="module")
def one_thread(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    return _traced(tmp_path_factory.mktemp("int8"), threads=1)


def test_the_models_python_between_its_ops_is_no_gap_of_the_decode_loop(one_thread: Trace) -> None:
    trace = one_thread
    total, short, long = _holes(trace)
    assert short >= 0.15 * total, (short, total)  # the trace shows what made the false finding
    analysis = analyse(trace)
    inside = [g for f in analysis.findings if f.kind == "decode_gap" and f.evidence.get("where") == "inside_step"
              for g in f.evidence["worst_gaps"]]
    # What a gap may hold is the thread's longer holes (a machine this busy takes the CPU away),
    # never the slivers between ops.
    assert sum(g["idle_us"] for g in inside) <= long + 1.0, (inside, long)


def test_beside_another_requests_thread_the_same_holes_are_waits_for_the_gil(tmp_path: Path) -> None:
    """(On an idle machine most of the waits are holes under 1 ms, 48% of each step on 2 cores: the
    rule counts them; a busy one stretches them past 1 ms.) The thread that held the GIL was in
    its own model steps: the two requests' model calls compete (concurrent_steps). (A machine
    busy enough to take both threads off the CPUs at once leaves time neither recorded anything
    for: that stall is untraced_host_time, which is true of it.)"""
    for attempt in range(3):
        # How much the two threads hold each other varies from run to run (21-48% of each decode
        # step unrecorded, measured): a trace whose steps left under 30% unrecorded is taken again,
        # so that what is tested is the judgement, not the threads' luck against the 25% bar.
        # (And taken again when the other thread was off the CPU too through most steps' holes -- a
        # machine too busy to run either, where short holes are no one's wait; seen only under load.)
        trace = _traced(tmp_path / str(attempt), threads=2)
        total, short, long = _holes(trace)
        if short + long >= 0.3 * total and _beside_work(trace) >= 0.5:
            break
    analysis = analyse(trace)
    # The holes count: as stalls inside the steps, reported, or listed under the bar where a loaded
    # machine spread them thin (one stalled step in 30, 2.9% of step time, under the suite's load).
    stalls = [g for f in analysis.findings if f.kind == "decode_gap" and f.evidence.get("where") == "inside_step"
              for g in f.evidence["worst_gaps"]]
    stalls += [g for g in analysis.summary["decode_gap"].get("unreported_gaps", []) if g["where"] == "inside_step"]
    assert stalls, ([f.title for f in analysis.findings], short + long, total)
    # (A small hole may fall while the other thread ran its Python between two of its model calls:
    # a wait for the GIL all the same, gil_contention.)
    assert {g["cause"] for g in stalls} <= {"concurrent_steps", "gil_contention", "untraced_host_time"}, stalls
    step_threads = {s.tid for s in find_steps(trace)}
    for gil in [g for g in stalls if g["cause"] == "concurrent_steps"]:
        assert gil["thread"] in step_threads and np.isfinite(gil["idle_us"])


def test_the_quantised_layers_left_out_of_the_bandwidth_figures_are_named(one_thread: Trace) -> None:
    analysis = analyse(one_thread)
    left_out = analysis.summary["bandwidth"]["unmodelled"]
    assert left_out["top_ops"] and "quantized::linear_dynamic" in [o["name"] for o in left_out["top_ops"][:2]], left_out
    assert left_out["share_of_op_time"] >= 0.25, left_out  # (the linears: most of a decode step's op time)
    (missing,) = [m for m in analysis.summary["missing"] if m["what"] == "op bytes"]
    assert "quantized::linear_dynamic" in missing["message"]
    for finding in (f for f in analysis.findings if f.kind == "bandwidth_bound_decode"):
        assert "quantized::linear_dynamic" in finding.fix and "last-level cache" not in finding.fix
