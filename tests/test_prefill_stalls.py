"""A stalled prefill is a gap inside the prefill (detect/stalled_steps.py). Before 2026-11-28 only
decode steps were judged: a prefill held by a blocking call inside the model call, or by another
thread's pure Python holding the GIL (a tiny Llama's ~2 ms prefill took 94 ms beside an 80 ms
pure-Python loop, 51% of it unrecorded), was no finding at all. The test holds the prefill with a
blocking call in a layer's forward hook on the first call only (a hook that fetches an adapter or
logs to a service), long enough to be a quarter of the prefill however busy the machine (a loaded
one stretches the ops, not the sleep); a clean prefill (no hook) stays no finding.

Real parts: transformers' tiny Llama (tests/_tiny_llm.py) run by ``generate()`` under the real
profiler on the CPU, record_shapes and no stacks, as users trace it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from _tiny_llm import PROMPT, tiny_llama
from torch.profiler import ProfilerActivity, profile

from servprof.detect.analysis import analyse
from servprof.detect.gap import CPU_MIN_GAP_US
from servprof.detect.host_classes import UNTRACED
from servprof.detect.host_stacks import HostStacks
from servprof.detect.steps import find_steps
from servprof.trace import load_trace
from servprof.trace.model import Trace

pytest.importorskip("transformers")

BLOCK_S = 0.3
GENERATE = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}


def _traced(tmp_path: Path, blocking: bool) -> Trace:
    torch.manual_seed(0)
    model = tiny_llama()
    with torch.no_grad():
        model.generate(PROMPT, **GENERATE)  # (warm-up, not traced)
    calls = []

    def block_the_first_call(_module: torch.nn.Module, _args: object) -> None:
        calls.append(1)
        if blocking and len(calls) == 1:
            time.sleep(BLOCK_S)

    model.model.layers[0].register_forward_pre_hook(block_the_first_call)  # (inside the step: after the embedding)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof, torch.no_grad():
        model.generate(PROMPT, **GENERATE)
    path = tmp_path / f"prefill_{blocking}.json"
    prof.export_chrome_trace(str(path))
    return load_trace(path)


def test_a_prefill_held_by_a_blocking_call_is_a_gap_inside_it(tmp_path: Path) -> None:
    trace = _traced(tmp_path, blocking=True)
    (prefill,) = [s for s in find_steps(trace) if s.kind == "prefill"]
    gaps = [(f, g) for f in analyse(trace).findings if f.kind == "decode_gap" and f.evidence.get("where") == "inside_step"
            for g in f.evidence["worst_gaps"]]
    inside = [(f, g) for f, g in gaps if prefill.start_us <= g["start_us"] and g["end_us"] <= prefill.end_us]
    assert inside, [f.title for f, _g in gaps]
    finding, gap = inside[0]
    assert "prefill" in finding.title or "model steps" in finding.title, finding.title  # (a busy machine: decode too)
    assert gap["idle_us"] >= BLOCK_S * 1e6 * 0.9 and gap["thread"] == prefill.tid
    assert gap["cause"] == "untraced_host_time" and "with_stack" in finding.fix  # (a sleep without stacks: unnamed)


def test_a_prefill_alone_is_no_gap(tmp_path: Path) -> None:
    """What a gap inside a clean prefill may hold is its thread's longer holes (a machine this busy
    takes the CPU away: a real stall), never the interpreter's slivers between ops."""
    trace = _traced(tmp_path, blocking=False)
    (prefill,) = [s for s in find_steps(trace) if s.kind == "prefill"]
    stack = HostStacks(trace, int(trace.rank.min())).thread(prefill.tid)
    hole = (stack.start >= prefill.start_us) & (stack.end <= prefill.end_us) & (stack.cls == UNTRACED)
    lengths = stack.end[hole] - stack.start[hole]
    long = float(lengths[lengths >= CPU_MIN_GAP_US].sum())
    findings = analyse(trace).findings
    inside = [g for f in findings if f.kind == "decode_gap" for g in f.evidence.get("worst_gaps", [])
              if prefill.start_us <= g["start_us"] < prefill.end_us]
    assert sum(g["idle_us"] for g in inside) <= long + 1.0, ([f.title for f in findings], long)
