"""A prefill stalled by another thread is a gap inside the prefill (detect/stalled_steps.py): a
thread running pure Python (a handler's slow tokenizer or JSON work) for 80 ms from the moment
``generate()`` starts holds the GIL through most of the prefill of a model whose prefill takes
~2 ms alone. Before 2026-11-28 only decode steps were judged, and a prefill slowed ~40x was no
finding at all; a clean prefill (the same model, no other thread) stays no finding.

Real parts: transformers' tiny Llama (tests/_tiny_llm.py) run by ``generate()`` under the real
profiler on the CPU, record_shapes and no stacks, as users trace it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from _tiny_llm import PROMPT, tiny_llama
from torch.profiler import ProfilerActivity, profile

from servprof.detect.analysis import analyse
from servprof.detect.steps import find_steps
from servprof.trace import load_trace
from servprof.trace.model import Trace

pytest.importorskip("transformers")

HOG_S = 0.08
GENERATE = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}


def _traced(tmp_path: Path, hog: bool) -> Trace:
    torch.manual_seed(0)
    model = tiny_llama()
    with torch.no_grad():
        model.generate(PROMPT, **GENERATE)  # (warm-up, not traced)
    started = threading.Event()
    model.register_forward_pre_hook(lambda _module, _args: started.set())

    def hold_the_gil() -> None:
        started.wait(10)
        until = time.perf_counter() + HOG_S
        while time.perf_counter() < until:
            sum(i * i for i in range(500))

    other = threading.Thread(target=hold_the_gil if hog else started.wait, args=() if hog else (10,))
    other.start()  # (before the profiler: the threads it records are those alive when it starts)
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, experimental_config=config) as prof:
        with torch.no_grad():
            model.generate(PROMPT, **GENERATE)
        other.join()
    path = tmp_path / f"prefill_{hog}.json"
    prof.export_chrome_trace(str(path))
    return load_trace(path)


def test_a_prefill_held_by_another_threads_python_is_a_gap_inside_it(tmp_path: Path) -> None:
    trace = _traced(tmp_path, hog=True)
    steps = find_steps(trace)
    (prefill,) = [s for s in steps if s.kind == "prefill"]
    gaps = [(f, g) for f in analyse(trace).findings if f.kind == "decode_gap" and f.evidence.get("where") == "inside_step"
            for g in f.evidence["worst_gaps"]]
    inside = [(f, g) for f, g in gaps if prefill.start_us <= g["start_us"] and g["end_us"] <= prefill.end_us]
    assert inside, [f.title for f, _g in gaps]
    # (With the decode steps the other thread also held, the title says "model steps". Nothing on the
    # hog's thread is recorded without stacks: the cause is untraced host time, at least info.)
    finding, gap = inside[0]
    assert "prefill" in finding.title or "model steps" in finding.title, finding.title
    assert gap["idle_us"] >= 0.25 * prefill.dur_us and gap["thread"] == prefill.tid


def test_a_prefill_alone_is_no_gap(tmp_path: Path) -> None:
    trace = _traced(tmp_path, hog=False)
    (prefill,) = [s for s in find_steps(trace) if s.kind == "prefill"]
    findings = analyse(trace).findings
    assert not [g for f in findings if f.kind == "decode_gap" for g in f.evidence.get("worst_gaps", [])
                if prefill.start_us <= g["start_us"] < prefill.end_us], [f.title for f in findings]
