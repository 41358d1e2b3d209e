"""A wait for the GIL, traced with Python frames (with_stack=True), is named.

torch's Python tracer cannot see a thread waiting for the GIL: the wait lands in the own time of
the frame the thread was in, as if it ran Python. But only one thread runs Python at a time, so
the time a step's thread spends in Python frames while another thread is in Python too is a wait
for one of them (HostStacks.gil_wait), not the step's work. Without this, a prefill held 0.5 s by
another thread's pure Python read as a step busy all through (no finding); a trace without stacks
read it as "host time the profiler recorded nothing for".

Real parts: a transformers Llama built from its config (random weights), generate() on threads
under the real profiler (CPU, record_shapes, with_stack, every thread), beside a thread running
pure Python (a handler's CPU-bound work, say) or another request's generate().
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from servprof.detect.analysis import analyse
from servprof.detect.host_stacks import HostStacks
from servprof.detect.intervals import intersect, merge
from servprof.detect.steps import find_steps
from servprof.trace import load_trace
from servprof.trace.model import Trace

transformers = pytest.importorskip("transformers")
PROMPT = torch.arange(3, 40).unsqueeze(0)
GENERATE = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False}
BUSY_S = 0.4


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=8, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def crunch_numbers() -> None:
    """Pure Python for BUSY_S: no call the tracer records inside its loop, the GIL held throughout."""
    end, total = time.perf_counter() + BUSY_S, 0
    while time.perf_counter() < end:
        for i in range(20000):
            total += i * i


def _traced(tmp_path: Path, beside: str, with_stack: bool = True) -> Trace:
    model = _llama()

    def generate() -> None:
        with torch.no_grad():
            model.generate(PROMPT, **GENERATE)

    generate()  # (warm-up, not traced)
    go, stepping = threading.Event(), threading.Event()
    model.register_forward_pre_hook(lambda module, args: stepping.set())
    if beside == "python":
        # The Python begins once the model's first step has: each op releases the GIL and waits for
        # it back (a switch interval, 5 ms) while the other thread runs Python, so a generate()
        # begun first made ~80 ops in the 0.4 s, and twice in a day its first step began only after
        # crunch_numbers ended: no overlap at all.
        work = [generate, lambda: (stepping.wait(), crunch_numbers())]
    else:
        work = [generate, generate]
    workers = [threading.Thread(target=lambda fn=fn: (go.wait(), fn())) for fn in work]
    for worker in workers:
        worker.start()  # (before the profiler: the threads it records are those alive when it starts)
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=with_stack,
                 experimental_config=config) as prof:
        go.set()
        for worker in workers:
            worker.join()
    path = tmp_path / f"gil_{beside}_{with_stack}.json"
    prof.export_chrome_trace(str(path))
    return load_trace(path)


@pytest.fixture(scope="module")
def beside_python(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    return _traced(tmp_path_factory.mktemp("gil"), "python")


def _stalls(trace: Trace) -> list:
    return [f for f in analyse(trace).findings if f.kind == "decode_gap" and f.evidence.get("where") == "inside_step"]


def test_a_step_held_by_another_threads_python_is_a_wait_for_the_gil(beside_python: Trace) -> None:
    trace = beside_python
    steps = find_steps(trace)
    stacks = HostStacks(trace, int(trace.rank.min()))
    waited = sum(float(stacks.gil_wait(s.tid, np.array([s.start_us]), np.array([s.end_us]))[0]) for s in steps)
    # The trace shows it: much of the steps' time is their Python beside crunch_numbers'.
    crunch = [(int(trace.tid[r]), float(trace.ts[r]), float(trace.dur[r]))
              for r in np.flatnonzero(trace.mask_name(lambda n: "crunch_numbers" in n))]
    assert waited >= 0.25 * sum(s.dur_us for s in steps), (  # (what the trace held, when it did not)
        waited, [(s.tid, s.start_us, s.end_us) for s in steps], sorted(stacks.unframed), crunch,
        {int(t): int((trace.tid == t).sum()) for t in np.unique(trace.tid)})
    stalls = _stalls(trace)
    assert "gil_contention" in {f.evidence["cause"] for f in stalls}, [f.title for f in stalls]
    (finding,) = [f for f in stalls if f.evidence["cause"] == "gil_contention"]
    assert finding.severity == "critical" and "crunch_numbers" in finding.title, finding.title
    worst = finding.evidence["worst_gaps"][0]
    step_threads = {s.tid for s in steps}
    assert worst["thread"] in step_threads and worst["ran_instead"]["thread"] not in step_threads
    assert worst["gil_wait_us"] > 0 and "waited for the GIL" in finding.title
    # The figures stay inside the steps: never more stalled than the steps took.
    assert finding.cost_ms * 1000 <= sum(s.dur_us for s in steps)


def test_another_requests_model_call_holding_the_gil_is_concurrent_steps(tmp_path: Path) -> None:
    trace = _traced(tmp_path, "generate")
    stalls = [f for f in _stalls(trace) if f.evidence["cause"] in ("gil_contention", "concurrent_steps")]
    # Two generate() calls on a busy 2-core machine may or may not stall each other past the bar;
    # where they do, the thread that held the GIL was in its own model steps.
    for finding in stalls:
        assert finding.evidence["cause"] == "concurrent_steps", finding.title
        assert {g["thread"] for g in finding.evidence["worst_gaps"]} <= {s.tid for s in find_steps(trace)}


def test_one_thread_alone_never_waits_for_the_gil(tmp_path: Path) -> None:
    model = _llama()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof, torch.no_grad():
        model.generate(PROMPT, **GENERATE)
    path = tmp_path / "alone.json"
    prof.export_chrome_trace(str(path))
    trace = load_trace(path)
    stacks = HostStacks(trace, int(trace.rank.min()))
    for step in find_steps(trace):
        assert stacks.gil_wait(step.tid, np.array([step.start_us]), np.array([step.end_us]))[0] == 0.0
    assert not [f for f in _stalls(trace) if f.evidence["cause"] in ("gil_contention", "concurrent_steps")]


spans = st.lists(st.tuples(st.integers(0, 200), st.integers(1, 30)), max_size=25)


@settings(max_examples=300, deadline=None)
@given(spans, spans)
def test_intersect_is_the_overlap_of_two_sets_of_intervals(first: list, second: list) -> None:
    def blocks(pairs: list) -> tuple[np.ndarray, np.ndarray]:
        return merge(np.array([a for a, _ in pairs], dtype=float), np.array([a + n for a, n in pairs], dtype=float))

    (s1, e1), (s2, e2) = blocks(first), blocks(second)
    start, end = intersect(s1, e1, s2, e2)
    grid = np.arange(0, 240) + 0.5  # (integer ends: the unit cells' centres tell what is covered)

    def inside(s: np.ndarray, e: np.ndarray) -> np.ndarray:
        return ((grid[:, None] > s) & (grid[:, None] < e)).any(axis=1)

    assert (inside(start, end) == (inside(s1, e1) & inside(s2, e2))).all()
    assert (np.diff(start) > 0).all() and (start[1:] >= end[:-1]).all() and (end > start).all()
